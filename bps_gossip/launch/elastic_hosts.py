"""Elastic jobs over several hosts, as Horovod Elastic runs them: ``bpslaunch -np N --min-np A
--max-np B --host-discovery-script SCRIPT COMMAND`` (``-H``/``--hostfile`` for a fixed list; in a
Slurm allocation of several nodes, its nodes).

The scheduler and the servers run beside bpslaunch, so a host that goes takes only workers with
it. Workers run on the hosts, each through its own ssh connection to :mod:`.remote`, as
:mod:`.ssh` starts them. The first N fill the hosts in order; every few seconds bpslaunch asks
the discovery again (:mod:`.discovery`) and then:

- starts workers on hosts with free slots, up to --max-np (none given: every slot), once the job
  has started; each joins at the job's next commit, and the scheduler re-assigns the ranks;
- stops the workers of a host the discovery no longer lists (a drained host);
- puts a host on the blacklist when one of its workers fails, its ssh connection included (ssh
  gives up on a link silent for the heartbeat timeout), and stops the host's other workers; with
  --blacklist-cooldown-range the host may come back after its cooldown, else it stays out.

Whether the job can go on is the scheduler's call: fewer than --min-np workers for longer than
--elastic-timeout fails the job; bpslaunch then stops every process on every host and exits
non-zero. A worker cut off by a network partition is declared lost by the scheduler after the
heartbeat timeout; every member refuses its old generation, and it fails as soon as it hears the
scheduler again (the scheduler no longer knows it), so it never writes into the job that went on.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import time
from collections.abc import Mapping, Sequence

from ..compat import zip_exact
from ..config import OWNED_SECRET_VAR, load_config
from ..errors import ConfigError
from ..local_processes import REGISTRATIONS_VAR
from ..transport.addresses import is_loopback, launcher_node_host, route_source
from .backend import Backend, Process, note
from .batch import detect, parse_hostlist, parse_tasks_per_node
from .discovery import Blacklist, FixedHosts, HostDiscovery, ScriptDiscovery, check_cooldown_range
from .elastic import ElasticOptions, join_env
from .hostfile import Host, Placement, parse_hosts, place_workers, read_hostfile
from .hosts_run import DISCOVERY_SECONDS, HostsRun, RemoteWorker
from .local import free_port
from .secret_files import make_secret_file, remove_secret_file
from .ssh import SshBackend, SshOptions, forwarded_env, job_secret, probe_host
from .supervisor import Child, Supervisor

START_SECONDS = 60.0  # how long the first look may wait for --min-np usable slots
SERVER_ALIVE_COUNT = 3  # ssh's keepalives a worker's connection may miss before it counts as lost
MIN_SERVER_ALIVE = 6  # seconds of silence ssh takes for a lost link, at least


def slurm_hosts(env: Mapping[str, str], slots_per_host: int | None) -> list[Host] | None:
    """The nodes of the Slurm allocation bpslaunch runs in (not inside an srun task), with
    --slots-per-host slots each, else the tasks Slurm planned per node, else 1; None outside one."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist or detect(env) is not None:
        return None
    nodes = parse_hostlist(nodelist)
    tasks = env.get("SLURM_TASKS_PER_NODE")
    per_node = parse_tasks_per_node(tasks) if tasks and slots_per_host is None else []
    if len(per_node) != len(nodes):
        per_node = [slots_per_host or 1] * len(nodes)
    return [Host(node, slots) for node, slots in zip(nodes, per_node)]


def discovery_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> HostDiscovery | None:
    """Where an elastic job's hosts come from, or None for a job on this host alone."""
    sources = [name for name, given in (("-H", args.hosts), ("--hostfile", args.hostfile),
                                        ("--host-discovery-script", args.host_discovery_script)) if given]
    if len(sources) > 1:
        raise ConfigError(f"give the hosts one way: {' and '.join(sources)} both given")
    slots = args.slots_per_host
    if slots is not None and not 1 <= slots <= 4096:
        raise ConfigError(f"--slots-per-host {slots}: must be between 1 and 4096")
    if args.host_discovery_script is not None:
        return ScriptDiscovery(args.host_discovery_script, slots or 1, env=env)
    if args.hosts is not None:
        return FixedHosts(parse_hosts(args.hosts), f"-H {args.hosts}")
    if args.hostfile is not None:
        return FixedHosts(read_hostfile(args.hostfile), f"--hostfile {args.hostfile}")
    nodes = slurm_hosts(env, slots)
    if nodes is not None and len(nodes) > 1:  # one node: the job runs here, as a local elastic job
        return FixedHosts(nodes, "the Slurm allocation's nodes")
    if slots is not None:
        raise ConfigError("--slots-per-host needs the hosts: --host-discovery-script, -H or --hostfile")
    return None


