"""Gossip (SGP) against allreduce on digits, same seeds, same steps: a table and a PNG.

    bpslaunch -np 4 python scripts/compare_modes.py --epochs 10 --out convergence.png

Every rank trains both modes in turn (examples/train_digits.py's ``train``), recording
test accuracy and consensus distance every ``--log-every`` steps; rank 0 prints the
side-by-side table and writes the plot (matplotlib, from the 'bench' extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from train_digits import build_parser, train  # noqa: E402

import mxnet_plugin as bps  # noqa: E402


def plot(results: list[dict], out: Path) -> None:
    """Accuracy and consensus distance per step, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, dist_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        steps = [h["step"] for h in result["history"]]
        acc_ax.plot(steps, [h["accuracy"] for h in result["history"]], label=result["mode"])
        dist_ax.plot(steps, [max(h["consensus_distance"], 1e-12) for h in result["history"]], label=result["mode"])
    acc_ax.set(xlabel="step", ylabel="test accuracy (rank 0)", title="accuracy")
    dist_ax.set(xlabel="step", ylabel="RMS distance from the average", title="consensus distance", yscale="log")
    for ax in (acc_ax, dist_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    """Run both modes and report."""
    parser = build_parser()
    parser.add_argument("--out", type=Path, default=Path("convergence.png"), help="the plot (PNG)")
    parser.add_argument("--log-every", type=int, default=5, help="steps between two measurements")
    args = parser.parse_args()
    out = args.out
    try:  # before minutes of training, not after them
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("the plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)")
    bps.init()
    results = [train(args, mode, log_every=args.log_every) for mode in ("gossip", "allreduce")]
    if bps.rank() == 0:
        print(f"\n{bps.size()} workers, {results[0]['steps']} steps each, graph {args.graph}, overlap {args.overlap}")
        print(f"{'mode':<10} {'final accuracy':>15} {'consensus distance':>19} {'seconds':>8}")
        for result in results:
            print(f"{result['mode']:<10} {result['accuracy']:>15.4f} {result['consensus_distance']:>19.2e} "
                  f"{result['seconds']:>8.1f}")
        plot(results, out)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        print(f"plot: {out}  data: {out.with_suffix('.json')}")
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
