"""The ssh backend: ``bpslaunch -H host1:4,host2:4 COMMAND`` (or ``--hostfile FILE``) runs one
job on several hosts, started from one command over ssh.

First every host is checked in parallel (ssh in batch mode with a connect timeout, and the
Python there must import bps_gossip: ``python -m bps_gossip.launch.remote --probe``). Then the
scheduler runs on the first host, the servers one per host (``--num-servers`` to change),
and the workers fill the hosts' slots in order, each process through its own ssh
connection to :mod:`bps_gossip.launch.remote`, which runs it in the same directory as bpslaunch
with the job's DMLC_* environment and secret. Output is prefixed with rank and host. The
first failure, or Ctrl-C, stops every process on every host: closing a connection stops
what runs at its other end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..transport.addresses import launcher_node_host
from .backend import Backend, Process, note
from .elastic import ElasticOptions
from .hostfile import Host, Placement, parse_hosts, place_workers, read_hostfile
from .supervisor import Child, Supervisor

# Every exportable variable of bpslaunch's environment is forwarded (as horovodrun does: PATH
# and VIRTUAL_ENV from an activated virtualenv make a bare `python` the same one there), except
# what describes this host, this login or this launch, and what bpslaunch sets per process.
_NOT_FORWARDED = {"BPS_GOSSIP_SECRET", "BPS_GOSSIP_SECRET_FILE", "DMLC_ROLE", "DMLC_WORKER_ID",
                  "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
                  "DMLC_NODE_HOST", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BPS_GOSSIP_PORT",
                  "HOSTNAME", "HOST", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY", "MAIL",
                  "TMPDIR", "WINDOWID", "KRB5CCNAME", "LS_COLORS"}
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "DBUS_", "TMUX", "STY", "BASH_FUNC_", "SLURM_", "OMPI_", "PMI_",
                           "PMIX_", "HYDRA_")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PROBE_SECONDS = 30.0  # for one host's check, connection included
REMOTE_MODULE = "bps_gossip.launch.remote"  # what ssh runs on every host


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How bpslaunch reaches the hosts: ssh's port, identity file and extra ``-o`` options."""

    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: int = 10

    def argv(self, host: Host, remote_command: Sequence[str]) -> list[str]:
        """The ssh command line that runs ``remote_command`` on ``host``."""
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        for option in self.options:
            argv += ["-o", option]
        return [*argv, host.target, shlex.join(remote_command)]


