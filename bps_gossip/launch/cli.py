"""``bpslaunch``: the command line, and the choice of the backend that runs the job.

``bpslaunch -np N COMMAND`` runs a whole job on this machine (:mod:`.local`; elastic with
``--min-np``/``--max-np``, see :mod:`.elastic`); ``bpslaunch -H host1:4,host2:4 COMMAND`` on
several hosts over ssh (:mod:`.ssh`); ``srun bpslaunch COMMAND`` or ``mpirun bpslaunch COMMAND``
one task's share of a Slurm or MPI job (:mod:`.batch`, off with ``--no-batch-env``); and with
none of these, the role DMLC_ROLE names, BytePS style (:mod:`.byteps`). ``bpslaunch --join
COMMAND`` adds one worker to a running elastic job. :data:`BACKENDS` is the one place a backend
is chosen (see :mod:`.backend` to add one).

Every child runs in its own session, so that stopping it also stops whatever it started (see
:mod:`.supervisor`). The environment is checked with :func:`load_config` before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from .. import placement
from ..config import TRAINER_MODES, env_flag
from ..errors import ConfigError
from .backend import Backend
from .batch import BatchBackend
from .byteps import BytepsBackend
from .elastic import ElasticOptions, run_join
from .elastic_hosts import ElasticHostsBackend
from .local import LocalBackend
from .ssh import SshBackend
from .supervisor import Supervisor

# In order: the first backend whose from_args claims the command line runs the job. Elastic over
# hosts claims elastic flags with hosts (-H, --hostfile, --host-discovery-script, a Slurm
# allocation of several nodes) before ssh and local mode; BytePS mode claims every command line,
# so it comes last.
BACKENDS: tuple[type[Backend], ...] = (ElasticHostsBackend, SshBackend, LocalBackend, BatchBackend, BytepsBackend)


def choose_backend(args: argparse.Namespace, env: Mapping[str, str]) -> Backend:
    """The backend that runs the job ``args`` and ``env`` describe."""
    for backend in BACKENDS:
        chosen = backend.from_args(args, env)
        if chosen is not None:
            return chosen
    raise ConfigError("no launcher backend applies")  # unreachable while BytepsBackend is last


def check_mode(mode: str | None, env: Mapping[str, str]) -> None:
    """Refuse --mode beside BYTEPS_ENABLE_ASYNC=1 (which means async), naming the flag: the
    workers would say BPS_GOSSIP_MODE, which the user never set."""
    if mode not in (None, "async") and env_flag(env, "BYTEPS_ENABLE_ASYNC", False):
        raise ConfigError(f"--mode {mode} conflicts with BYTEPS_ENABLE_ASYNC=1, which asks for mode async: "
                          "give --mode async, or unset BYTEPS_ENABLE_ASYNC")


def check_options(args: argparse.Namespace) -> None:
    """Refuse the flag combinations no backend takes, naming the flag that is missing."""
    elastic = ElasticOptions.from_args(args) != ElasticOptions()
    if args.join:
        if args.num_proc is not None or args.num_servers is not None or elastic:
            raise ConfigError("--join runs one worker of a running job: -np, --num-servers and the "
                              "other elastic flags belong to the job's own bpslaunch")
        return
    if args.root is not None:
        raise ConfigError("--root needs --join")
    if args.hosts is not None or args.hostfile is not None or args.host_discovery_script is not None:
        return  # the ssh backends check their own
    if args.forward or args.ssh_port is not None or args.ssh_identity_file or args.ssh_options or args.remote_python:
        if os.environ.get("SLURM_JOB_NODELIST") and elastic:
            return  # an elastic job over the nodes of a Slurm allocation
        raise ConfigError("-x, --ssh-* and --remote-python need -H, --hostfile or --host-discovery-script")
    if args.num_proc is None and args.num_servers is not None:
        raise ConfigError("--num-servers needs -np; in BytePS mode set DMLC_NUM_SERVER")
    if args.num_proc is None and elastic:
        raise ConfigError("--min-np, --max-np, --reset-limit and --elastic-timeout need -np; in "
                          "BytePS mode set BPS_GOSSIP_ELASTIC, BPS_GOSSIP_MIN_WORKERS, ...")


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
  bpslaunch -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py
                                                 elastic over hosts that come and go (ssh)
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
limit; a slot whose workers keep failing within 30 s of starting waits twice as long before
each restart, up to 60 s); workers joining with --join are admitted at the next commit. The job fails when
fewer than --min-np workers remain for longer than --elastic-timeout seconds. A failure no
restart fixes ends the job: a ConfigError (or ValueError, ImportError, ... before the worker
registered), or the same failure at start-up three times in a row.

Exit status: the first non-zero exit code of a worker (128+N for signal N), 0 when
every worker succeeded, 1 when every worker exited 0 but none registered with the
scheduler (the script never called bps.init(): was mxnet_plugin imported?), 2 for a bad
environment or command line. Elastic: 0 when every slot's last worker exited 0, else the
failed worker's code or the scheduler's (1).""",
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
                             "(SGP, the default), allreduce (BytePS's gradient averaging), auto (whichever "
                             "trains faster, measured while training) or async (BytePS's asynchronous training, "
                             "as BYTEPS_ENABLE_ASYNC=1)")
    placing = parser.add_argument_group("placement: where threads run (see docs/placement.md)")
    placing.add_argument("--comm-cores", metavar="N",
                         help="cores of this host reserved for communication (the scheduler, servers and each "
                              "worker's communication threads); the workers compute on the rest, each on its own "
                              f"share (sets {placement.COMM_CORES_VAR}; default auto: one a worker where each keeps "
                              f"{placement.MIN_COMPUTE_CORES} or more to compute, else none; 0: none)")
    placing.add_argument("--no-affinity", action="store_true",
                         help=f"pin no process or thread to cores (sets {placement.AFFINITY_VAR}=0); thread counts "
                              "still follow the plan unless OMP_NUM_THREADS is set")
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
    elastic = parser.add_argument_group("elastic jobs (on this host, or over hosts that come and go)")
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
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="elastic over several hosts: an executable that prints the hosts available now, "
                              "one 'host' or 'host:slots' per line; run every few seconds (docs/elastic.md, "
                              "'Across hosts'); -H or --hostfile give a fixed list instead")
    elastic.add_argument("--slots-per-host", type=int, metavar="K",
                         help="elastic over hosts: the slots of a host the discovery script gives without any "
                              "(default 1)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LO", "HI"),
                         help="elastic over hosts: a host whose worker failed stays out LO seconds, twice as "
                              "long at each failure up to HI, then may come back (default: out for good)")
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
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    Supervisor.output_dir, Supervisor.timestamps = args.output_dir, args.timestamps
    try:
        check_mode(args.mode, os.environ)
    except ConfigError as exc:
        print(f"bpslaunch: {exc}", file=sys.stderr)
        return 2
    if args.mode is not None:  # every child inherits it, whichever way the job is launched
        os.environ["BPS_GOSSIP_MODE"] = args.mode
    if args.comm_cores is not None:
        os.environ[placement.COMM_CORES_VAR] = args.comm_cores
    if args.no_affinity:
        os.environ[placement.AFFINITY_VAR] = "0"
    try:
        check_options(args)
        if args.join:
            return run_join(args.root, command)
        return choose_backend(args, os.environ).run(command)
    except ConfigError as exc:
        print(f"bpslaunch: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the command exists but cannot be executed
        print(f"bpslaunch: cannot start: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
