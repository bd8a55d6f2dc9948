"""``bpslaunch``: start the processes of a job, BytePS style or all on this machine.

BytePS mode (no ``-np``): the role comes from DMLC_ROLE. ``DMLC_ROLE=scheduler bpslaunch``
and ``DMLC_ROLE=server bpslaunch`` run that role in this process (they exit by themselves
once every worker has shut down); ``DMLC_ROLE=worker bpslaunch COMMAND...`` runs COMMAND
BYTEPS_LOCAL_SIZE times, with BYTEPS_LOCAL_RANK = 0..L-1, and returns the first non-zero
exit code.

Local mode: ``bpslaunch -np N [--num-servers S] COMMAND...`` runs a scheduler, S servers
and N workers on 127.0.0.1, prefixes each output line of a worker with ``[rank] ``, and
stops everything as soon as one worker fails or bpslaunch gets SIGINT/SIGTERM/SIGHUP.
With ``--min-np``/``--max-np`` the local job is elastic: a failed worker is restarted up to
``--reset-limit`` times (:mod:`bps_gossip.launch_elastic`), and ``bpslaunch --join COMMAND``
adds a worker to a running elastic job.

Slurm and mpirun: ``srun -n N bpslaunch COMMAND...`` or ``mpirun -np N bpslaunch COMMAND...``
(no ``-np``, no ``-H``, no DMLC_ROLE) makes every task one worker; the first task of each node
also runs a server, and task 0 the scheduler (:mod:`bps_gossip.batch_env` derives the DMLC_*
variables; ``--no-batch-env`` turns this off).

Every child runs in its own session, so that stopping it also stops whatever it started:
the launcher sends the signal to the child's process group, waits a grace period, then
sends SIGKILL. The environment is checked with :func:`load_config` before anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping

from . import batch_env
from .config import TRAINER_MODES, load_config
from .errors import ConfigError
from .hosts import parse_hosts, place_workers, read_hostfile
from .launch_elastic import (
    ElasticOptions,
    ElasticRun,
    check_elastic_env,
    join_command,
    join_env,
    restart_delay,
)
from .launch_ssh import SshOptions, run_hosts
from .supervisor import Supervisor
from .transport import shm

_LOCAL_OVERRIDES = ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BPS_GOSSIP_PORT")


# -- the two modes -----------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _check_command(command: list[str], env: Mapping[str, str]) -> None:
    if not command:
        raise ConfigError("no command given for the workers (e.g. bpslaunch python train.py)")
    if shutil.which(command[0], path=env.get("PATH")) is None:
        raise ConfigError(f"command not found or not executable: {command[0]!r}")


def run_local(num_proc: int, num_servers: int, command: list[str],
              base_env: Mapping[str, str] | None = None, elastic: ElasticOptions | None = None) -> int:
    """Local mode: a scheduler, ``num_servers`` servers and ``num_proc`` workers on 127.0.0.1.

    With one worker and BYTEPS_FORCE_DISTRIBUTED unset, the worker runs alone. Returns the
    first non-zero exit code (or 128 + signal when bpslaunch was stopped), else 0. An elastic
    job (``elastic`` flags, or BPS_GOSSIP_ELASTIC=1) restarts failed workers instead of
    stopping (see :mod:`bps_gossip.launch_elastic`).
    """
    elastic = elastic or ElasticOptions()
    if num_proc < 1:
        raise ConfigError(f"-np {num_proc}: the number of workers must be >= 1")
    if num_servers < 1:
        raise ConfigError(f"--num-servers {num_servers}: the number of servers must be >= 1")
    base = {k: v for k, v in (os.environ if base_env is None else base_env).items()
            if k not in _LOCAL_OVERRIDES}
    elastic.check(num_proc)
    _check_command(command, base)
    port = free_port()
    secret_file = None
    if not base.get("BPS_GOSSIP_SECRET") and not base.get("BPS_GOSSIP_SECRET_FILE"):
        secret_file = base["BPS_GOSSIP_SECRET_FILE"] = make_secret_file(port)
    base.update({
        "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": str(num_servers), "BYTEPS_LOCAL_SIZE": str(num_proc),
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": "127.0.0.1",
        **elastic.env(),
    })
    base.setdefault("PYTHONUNBUFFERED", "1")  # piped Python output would otherwise come in blocks
    workers = [{**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_RANK": str(rank)}
               for rank in range(num_proc)]
    configs = [load_config(env) for env in workers]  # validates every worker
    config = configs[0]
    check_elastic_env(elastic, config, num_proc)
    services: list[tuple[str, str]] = []
    if any(c.distributed for c in configs):
        services = [("scheduler", "scheduler")] + [("server", f"server{i}") for i in range(num_servers)]
    for role, _ in services:
        load_config({**base, "DMLC_ROLE": role})
    try:
        with Supervisor() as sup:
            for role, label in services:
                sup.start([sys.executable, "-m", f"bps_gossip.{role}"], {**base, "DMLC_ROLE": role},
                          role, label, f"[{label}] ")
            first = {rank: sup.start(command, env, "worker", f"worker {rank}", f"[{rank}] ")
                     for rank, env in enumerate(workers)}
            if not config.elastic:
                return sup.wait(fail_fast=True)
            sup.note(f"elastic job; add a worker with: {join_command(port, command, secret_file)}")
            # A replacement keeps its slot's BYTEPS_LOCAL_RANK: it joins the running job at the next
            # commit (ranks come from the scheduler), or fills the slot if the job has not started.
            return ElasticRun(sup, first, command, lambda slot: workers[slot], elastic.reset_limit,
                              restart_delay(config)).run()
    finally:
        shm.sweep(str(port))  # segments of workers that were killed (they could not unlink)
        if secret_file is not None:
            os.unlink(secret_file)


def make_secret_file(port: int) -> str:
    """A fresh job secret in a file only this user can read; the children read it from there
    (BPS_GOSSIP_SECRET_FILE), so it is in no process's command line or environment."""
    fd, path = tempfile.mkstemp(prefix=f"bpsg_secret_{port}_")  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    return path