def forwarded_env(env: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The variables every remote process gets: every one of ``env`` but those of this host,
    login or launch (``_NOT_FORWARDED``), and each ``-x NAME`` (its value here) or
    ``-x NAME=VALUE``, as mpirun and horovodrun take them (also to forward one of those)."""
    out = {k: v for k, v in env.items()
           if _NAME.match(k) and k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}
    for item in names:
        name, equals, value = item.partition("=")
        if not _NAME.match(name):
            raise ConfigError(f"-x {item!r}: {name!r} is not an environment variable name")
        if equals:
            out[name] = value
        elif name in env:
            out[name] = env[name]
        else:
            raise ConfigError(f"-x {name}: {name} is not set here (use -x {name}=VALUE to give a value)")
    return out


def job_secret(env: Mapping[str, str]) -> str:
    """The job's secret: BPS_GOSSIP_SECRET, or the content of BPS_GOSSIP_SECRET_FILE, or a fresh
    one (remote hosts get it on their ssh connection's stdin, never on a command line)."""
    if env.get("BPS_GOSSIP_SECRET"):
        return env["BPS_GOSSIP_SECRET"]
    path = env.get("BPS_GOSSIP_SECRET_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                return file.read().strip()
        except OSError as exc:
            raise ConfigError(f"BPS_GOSSIP_SECRET_FILE={path}: cannot read it: {exc.strerror}") from None
    return secrets.token_hex(32)


def probe_host(host: Host, ssh: SshOptions, python: str, program: str = "", path: str = "") -> dict:
    """Check one host (see :func:`.remote.probe`; with ``program``: what it runs there with the
    forwarded ``path``); its answer, or ConfigError saying why it cannot be used."""
    which = ["--which", program, path] if program else []
    argv = ssh.argv(host, [python, "-m", REMOTE_MODULE, "--probe", *which])
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{host.target}: no answer within {PROBE_SECONDS:.0f} s") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        hint = " (ssh could not log in)" if done.returncode == 255 else f" ({python} -m {REMOTE_MODULE} failed)"
        raise ConfigError(f"{host.target}{hint}: {why}")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ConfigError(f"{host.target}: unexpected answer to the check: {done.stdout[-200:]!r}") from None
    if not isinstance(answer, dict):
        raise ConfigError(f"{host.target}: unexpected answer to the check: {done.stdout[-200:]!r}")
    if program and not answer.get("program"):
        raise ConfigError(f"{host.target}: {program!r} is not found there with the PATH forwarded from here "
                          f"({path or 'none'})")
    return answer


def probe_hosts(hosts: Sequence[Host], ssh: SshOptions, python: str, program: str = "",
                path: str = "") -> dict[str, dict]:
    """Check every host at once (:func:`probe_host`); return each one's answer, or raise
    ConfigError naming every host that failed and why."""
    failures = []
    answers: dict[str, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        for host, future in [(host, pool.submit(probe_host, host, ssh, python, program, path)) for host in hosts]:
            try:
                answers[host.address] = future.result()
            except ConfigError as exc:
                failures.append(str(exc))
    if failures:
        raise ConfigError("cannot use every host:\n  " + "\n  ".join(failures))
    return answers


def plan(placements: Sequence[Placement], num_servers: int | None, root_port: int,
         common: Mapping[str, str]) -> list[Process]:
    """Every process of the job: the scheduler on the first host, servers one per host (or
    ``num_servers`` spread over the hosts in turn), then the workers host by host."""
    hosts = [p.host for p in placements]
    servers = len(hosts) if num_servers is None else num_servers
    if servers < 1:
        raise ConfigError(f"--num-servers {servers}: the number of servers must be >= 1")
    base = {**common, "DMLC_NUM_WORKER": str(len(placements)), "DMLC_NUM_SERVER": str(servers),
            "DMLC_PS_ROOT_URI": hosts[0].address, "DMLC_PS_ROOT_PORT": str(root_port),
            "PYTHONUNBUFFERED": "1"}
    processes = [Process("scheduler", "scheduler", f"[scheduler@{hosts[0].address}] ",
                         {**base, "DMLC_ROLE": "scheduler", **launcher_node_host(common, hosts[0].address)}, hosts[0])]
    for index in range(servers):
        host = hosts[index % len(hosts)]
        processes.append(Process("server", f"server{index}", f"[server{index}@{host.address}] ",
                                 {**base, "DMLC_ROLE": "server", **launcher_node_host(common, host.address)}, host))
    for placement in placements:
        address = placement.host.address
        for local_rank in range(placement.workers):
            rank = placement.first_rank + local_rank
            processes.append(Process("worker", f"worker{rank}", f"[{rank}@{address}] ", {
                **base, "DMLC_ROLE": "worker", **launcher_node_host(common, address), "DMLC_WORKER_ID": str(placement.index),
                "BYTEPS_LOCAL_SIZE": str(placement.workers), "BYTEPS_LOCAL_RANK": str(local_rank)}, placement.host))
    return processes


class SshBackend(Backend):
    """Every process of the job on the placements' hosts, each through its own ssh connection
    to :mod:`.remote` (closing the connection stops the process)."""

    def __init__(self, placements: Sequence[Placement], num_servers: int | None = None,
                 forward: Sequence[str] = (), ssh: SshOptions | None = None, python: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.placements = list(placements)
        self.num_servers = num_servers
        self.forward = list(forward)
        self.ssh = ssh or SshOptions()
        self.python = python or sys.executable
        self.env = os.environ if env is None else env
        self.secret = ""  # the job's, read or made by plan()
        self.cwd = ""  # where the processes run on every host: bpslaunch's directory

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> SshBackend | None:
        if args.hosts is None and args.hostfile is None:
            return None
        if args.hosts is not None and args.hostfile is not None:
            raise ConfigError("give the hosts with -H or with --hostfile, not both")
        if ElasticOptions.from_args(args) != ElasticOptions():  # --reset-limit or --elastic-timeout alone
            raise ConfigError("--reset-limit and --elastic-timeout need an elastic job: give --min-np and/or --max-np")
        hosts = parse_hosts(args.hosts) if args.hosts is not None else read_hostfile(args.hostfile)
        ssh = SshOptions(args.ssh_port, args.ssh_identity_file, tuple(args.ssh_options))
        return cls(place_workers(hosts, args.num_proc), args.num_servers, args.forward, ssh, args.remote_python, env)

    def plan(self, command: list[str]) -> list[Process]:
        if not command:
            raise ConfigError("no command given for the workers (e.g. bpslaunch -H a:2,b:2 python train.py)")
        common = forwarded_env(self.env, self.forward)
        self.secret = job_secret(self.env)
        self.cwd = os.getcwd()
        probes = probe_hosts([p.host for p in self.placements], self.ssh, self.python, command[0],
                             common.get("PATH", ""))
        runs = sorted({f"{answer['program']} on {address}" for address, answer in probes.items()})
        note(f"the command runs {', '.join(runs)}")
        first = self.placements[0].host.address
        root_port = int(self.env["DMLC_PS_ROOT_PORT"]) if self.env.get("DMLC_PS_ROOT_PORT") else int(
            probes[first]["port"])
        note(f"{sum(p.workers for p in self.placements)} workers on {len(self.placements)} host(s) "
             f"({', '.join(f'{p.host.address}:{p.workers}' for p in self.placements)}); scheduler at "
             f"{first}:{root_port}")
        return plan(self.placements, self.num_servers, root_port, common)

    def start(self, sup: Supervisor, process: Process, command: list[str]) -> Child:
        assert process.host is not None
        spec = json.dumps({"argv": self.argv(process, command), "cwd": self.cwd, "env": process.env,
                           "secret": self.secret})
        return sup.start(self.ssh.argv(process.host, [self.python, "-m", REMOTE_MODULE]), os.environ,
                         process.role, process.label, process.prefix, stdin_data=spec.encode() + b"\n")
