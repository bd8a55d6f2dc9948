"""The local backend: ``bpslaunch -np N [--num-servers S] COMMAND...`` runs a whole job on
this machine.

A scheduler, S servers and N workers on 127.0.0.1, each worker's output behind ``[rank] ``;
everything stops as soon as one worker fails or bpslaunch gets SIGINT/SIGTERM/SIGHUP. With one
worker and BYTEPS_FORCE_DISTRIBUTED unset, the worker runs alone. Without BPS_GOSSIP_SECRET(_FILE)
the job gets a fresh secret in a file only this user can read. With ``--min-np``/``--max-np``
(or BPS_GOSSIP_ELASTIC=1) the job is elastic: a failed worker is restarted (:mod:`.elastic`).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
from collections.abc import Mapping

from .. import placement
from ..config import OWNED_SECRET_VAR, Config, load_config
from ..errors import ConfigError
from ..local_processes import REGISTRATIONS_VAR
from ..transport import shm
from .backend import Backend, Process, check_command, note
from .elastic import ElasticOptions, ElasticRun, check_elastic_env, join_command, restart_delay
from .secret_files import make_secret_file, remove_secret_file
from .supervisor import Child, Supervisor

# Local mode owns these: every process runs on this machine, in one job.
_LOCAL_OVERRIDES = ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BPS_GOSSIP_PORT", OWNED_SECRET_VAR, placement.PLACED_VAR)


LOWEST_PORT = 10000  # free_port() picks from here up to the kernel's ephemeral range
_PICKS = 100


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for port 0 and outgoing connections (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(part) for part in file.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, below the kernel's ephemeral range.

    The scheduler binds this port a moment later, while the servers and workers started beside it
    bind port 0: a port the kernel handed out for port 0 (as a plain probe's would be) can be handed
    out again to one of them first, which then answers the workers' registrations in the
    scheduler's place (seen in CI). Ports below the ephemeral range are never handed out so.
    """
    low, _ = ephemeral_ports()
    if low - LOWEST_PORT >= 1000:
        for _ in range(_PICKS):
            port = random.randrange(LOWEST_PORT, low)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:  # in use (or not allowed): another pick
                    continue
                return port
    with socket.socket() as sock:  # no room below the range: the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalBackend(Backend):
    """Every process of the job on 127.0.0.1 (``-np``)."""

    def __init__(self, num_proc: int, num_servers: int = 1, elastic: ElasticOptions | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.num_proc = num_proc
        self.num_servers = num_servers
        self.elastic = elastic or ElasticOptions()
        self.env = os.environ if env is None else env
        self.port: int | None = None  # the scheduler's, chosen by plan(); names the job's segments
        self.secret_file: str | None = None  # made by plan() when the environment has no secret
        self.workers: list[dict[str, str]] = []  # each worker slot's environment
        self.config: Config | None = None  # the first worker's, once planned

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> LocalBackend | None:
        if args.num_proc is None:
            return None
        num_servers = 1 if args.num_servers is None else args.num_servers
        return cls(args.num_proc, num_servers, ElasticOptions.from_args(args), env)

    def plan(self, command: list[str]) -> list[Process]:
        if self.num_proc < 1:
            raise ConfigError(f"-np {self.num_proc}: the number of workers must be >= 1")
        if self.num_servers < 1:
            raise ConfigError(f"--num-servers {self.num_servers}: the number of servers must be >= 1")
        base = {k: v for k, v in self.env.items() if k not in _LOCAL_OVERRIDES}
        self.elastic.check(self.num_proc)
        check_command(command, base)
        self.port = free_port()
        if not base.get("BPS_GOSSIP_SECRET") and not base.get("BPS_GOSSIP_SECRET_FILE"):
            self.secret_file = base["BPS_GOSSIP_SECRET_FILE"] = make_secret_file(self.port)
        try:
            return self._plan(base, command)
        except BaseException:  # a bad variable ends bpslaunch with status 2: the secret goes first
            self._remove_secret()
            raise

    def _plan(self, base: dict[str, str], command: list[str]) -> list[Process]:
        base.update({
            "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": str(self.num_servers),
            "BYTEPS_LOCAL_SIZE": str(self.num_proc), "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(self.port), "DMLC_NODE_HOST": "127.0.0.1", **self.elastic.env(),
        })
        base.setdefault("PYTHONUNBUFFERED", "1")  # piped Python output would otherwise come in blocks
        self.workers = [{**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_RANK": str(rank)}
                        for rank in range(self.num_proc)]
        configs = [load_config(env) for env in self.workers]  # validates every worker
        self.config = configs[0]
        check_elastic_env(self.elastic, self.config, self.num_proc)
        services = []
        if any(c.distributed for c in configs):
            # The scheduler tells bpslaunch which workers registered: one that never did is reported.
            scheduler_env = {**base, "DMLC_ROLE": "scheduler", REGISTRATIONS_VAR: "1"}
            services = [Process("scheduler", "scheduler", "[scheduler] ", scheduler_env)]
            services += [Process("server", f"server{i}", f"[server{i}] ", {**base, "DMLC_ROLE": "server"})
                         for i in range(self.num_servers)]
        for service in services:
            load_config(service.env)
        if services:
            self._place(services)
        if self.secret_file is not None and services:  # the scheduler removes it if bpslaunch is killed
            services[0].env[OWNED_SECRET_VAR] = "1"
        return services + [Process("worker", f"worker {rank}", f"[{rank}] ", env)
                           for rank, env in enumerate(self.workers)]

    def _place(self, services: list[Process]) -> None:
        """Give each worker its cores and thread counts, and the scheduler and servers the
        communication cores (bps_gossip.placement)."""
        assert self.config is not None
        placed = placement.plan_here(self.num_proc, self.workers[0], self.config.placement)
        for rank, env in enumerate(self.workers):
            env.update(placement.worker_env(placed, rank))
        for service in services:
            service.env.update(placement.service_env(placed))
        if placed.pinned:
            note(placed.summary())

    def supervise(self, sup: Supervisor, children: list[Child], command: list[str]) -> int:
        assert self.config is not None and self.port is not None
        if not self.config.elastic:
            return sup.wait(fail_fast=True)
        sup.note(f"elastic job; add a worker with: {join_command(self.port, command, self.secret_file)}")
        # A replacement keeps its slot's BYTEPS_LOCAL_RANK: it joins the running job at the next
        # commit (ranks come from the scheduler), or fills the slot if the job has not started.
        first = dict(enumerate(c for c in children if c.role == "worker"))
        return ElasticRun(sup, first, command, lambda slot: self.workers[slot], self.elastic.reset_limit,
                          restart_delay(self.config)).run()

    def close(self) -> None:
        self._remove_secret()  # first: nothing after it may keep it on disk
        if self.port is not None:
            shm.sweep(str(self.port))  # segments of workers that were killed (they could not unlink)

    def _remove_secret(self) -> None:
        remove_secret_file(self.secret_file)
        self.secret_file = None
