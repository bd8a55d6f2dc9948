"""A bps_gossip job on emulated hosts: scheduler, servers and workers each in its own network
namespace (scripts/netns.py), joined by rate-limited links. Needs root and iproute2.

Generic mode: run COMMAND on every worker, BytePS style (``bpslaunch`` with DMLC_ROLE), with
this interpreter's bin directory first on PATH (a bare ``python`` is this one, also under sudo):

    .venv/bin/python scripts/netns_cluster.py --workers 4 --servers 1 --mbit 1000 --slow worker3=100 -- \\
        python examples/train_digits.py --mode allreduce

Time to accuracy, gossip and mode='auto' against allreduce with one slow link (see docs/netns.md):

    .venv/bin/python scripts/netns_cluster.py --time-to-accuracy --workers 4 --mbit 1000 --slow worker3=20 \
        --modes allreduce,gossip,auto

The job itself is scripts/netns_job.py's (every process with the DMLC_* variables of its
host), the experiment scripts/netns_tta.py's. Output lines are prefixed with the role or
rank; the exit status is the first non-zero one; on exit, failure or a stop signal every
process is killed and every namespace deleted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns.py, netns_job.py and netns_tta.py live here

import netns  # noqa: E402
import netns_tta  # noqa: E402
from netns_job import SCHEDULER_PORT, build_network, host_names, parse_slow, run_job  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workers", type=int, default=4, help="worker hosts (default 4)")
    parser.add_argument("--servers", type=int, default=1, help="server hosts (default 1)")
    parser.add_argument("--local-size", type=int, default=1,
                        help="workers on each worker host (BYTEPS_LOCAL_SIZE; default 1)")
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
    parser.add_argument("--modes", default="allreduce,gossip",
                        help="experiment: the modes to run, comma-separated, allreduce among them (its final "
                             "accuracy is the target): allreduce, gossip, auto (default allreduce,gossip)")
    parser.add_argument("--repeats", type=int, default=1, help="experiment: runs of each mode (default 1)")
    parser.add_argument("--json", type=Path, help="experiment: write the curves here")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...", help="the worker command")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.slow = parse_slow(args.slow)
    if any("=" not in item for item in args.sysctl):
        parser.error("--sysctl takes KEY=VALUE")
    args.sysctl = dict(item.split("=", 1) for item in args.sysctl)
    if args.workers < 1 or args.servers < 1 or args.local_size < 1:
        parser.error("--workers, --servers and --local-size must be >= 1")
    unknown = set(args.slow) - set(host_names(args.workers, args.servers))
    if unknown:
        parser.error(f"--slow names unknown host(s) {sorted(unknown)}: hosts are "
                     f"{', '.join(host_names(args.workers, args.servers))}")
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if "allreduce" not in args.modes or set(args.modes) - {"allreduce", "gossip", "auto"} \
            or len(set(args.modes)) != len(args.modes):
        parser.error(f"--modes {','.join(args.modes)}: allreduce, gossip and auto, each once, allreduce among them")
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
            with tempfile.TemporaryDirectory(prefix="netns_tta_") as tmp:
                return netns_tta.experiment(net, args, Path(tmp))
        # A bare `python` in the command is this interpreter, also under sudo (which resets PATH).
        return run_job(net, args.workers, args.servers, args.command, base_env=netns.interpreter_env(os.environ),
                       port=args.port, local_size=args.local_size)
    finally:
        net.destroy()


if __name__ == "__main__":
    sys.exit(main())