def run_join(root: str | None, command: list[str], env: Mapping[str, str] | None = None) -> int:
    """``bpslaunch --join``: one worker process that joins the running elastic job at ``root``
    (HOST:PORT, default DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT). Returns its exit code."""
    child_env = join_env(root, os.environ if env is None else env)
    _check_command(command, child_env)
    print(f"bpslaunch: joining the elastic job at {child_env.get('DMLC_PS_ROOT_URI', '127.0.0.1')}:"
          f"{child_env['DMLC_PS_ROOT_PORT']} (admitted at its next commit)", file=sys.stderr, flush=True)
    with Supervisor() as sup:
        sup.start(command, child_env, "worker", "worker", None)
        return sup.wait(fail_fast=False)


def run_byteps(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """BytePS mode: run the role named by DMLC_ROLE (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    config = load_config(env)
    if config.role != "worker":
        if command:
            print(f"bpslaunch: DMLC_ROLE={config.role} runs the {config.role}; ignoring the command "
                  f"{' '.join(command)!r}", file=sys.stderr, flush=True)
        return int(importlib.import_module(f"bps_gossip.{config.role}").main())
    _check_command(command, env)
    size = config.local_size
    envs = [{**env, "BYTEPS_LOCAL_RANK": str(rank), "BYTEPS_LOCAL_SIZE": str(size)} for rank in range(size)]
    if size > 1:
        for child_env in envs:
            load_config(child_env)
            child_env.setdefault("PYTHONUNBUFFERED", "1")
    with Supervisor() as sup:
        for rank, child_env in enumerate(envs):
            sup.start(command, child_env, "worker", f"local rank {rank}", f"[{rank}] " if size > 1 else None)
        # No fail-fast: surviving workers see the loss themselves (and elastic jobs go on).
        return sup.wait(fail_fast=False)


def run_batch(place: batch_env.Layout, command: list[str], env: Mapping[str, str] | None = None) -> int:
    """One task of ``srun bpslaunch ...`` or ``mpirun bpslaunch ...``: its worker, and the server
    and scheduler :func:`bps_gossip.batch_env.plan` gives it. Returns the worker's exit code once
    this task's scheduler and server have ended too (they do once every worker of the job has
    shut down); a failed worker, or a service that fails first, stops them all at once."""
    env = dict(os.environ if env is None else env)
    _check_command(command, env)
    processes = batch_env.plan(env, place, socket.gethostname())
    worker = load_config(processes[-1].env)
    if not worker.distributed:
        processes = processes[-1:]  # a one-task job: no scheduler or server, as with -np 1
    for process in processes[:-1]:
        load_config(process.env)
    if place.rank == 0 and worker.distributed:
        print(f"bpslaunch: {batch_env.describe(place, processes, env)}", file=sys.stderr, flush=True)
        if worker.keys is None:
            print("bpslaunch: no job secret (BPS_GOSSIP_SECRET / BPS_GOSSIP_SECRET_FILE unset): sockets "
                  "are not authenticated or encrypted, as in BytePS; see docs/launcher.md to set one",
                  file=sys.stderr, flush=True)
    with Supervisor() as sup:
        for process in processes:
            argv = command if process.role == "worker" else [sys.executable, "-m", f"bps_gossip.{process.role}"]
            sup.start(argv, process.env, process.role, process.label, process.prefix)
        # This task's scheduler and server serve the other tasks' workers too: no deadline.
        return sup.wait(fail_fast=True, services_seconds=None)


def _run_multi_host(args: argparse.Namespace, command: list[str], elastic: ElasticOptions) -> int:
    if args.hosts is not None and args.hostfile is not None:
        raise ConfigError("give the hosts with -H or with --hostfile, not both")
    if elastic != ElasticOptions():
        raise ConfigError("elastic jobs (--min-np, --max-np, ...) run on one host; over several hosts, start "
                          "each role BytePS style with BPS_GOSSIP_ELASTIC=1")
    hosts = parse_hosts(args.hosts) if args.hosts is not None else read_hostfile(args.hostfile)
    placements = place_workers(hosts, args.num_proc)
    ssh = SshOptions(args.ssh_port, args.ssh_identity_file, tuple(args.ssh_options))
    return run_hosts(placements, args.num_servers, command, args.forward, ssh, args.remote_python)


# -- command line ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of bpslaunch."""
    parser = argparse.ArgumentParser(
        prog="bpslaunch",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Launch a bps_gossip job: BytePS style from the DMLC_* environment, or all "
                    "on this machine with -np.",
        epilog="""examples:
  bpslaunch -np 4 python train.py --epochs 3    scheduler, 1 server, 4 workers here
  bpslaunch -np 4 --num-servers 2 -- python train.py
  DMLC_ROLE=scheduler bpslaunch                  BytePS mode, one role per command
  DMLC_ROLE=server bpslaunch
  DMLC_ROLE=worker DMLC_WORKER_ID=0 BYTEPS_LOCAL_SIZE=2 bpslaunch python train.py
  bpslaunch -np 4 --min-np 2 --max-np 6 --reset-limit 3 python train.py   elastic, local
  bpslaunch --join --root 127.0.0.1:9000 python train.py                  one more worker
  bpslaunch -np 8 -H host1:4,host2:4 python train.py     over ssh, 4 workers on each host
  bpslaunch --hostfile hosts.txt -x LD_LIBRARY_PATH python train.py   lines 'host slots=N'
  srun -n 8 bpslaunch python train.py            Slurm: one worker per task, a server per node
  mpirun -np 4 bpslaunch python train.py         the same from Open MPI's or MPICH's variables

BytePS mode reads DMLC_ROLE (worker, server or scheduler), DMLC_NUM_WORKER (worker
machines), BYTEPS_LOCAL_SIZE (worker processes per machine), DMLC_WORKER_ID (this
machine's index), DMLC_NUM_SERVER, DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT (the
scheduler's address). A bad or missing variable is an error (exit status 2).

Elastic local jobs (--min-np/--max-np) restart a failed worker (its output is prefixed
[wK], K counting worker processes) until --reset-limit restarts are used (default: no
limit); workers joining with --join are admitted at the next commit. The job fails when
fewer than --min-np workers remain for longer than --elastic-timeout seconds.

Exit status: the first non-zero exit code of a worker (128+N for signal N), 0 when
every worker succeeded, 2 for a bad environment or command line. Elastic: 0 when every
slot's last worker exited 0, else the failed worker's code or the scheduler's (1).""",
    )
    parser.add_argument("-np", "--num-proc", type=int, metavar="N",
                        help="local mode: run N worker processes on this machine, plus a scheduler "
                             "and servers (none when N is 1, unless BYTEPS_FORCE_DISTRIBUTED=1)")
    parser.add_argument("--num-servers", type=int, metavar="S",
                        help="local mode: the number of servers (default 1)")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="also write each process's output, without prefixes, to DIR/worker0.log, "
                             "DIR/server0.log, DIR/scheduler.log, ...")
    parser.add_argument("--timestamps", action="store_true", help="begin every forwarded line with the time")
    parser.add_argument("--no-batch-env", action="store_true",
                        help="ignore Slurm's and MPI's task variables (SLURM_PROCID, OMPI_COMM_WORLD_RANK, "
                             "PMI_RANK, ...): without -np, -H and DMLC_ROLE, run BytePS mode as before")
    parser.add_argument("--mode", choices=TRAINER_MODES,
                        help="DistributedTrainer's default mode for this job (sets BPS_GOSSIP_MODE): gossip "
                             "(SGP, the default) or allreduce (BytePS's gradient averaging)")
    multi = parser.add_argument_group("several hosts over ssh (as horovodrun and mpirun)")
    multi.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="the hosts and how many workers each may run, e.g. host1:4,host2:4 (slots "
                            "default to 1); workers fill them in order; -np defaults to every slot")
    multi.add_argument("--hostfile", metavar="FILE", help="the hosts, one per line: 'host slots=N'")
    multi.add_argument("-x", dest="forward", action="append", default=[], metavar="NAME[=VALUE]",
                       help="also give this variable to every process (BYTEPS_*, BPS_GOSSIP_*, DMLC_*, "
                            "MXNET_* and OMP_* are always passed on); repeatable")
    multi.add_argument("--ssh-port", type=int, metavar="PORT", help="ssh's port on every host")
    multi.add_argument("--ssh-identity-file", metavar="FILE", help="ssh's private key (ssh -i)")
    multi.add_argument("--ssh-option", dest="ssh_options", action="append", default=[], metavar="OPT",
                       help="an ssh option (ssh -o OPT), e.g. StrictHostKeyChecking=accept-new; repeatable")
    multi.add_argument("--remote-python", metavar="PATH",
                       help="the Python that runs bps_gossip on the hosts (default: this one's path, "
                            f"{sys.executable})")
    elastic = parser.add_argument_group("elastic jobs (local mode)")
    elastic.add_argument("--min-np", type=int, metavar="A",
                         help="elastic: the job fails when fewer than A workers remain for longer than "
                              "the elastic timeout (default 1)")
    elastic.add_argument("--max-np", type=int, metavar="B",
                         help="elastic: refuse workers that would make more than B (default: no limit)")
    elastic.add_argument("--reset-limit", type=int, metavar="R",
                         help="elastic: restart failed workers at most R times in all (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="SECONDS",
                         help="elastic: how long the job may stay below --min-np (BPS_GOSSIP_ELASTIC_TIMEOUT, "
                              "default 60)")
    elastic.add_argument("--join", action="store_true",
                         help="run one worker process that joins a running elastic job")
    elastic.add_argument("--root", metavar="HOST:PORT",
                         help="with --join: the job's scheduler (default DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...",
                        help="the worker command and its arguments (options after it are its own); "
                             "'--' may separate it from bpslaunch's options")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bpslaunch`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    elastic = ElasticOptions(args.min_np, args.max_np, args.reset_limit, args.elastic_timeout)
    Supervisor.output_dir, Supervisor.timestamps = args.output_dir, args.timestamps
    if args.mode is not None:  # every child inherits it, whichever way the job is launched
        os.environ["BPS_GOSSIP_MODE"] = args.mode
    try:
        if args.join:
            if args.num_proc is not None or args.num_servers is not None or elastic != ElasticOptions():
                raise ConfigError("--join runs one worker of a running job: -np, --num-servers and the "
                                  "other elastic flags belong to the job's own bpslaunch")
            return run_join(args.root, command)
        if args.root is not None:
            raise ConfigError("--root needs --join")
        if args.hosts is not None or args.hostfile is not None:
            return _run_multi_host(args, command, elastic)
        if args.forward or args.ssh_port is not None or args.ssh_identity_file or args.ssh_options \
                or args.remote_python:
            raise ConfigError("-x, --ssh-* and --remote-python need -H or --hostfile")
        if args.num_proc is None:
            if args.num_servers is not None:
                raise ConfigError("--num-servers needs -np; in BytePS mode set DMLC_NUM_SERVER")
            if elastic != ElasticOptions():
                raise ConfigError("--min-np, --max-np, --reset-limit and --elastic-timeout need -np; in "
                                  "BytePS mode set BPS_GOSSIP_ELASTIC, BPS_GOSSIP_MIN_WORKERS, ...")
            place = None if args.no_batch_env or os.environ.get("DMLC_ROLE") else batch_env.layout(os.environ)
            if place is not None:  # a task of srun or mpirun
                return run_batch(place, command)
            if os.environ.get("SLURM_JOB_ID") and not args.no_batch_env and not os.environ.get("DMLC_ROLE"):
                print("bpslaunch: in a Slurm job but not in an srun step: running one worker here; "
                      "'srun bpslaunch ...' runs one per task", file=sys.stderr, flush=True)
            return run_byteps(command)
        return run_local(args.num_proc, 1 if args.num_servers is None else args.num_servers, command,
                         elastic=elastic)
    except ConfigError as exc:
        print(f"bpslaunch: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the command exists but cannot be executed
        print(f"bpslaunch: cannot start: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
