"""One rank lies in the decisions the ranks take together (issue 37, items 1-2): how long the job
takes and how well it trains, against the same job with no liar, side by side.

    .venv/bin/python scripts/attack_decisions.py [--np 4] [--epochs 12] [--attacks all] [--repeat 3]
                                                 [--straggle 0.02]

Each run is ``bpslaunch -np N`` training examples/train_digits.py's MLP (same seeds, same steps);
in an attacked run the last rank rewrites what it contributes to every ``gather_rows`` before it
is pushed (the project's own code with one value changed, as an insider would):

- auto-slow:      mode='auto'; its seconds a step of every gossip window are 1000 s
- auto-negative:  mode='auto'; its seconds a step of every gossip window are -1000 s
- auto-nan:       mode='auto'; every number of every window is NaN
- drift-inf:      mode='gossip'; the drift it measured at each exact average (every 20 steps) is inf
- routing-late:   mode='gossip'; every message from rank 0 reached it 1000 s late, 10,000 of them

Prints one table, the median run of each: seconds of training (rank 0), the ratio to the honest
run of the same mode, final test accuracy, and the share of steps mode='auto' ran in gossip. With ``--worker`` (as
bpslaunch starts it) it is one rank of a job instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = {"auto-slow": "auto", "auto-negative": "auto", "auto-nan": "auto", "drift-inf": "gossip",
           "routing-late": "gossip"}
WINDOW_KEY = "auto_mode_window"


RUNNING = {"mode": ""}  # the mode mode='auto' ran in the window it is measuring (the liar's own)


def lie(attack: str, name: str, row, rank: int, size: int) -> None:
    """Rewrite this rank's ``row`` of the decision ``name`` in place, as ``attack`` says."""
    if attack in ("auto-slow", "auto-negative") and name == WINDOW_KEY and RUNNING["mode"] == "gossip":
        row[0] = 1000.0 if attack == "auto-slow" else -1000.0
    elif attack == "auto-nan" and name == WINDOW_KEY:
        row[:] = float("nan")
    elif attack == "drift-inf" and name.endswith(".average.drift"):
        row[:] = float("inf")
    elif attack == "routing-late" and name.endswith(".route"):
        row[0], row[size] = 1000.0, 10_000.0  # its in-edge from rank 0: delay, count


def install_liar(attack: str) -> None:
    """Make this process's gather_rows pushes carry ``attack``'s lie in its own row."""
    from bps_gossip import collectives
    from mxnet_plugin.modes.auto import AutoMode

    submit, end_window = collectives._submit, AutoMode._end_window

    def watched_end_window(self, now):
        RUNNING["mode"] = self.active.name
        return end_window(self, now)

    AutoMode._end_window = watched_end_window

    def lying_submit(runtime, name, what, matrix, *args, **kwargs):
        if kwargs.get("rows"):
            lie(attack, name, matrix[runtime.rank], runtime.rank, runtime.size)
        return submit(runtime, name, what, matrix, *args, **kwargs)

    collectives._submit = lying_submit


def worker(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import build_parser, train

    import mxnet_plugin as bps

    bps.init()
    if args.attack != "none" and bps.rank() == bps.size() - 1:
        install_liar(args.attack)
    if args.straggle and bps.rank() == 1:  # a slow rank: gossip routes around it, allreduce waits for it
        step = bps.DistributedTrainer.step

        def slow_step(self, *step_args, **kwargs):
            time.sleep(args.straggle)
            return step(self, *step_args, **kwargs)

        bps.DistributedTrainer.step = slow_step
    digits = build_parser().parse_args(["--epochs", str(args.epochs), "--batch-size", "8"])
    digits.average_every = 20 if args.mode == "gossip" else 0  # the drift is measured at each exact average
    result = train(digits, args.mode)
    if bps.rank() == 0:
        print("RESULT " + json.dumps({"seconds": result["seconds"], "accuracy": result["accuracy"],
                                      "gossip": gossip_share(result["mode_history"], result["steps"])}), flush=True)
    bps.shutdown()
    return 0


def gossip_share(history: list, steps: int) -> float:
    """The fraction of ``steps`` that mode='auto' ran in gossip, from its (step, mode, why) history."""
    ran, changes = 0, [(step, mode) for step, mode, _ in history] + [(steps, "")]
    for (step, mode), (until, _) in zip(changes, changes[1:]):
        ran += (until - step) if mode == "gossip" else 0
    return ran / max(steps, 1)


def launch(args: argparse.Namespace, mode: str, attack: str) -> dict:
    """Run one job; rank 0's RESULT."""
    with tempfile.TemporaryDirectory() as logs:
        cmd = [sys.executable, "-m", "bps_gossip.launch.cli", "-np", str(args.np), sys.executable, __file__,
               "--worker", "--mode", mode, "--attack", attack, "--epochs", str(args.epochs),
               "--straggle", str(args.straggle)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BYTEPS_LOG_LEVEL": "ERROR", "BPS_GOSSIP_AUTO_WINDOW": "10"}
        began = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=logs)
        took = time.monotonic() - began
    lines = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{mode}/{attack} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "job": took}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--attacks", default="all", help="comma-separated, of: " + ", ".join(ATTACKS))
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved (the median is shown)")
    parser.add_argument("--straggle", type=float, default=0.0,
                        help="seconds rank 1 sleeps every step (where auto should choose gossip)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--attack", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    attacks = list(ATTACKS) if args.attacks == "all" else args.attacks.split(",")
    modes = sorted({ATTACKS[attack] for attack in attacks})
    runs = [(mode, "none") for mode in modes] + [(ATTACKS[attack], attack) for attack in attacks]
    got: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for _ in range(args.repeat):  # interleaved: a noisy minute hits every run alike
        for mode, attack in runs:
            got[mode, attack].append(launch(args, mode, attack))
    median = {run: min(results, key=lambda r: r["seconds"]) if len(results) < 3 else
              sorted(results, key=lambda r: r["seconds"])[len(results) // 2] for run, results in got.items()}
    rows = [(f"{mode} honest" if attack == "none" else attack, median[mode, attack], median[mode, "none"])
            for mode, attack in runs]
    slow = f", rank 1 sleeps {args.straggle} s a step" if args.straggle else ""
    print(f"{args.np} workers, digits MLP, {args.epochs} epochs, batch 8 a worker{slow}, median of {args.repeat} runs "
          f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores)")
    print(f"{'run':<16} {'train s':>8} {'x honest':>9} {'job s':>7} {'accuracy':>9} {'auto in gossip':>15}")
    for name, got, base in rows:
        share = f"{got['gossip']:.0%}" if name.startswith("auto") else "-"
        print(f"{name:<16} {got['seconds']:>8.1f} {got['seconds'] / base['seconds']:>8.2f}x {got['job']:>7.1f} "
              f"{got['accuracy']:>9.3f} {share:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