class ElasticHostsBackend(SshBackend):
    """An elastic job whose workers run on hosts that come and go (see the module docstring)."""

    fail_fast = False

    def __init__(self, discovery: HostDiscovery, num_proc: int, elastic: ElasticOptions, blacklist: Blacklist,
                 num_servers: int | None = None, forward: Sequence[str] = (), ssh: SshOptions | None = None,
                 python: str | None = None, env: Mapping[str, str] | None = None) -> None:
        super().__init__([], num_servers, forward, ssh, python, env)
        self.discovery = discovery
        self.num_proc = num_proc
        self.elastic = elastic
        self.blacklist = blacklist
        self.root = ""  # the scheduler's address, as the hosts reach it
        self.port = 0
        self.secret_file: str | None = None
        self.common: dict[str, str] = {}  # every remote process's environment, before its role's variables
        self.probed: set[str] = set()  # hosts whose check passed
        self.planned: list[Process] = []  # what plan() returned, in order

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> ElasticHostsBackend | None:
        elastic = ElasticOptions.from_args(args)
        if not elastic.requested:
            if args.host_discovery_script is not None or args.slots_per_host is not None \
                    or args.blacklist_cooldown_range is not None:
                raise ConfigError("--host-discovery-script, --slots-per-host and --blacklist-cooldown-range "
                                  "need an elastic job: give --min-np and/or --max-np")
            return None
        discovery = discovery_from_args(args, env)
        if discovery is None:
            return None  # elastic on this host: the local backend
        if args.num_proc is None:
            raise ConfigError("an elastic job over several hosts needs -np (the workers to start with)")
        elastic.check(args.num_proc)
        cooldown = None if args.blacklist_cooldown_range is None else check_cooldown_range(
            args.blacklist_cooldown_range)
        # ssh gives up on a silent link after about the heartbeat timeout, as the scheduler does on
        # its workers, and never within MIN_SERVER_ALIVE seconds: a busy machine's ssh answers late,
        # and a connection it drops blacklists a healthy host (the scheduler decides membership anyway)
        heartbeat = load_config(env).heartbeat_timeout
        alive = max(MIN_SERVER_ALIVE // SERVER_ALIVE_COUNT, math.ceil(heartbeat / SERVER_ALIVE_COUNT))
        ssh = SshOptions(args.ssh_port, args.ssh_identity_file, (
            *args.ssh_options, f"ServerAliveInterval={alive}", f"ServerAliveCountMax={SERVER_ALIVE_COUNT}"))
        return cls(discovery, args.num_proc, elastic, Blacklist(cooldown), args.num_servers, args.forward, ssh,
                   args.remote_python, env)

    # -- the first workers ------------------------------------------------------------
    def plan(self, command: list[str]) -> list[Process]:
        if not command:
            raise ConfigError("no command given for the workers (e.g. bpslaunch -np 4 --min-np 2 "
                              "--host-discovery-script ./hosts.sh python train.py)")
        self.common = {**forwarded_env(self.env, self.forward), "PYTHONUNBUFFERED": "1", **self.elastic.env()}
        self.command = command
        self.cwd = os.getcwd()  # where every worker runs, on every host
        hosts = self._first_hosts()
        placements = place_workers(hosts, min(self.num_proc, sum(h.slots for h in hosts)))
        first = placements[0].host.address
        self.root = self.env.get("DMLC_PS_ROOT_URI") or ("127.0.0.1" if is_loopback(first)
                                                        else route_source(first, 22) or first)
        self.port = int(self.env["DMLC_PS_ROOT_PORT"]) if self.env.get("DMLC_PS_ROOT_PORT") else free_port(
            "0.0.0.0")
        self.secret = job_secret(self.env)
        self.secret_file = make_secret_file(self.port, self.secret)
        servers = 1 if self.num_servers is None else self.num_servers
        if servers < 1:
            raise ConfigError(f"--num-servers {servers}: the number of servers must be >= 1")
        self.common.update({"DMLC_NUM_WORKER": str(len(placements)), "DMLC_NUM_SERVER": str(servers),
                            "DMLC_PS_ROOT_URI": self.root, "DMLC_PS_ROOT_PORT": str(self.port)})
        here = {**self.env, **self.common, **launcher_node_host(self.common, self.root), "BPS_GOSSIP_SECRET_FILE": self.secret_file}
        here.pop("BPS_GOSSIP_SECRET", None)
        services = [Process("scheduler", "scheduler", "[scheduler] ",
                            {**here, "DMLC_ROLE": "scheduler", REGISTRATIONS_VAR: "1", OWNED_SECRET_VAR: "1"})]
        services += [Process("server", f"server{i}", f"[server{i}] ", {**here, "DMLC_ROLE": "server"})
                     for i in range(servers)]
        for service in services:
            load_config(service.env)  # a bad variable is an error before anything starts
        note(f"elastic job over hosts from {self.discovery.describe()}: {self.num_proc} workers to start "
             f"({', '.join(f'{p.host.address}:{p.workers}' for p in placements)}), --min-np "
             f"{self.elastic.min_np or 1}, --max-np {self.elastic.max_np or 'every slot'}; scheduler at "
             f"{self.root}:{self.port}")
        self.planned = services + [process for placement in placements for process in self._first_workers(placement)]
        return self.planned

    def _first_hosts(self) -> list[Host]:
        """The hosts to start on: listed, checked, not blacklisted; waits (up to START_SECONDS) for
        --min-np slots."""
        needed = self.elastic.min_np or 1
        deadline = time.monotonic() + START_SECONDS
        while True:
            hosts = self.usable(self.discovery.hosts())
            self.check_hosts([h for h in hosts if h.address not in self.probed])
            hosts = [h for h in hosts if h.address in self.probed]
            if sum(h.slots for h in hosts) >= needed:
                return hosts
            if time.monotonic() > deadline:
                out = self.blacklist.active()
                why = "; ".join(f"{address}: {reason}" for address, reason in out.items())
                raise ConfigError(f"fewer than --min-np {needed} usable slots on the hosts of "
                                  f"{self.discovery.describe()} after {START_SECONDS:g} s"
                                  + (f" (left out: {why})" if why else ""))
            time.sleep(DISCOVERY_SECONDS)

    def usable(self, hosts: Sequence[Host]) -> list[Host]:
        """``hosts`` without those on the blacklist."""
        return [host for host in hosts if host.address not in self.blacklist]

    def check_hosts(self, hosts: Sequence[Host]) -> None:
        """Probe ``hosts`` at once: those that pass are remembered, the others blacklisted."""
        if not hosts:
            return
        path = self.common.get("PATH", "")
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            futures = [(h, pool.submit(probe_host, h, self.ssh, self.python, self.command[0], path)) for h in hosts]
            for host, future in futures:
                try:
                    future.result()
                    self.probed.add(host.address)
                except ConfigError as exc:
                    self.blacklist_host(host.address, f"its check failed: {exc}")

    def blacklist_host(self, address: str, why: str) -> None:
        """Keep ``address`` out (for its cooldown, or for good), saying so."""
        seconds = self.blacklist.add(address, why)
        self.probed.discard(address)  # checked again when it comes back
        out = "for good" if seconds is None else f"for {seconds:.0f} s"
        note(f"host {address} is blacklisted {out}: {why}")

    def _first_workers(self, placement: Placement) -> list[Process]:
        address = placement.host.address
        return [Process("worker", f"worker{placement.first_rank + local}", f"[{placement.first_rank + local}@{address}] ", {
            **self.common, "DMLC_ROLE": "worker", **launcher_node_host(self.common, address), "DMLC_WORKER_ID": str(placement.index),
            "BYTEPS_LOCAL_SIZE": str(placement.workers), "BYTEPS_LOCAL_RANK": str(local)}, placement.host)
            for local in range(placement.workers)]

    def joiner(self, host: Host, number: int) -> Process:
        """Worker ``number`` (counting every worker this bpslaunch started), a joiner on ``host``."""
        env = join_env(None, {**self.common, **launcher_node_host(self.common, host.address), "BPS_GOSSIP_SECRET": self.secret})
        env.pop("BPS_GOSSIP_SECRET")  # the remote end writes it to a file of its own
        return Process("worker", f"worker w{number}", f"[w{number}@{host.address}] ", env, host)

    def start(self, sup: Supervisor, process: Process, command: list[str]) -> Child:
        if process.host is None:
            return Backend.start(self, sup, process, command)
        return super().start(sup, process, command)

    def supervise(self, sup: Supervisor, children: list[Child], command: list[str]) -> int:
        workers = [RemoteWorker(child, process.host.address) for child, process in zip_exact(children, self.planned)
                   if process.host is not None]
        return HostsRun(self, sup, workers, command).run()

    def close(self) -> None:
        remove_secret_file(self.secret_file)
        self.secret_file = None
