"""Time to accuracy on emulated hosts: examples/train_digits.py by allreduce, by gossip and by
mode='auto' (``--modes``) on one network (scripts/netns_cluster.py --time-to-accuracy builds it and calls ``experiment``;
the jobs are scripts/netns_job.py's).

Every rank appends one JSON line per epoch (wall-clock time, test accuracy; --log-json).
An epoch's accuracy is the mean over ranks (gossip's models differ; allreduce's agree),
its time the last rank's end of that epoch minus the first rank's start of training (all
namespaces share the machine's clock). The target is allreduce's final accuracy; each
mode's time to accuracy is the time of its first epoch at or above the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

import netns
from bench_common import format_table
from netns_job import run_job

from bps_gossip.compat import zip_exact

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"


@dataclasses.dataclass
class Curve:
    """One training run: per epoch, seconds since the start and the mean accuracy over ranks."""

    mode: str
    seconds: list[float]
    accuracy: list[float]
    steps: int

    def time_to(self, target: float) -> float | None:
        """Seconds until the first epoch whose accuracy reaches ``target``; None if never."""
        for seconds, acc in zip_exact(self.seconds, self.accuracy):
            if acc >= target - 1e-9:
                return seconds
        return None


def read_curve(mode: str, pattern: str, ranks: int) -> Curve:
    """Combine the ranks' epoch logs (``pattern`` with ``{rank}``) into one curve."""
    per_rank = []
    for rank in range(ranks):
        path = Path(pattern.format(rank=rank))
        per_rank.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    epochs = min(len(records) for records in per_rank)
    if epochs == 0:
        raise RuntimeError(f"{mode}: no epoch finished on every rank ({pattern})")
    start = min(records[0]["started"] for records in per_rank)
    seconds = [max(records[e]["time"] for records in per_rank) - start for e in range(epochs)]
    accuracy = [sum(records[e]["accuracy"] for records in per_rank) / ranks for e in range(epochs)]
    return Curve(mode, seconds, accuracy, per_rank[0][epochs - 1]["steps"])


def train(net: netns.Network, args: argparse.Namespace, mode: str, logdir: Path, tag: str) -> Curve:
    """One run of the example in ``mode`` across the namespaces; its curve."""
    pattern = str(logdir / f"{tag}_{mode}_rank{{rank}}.jsonl")
    epochs = args.epochs if mode == "allreduce" else (args.gossip_epochs or 2 * args.epochs)  # auto may gossip
    command = [sys.executable, str(EXAMPLE), "--mode", mode, "--hidden", str(args.hidden),
               "--epochs", str(epochs), "--log-json", pattern]
    if mode in ("gossip", "auto"):
        command += shlex.split(args.gossip_args)
    # One compute thread per worker: 4 workers share 2 cores, more threads only fight.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    print(f"\nnetns_tta: {tag} {mode}: {shlex.join(command[1:])}", flush=True)
    code = run_job(net, args.workers, args.servers, command, base_env=env, port=args.port)
    if code != 0:
        raise RuntimeError(f"{mode} run {tag} failed with exit code {code}")
    return read_curve(mode, pattern, args.workers)


def rows_for(tag: str, curves: dict[str, Curve]) -> list[list[str]]:
    """Table rows of one repeat: each mode's time to allreduce's final accuracy, and its ratio to
    allreduce's."""
    allreduce = curves["allreduce"]
    target = allreduce.accuracy[-1]
    t_ar = allreduce.time_to(target)
    rows = []
    for curve in curves.values():
        t = curve.time_to(target)
        ratio = "" if curve is allreduce else "-" if t is None or not t_ar else f"{t / t_ar:.2f}"
        rows.append([tag, curve.mode, str(len(curve.seconds)), str(curve.steps), f"{curve.accuracy[-1]:.4f}",
                     f"{max(curve.accuracy):.4f}", f"{curve.seconds[-1]:.1f}", f"{target:.4f}",
                     "not reached" if t is None else f"{t:.1f}", ratio])
    return rows


def experiment(net: netns.Network, args: argparse.Namespace, logdir: Path) -> int:
    """Run every mode of ``args.modes`` ``args.repeats`` times (order reversed every other repeat:
    the machine's noise drifts), print the curves and the time-to-accuracy table; 0 unless a run
    failed."""
    headers = ["run", "mode", "epochs", "steps", "final acc", "best acc", "total s", "target",
               "s to target", "x allreduce"]
    chosen = list(getattr(args, "modes", None) or ["allreduce", "gossip"])
    rows: list[list[str]] = []
    records = []
    for repeat in range(args.repeats):
        tag = f"run{repeat + 1}"
        modes = chosen if repeat % 2 == 0 else chosen[::-1]
        try:
            curves = {mode: train(net, args, mode, logdir, tag) for mode in modes}
        except RuntimeError as exc:
            print(f"netns_tta: {exc}", file=sys.stderr)
            return 1
        for curve in curves.values():
            points = ", ".join(f"{s:.1f}s:{a:.3f}" for s, a in zip_exact(curve.seconds, curve.accuracy))
            print(f"netns_tta: {tag} {curve.mode} curve (s since start: mean accuracy): {points}", flush=True)
        rows += rows_for(tag, {mode: curves[mode] for mode in chosen})
        records.append({mode: dataclasses.asdict(curve) for mode, curve in curves.items()})
    slow = ", ".join(f"{h}={r:g}" for h, r in args.slow.items()) or "none"
    sysctls = " ".join(f"{k}={v}" for k, v in getattr(args, "sysctl", {}).items()) or "defaults"
    print(f"\ntime to allreduce's final accuracy: {args.workers} workers, {args.servers} server(s), links "
          f"{args.mbit:g} Mbit/s, slow: {slow}; digits MLP hidden={args.hidden}; gossip options: "
          f"{args.gossip_args or 'defaults'}; sysctls: {sysctls}\n")
    print(format_table(headers, rows), flush=True)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "command"},
                                               "runs": records}, indent=1, default=str) + "\n")
    return 0
