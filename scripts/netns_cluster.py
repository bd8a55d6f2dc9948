"""A bps_gossip job on emulated hosts: scheduler, servers and workers each in its own network
namespace (scripts/netns.py), joined by rate-limited links. Needs root and iproute2.

Generic mode: run COMMAND on every worker, BytePS style (``bpslaunch`` with DMLC_ROLE):

    python scripts/netns_cluster.py --workers 4 --servers 1 --mbit 1000 --slow worker3=100 -- \\
        python examples/train_digits.py --mode allreduce

Time to accuracy, gossip against allreduce with one slow link (see docs/netns.md):

    python scripts/netns_cluster.py --time-to-accuracy --workers 4 --mbit 1000 --slow worker3=20

Every process gets the DMLC_* variables of its host: DMLC_PS_ROOT_URI is the scheduler's
namespace address and DMLC_NODE_HOST the process's own, so every payload crosses a link
over TCP (the shared-memory path is taken only between processes advertising the same
address). Output lines are prefixed with the role or rank; the exit status is the first
non-zero one; on exit, failure or a stop signal every process is killed and every
namespace deleted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns.py and netns_tta.py live here

import netns  # noqa: E402

from bps_gossip.supervisor import Supervisor  # noqa: E402

SCHEDULER_PORT = 9000  # fixed is fine: the port exists only inside the scheduler's private namespace
LAUNCHER = [sys.executable, "-m", "bps_gossip.launcher"]  # bpslaunch, with this interpreter


def host_names(workers: int, servers: int) -> list[str]:
    """The emulated machines: one scheduler, ``servers`` servers, ``workers`` workers."""
    return ["scheduler", *(f"server{i}" for i in range(servers)), *(f"worker{i}" for i in range(workers))]


def parse_slow(items: Sequence[str]) -> dict[str, float]:
    """['worker3=100'] -> {'worker3': 100.0}."""
    slow = {}
    for item in items:
        host, sep, rate = item.partition("=")
        try:
            slow[host.strip()] = float(rate)
        except ValueError:
            sep = ""
        if not sep or slow.get(host.strip(), -1) < 0:
            raise SystemExit(f"--slow {item!r}: use HOST=MBIT, e.g. worker3=100")
    return slow


def role_env(net: netns.Network, host: str, workers: int, servers: int, port: int = SCHEDULER_PORT,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the process on ``host`` (its role and worker id follow from the name)."""
    role = host.rstrip("0123456789")
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BPS_GOSSIP_PORT")}
    env.update({
        "DMLC_ROLE": role, "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
        "DMLC_PS_ROOT_URI": net.address("scheduler"), "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NODE_HOST": net.address(host),  # what this process advertises: its own link, not loopback
        "DMLC_INTERFACE": netns.HOST_IFACE,  # ps-lite's (MXNet dist_sync) way of picking the address
        "BYTEPS_LOCAL_SIZE": "1",
    })
    if role == "worker":
        env["DMLC_WORKER_ID"] = host[len("worker"):]
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_job(net: netns.Network, workers: int, servers: int, command: Sequence[str],
            base_env: Mapping[str, str] | None = None, port: int = SCHEDULER_PORT) -> int:
    """Start the scheduler, servers and workers (``command``) in their namespaces with bpslaunch
    in BytePS mode; return the first non-zero exit code (fail-fast), else 0."""
    if not command:
        raise SystemExit("no worker command given (e.g. -- python examples/train_digits.py)")
    with Supervisor() as sup:
        for host in host_names(workers, servers):
            env = role_env(net, host, workers, servers, port, base_env)
            if env["DMLC_ROLE"] == "worker":
                rank = env["DMLC_WORKER_ID"]
                sup.start(net.exec_argv(host, [*LAUNCHER, *command]), env, "worker", f"worker {rank}", f"[{rank}] ")
            else:
                sup.start(net.exec_argv(host, LAUNCHER), env, env["DMLC_ROLE"], host, f"[{host}] ")
        return sup.wait(fail_fast=True)


def build_network(workers: int, servers: int, mbit: float, slow: Mapping[str, float],
                  sysctls: Mapping[str, str] | None = None) -> netns.Network:
    """Check prerequisites, sweep namespaces of dead earlier runs, build and announce the network."""
    netns.check_prerequisites()
    removed = netns.cleanup_leftovers()
    if removed:
        print(f"netns_cluster: removed namespaces left by dead runs: {', '.join(removed)}", file=sys.stderr)
    net = netns.Network(host_names(workers, servers), mbit, dict(slow), sysctls=dict(sysctls or {})).create()
    print("netns_cluster: hosts\n" + net.describe(), file=sys.stderr, flush=True)
    return net


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workers", type=int, default=4, help="worker hosts (default 4)")
    parser.add_argument("--servers", type=int, default=1, help="server hosts (default 1)")
    parser.add_argument("--mbit", type=float, default=1000.0,
                        help="rate of every link in Mbit/s, each direction (0: unlimited; default 1000)")
    parser.add_argument("--slow", action="append", default=[], metavar="HOST=MBIT",
                        help="a different rate for one host's link, e.g. worker3=100 (repeatable)")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a kernel setting in every host namespace, e.g. "
                             "net.ipv4.tcp_slow_start_after_idle=0 (repeatable)")
    parser.add_argument("--port", type=int, default=SCHEDULER_PORT, help="scheduler port (inside its namespace)")
    parser.add_argument("--time-to-accuracy", action="store_true",
                        help="run the gossip-vs-allreduce experiment instead of a command (options below)")
    parser.add_argument("--hidden", type=int, default=2048, help="experiment: MLP width (default 2048)")
    parser.add_argument("--epochs", type=int, default=10, help="experiment: allreduce epochs (default 10)")
    parser.add_argument("--gossip-epochs", type=int, default=0,
                        help="experiment: gossip epochs (default 2 x --epochs: gossip may need more steps "
                             "to reach allreduce's final accuracy)")
    parser.add_argument("--gossip-args", default="",
                        help="experiment: extra train_digits options for the gossip runs, e.g. '--overlap'")
    parser.add_argument("--repeats", type=int, default=1, help="experiment: runs of each mode (default 1)")
    parser.add_argument("--json", type=Path, help="experiment: write the curves here")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...", help="the worker command")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.slow = parse_slow(args.slow)
    if any("=" not in item for item in args.sysctl):
        parser.error("--sysctl takes KEY=VALUE")
    args.sysctl = dict(item.split("=", 1) for item in args.sysctl)
    if args.workers < 1 or args.servers < 1:
        parser.error("--workers and --servers must be >= 1")
    unknown = set(args.slow) - set(host_names(args.workers, args.servers))
    if unknown:
        parser.error(f"--slow names unknown host(s) {sorted(unknown)}: hosts are "
                     f"{', '.join(host_names(args.workers, args.servers))}")
    if args.time_to_accuracy == bool(args.command):
        parser.error("give either a worker command or --time-to-accuracy")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Build the network, run the job (or the experiment), tear everything down."""
    args = parse_args(argv)
    try:
        net = build_network(args.workers, args.servers, args.mbit, args.slow, args.sysctl)
    except netns.NetnsError as exc:
        print(f"netns_cluster: {exc}", file=sys.stderr)
        return 2
    try:
        if args.time_to_accuracy:
            import netns_tta

            with tempfile.TemporaryDirectory(prefix="netns_tta_") as tmp:
                return netns_tta.experiment(net, args, Path(tmp))
        return run_job(net, args.workers, args.servers, args.command, port=args.port)
    finally:
        net.destroy()


if __name__ == "__main__":
    sys.exit(main())
