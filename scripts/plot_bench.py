"""PNG charts of benchmark results (the JSON files of bench_training.py and bench_push_pull.py).

    python scripts/plot_bench.py training_mlp.json --out docs/img/training_mlp.png
    python scripts/plot_bench.py push_pull.json --out docs/img/push_pull.png
    python scripts/plot_bench.py tta_100.json --out docs/img/tta_100.png   (netns_cluster.py --json)

Training: samples/s per system and cluster configuration, with the no-communication
ceiling as a line. push_pull: the ratio of MXNet dist_sync's time to ours per size
(above 1: ours is faster), one line per configuration. Needs matplotlib (the 'bench' extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def plot_training(data: dict[str, Any], axes: Any) -> None:
    """Grouped bars: one group per configuration, one bar per system."""
    records = data["results"]
    names = [n for n in records[0]["systems"] if n != "no communication"]
    width = 0.8 / max(len(names), 1)
    for index, name in enumerate(names):
        values = [rec["systems"].get(name, {}).get("samples_per_s", 0) for rec in records]
        axes.bar([i + index * width for i in range(len(records))], values, width, label=name)
    for i, rec in enumerate(records):
        ceiling = rec["systems"].get("no communication", {}).get("samples_per_s")
        if ceiling:
            axes.hlines(ceiling, i - width / 2, i + 0.8 - width / 2, colors="black", linestyles="dashed",
                        label="no communication" if i == 0 else None)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(records))], [rec["config"] for rec in records])
    axes.set_ylabel("samples/s (all workers)")
    axes.set_title(f"training {data.get('model', 'mlp')}, batch {data['batch']} per worker")
    axes.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)


def plot_push_pull(data: dict[str, Any], axes: Any) -> None:
    """MXNet's time over ours per size, one line per (configuration, our system)."""
    configs = sorted({rec["config"] for rec in data["results"]})
    for config in configs:
        records = sorted((r for r in data["results"] if r["config"] == config), key=lambda r: r["bytes"])
        for system in records[0]["ratio_mxnet_over"]:
            axes.plot([r["bytes"] for r in records], [r["ratio_mxnet_over"][system] for r in records],
                      marker="o", label=f"{config} {system}")
    axes.axhline(1.0, color="black", linestyle="dashed", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bytes per push_pull")
    axes.set_ylabel("MXNet dist_sync time / ours (>1: ours faster)")
    axes.set_title("push_pull against MXNet dist_sync")
    axes.legend(fontsize="small")


def plot_time_to_accuracy(data: dict[str, Any], axes: Any) -> None:
    """Test accuracy against wall time, one line per mode and run (netns_cluster.py --json)."""
    for index, run in enumerate(data["runs"]):
        for mode, curve in run.items():
            axes.plot(curve["seconds"], curve["accuracy"], marker=".", label=f"{mode} (run {index + 1})")
    target = data["runs"][0]["allreduce"]["accuracy"][-1]
    axes.axhline(target, color="black", linestyle="dashed", linewidth=1, label="allreduce's final accuracy")
    args = data["args"]
    slow = ", ".join(f"{host} at {mbit:g}" for host, mbit in args["slow"].items()) or "none slow"
    axes.set_title(f"time to accuracy, {args['workers']} workers, links {args['mbit']:g} Mbit/s ({slow})")
    axes.set_xlabel("seconds since start")
    axes.set_ylabel("test accuracy")
    axes.set_ylim(max(0.0, target - 0.1), 1.0)
    axes.legend(fontsize="small")


def main() -> int:
    """Read one JSON file, write one PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.json.read_text())
    fig, axes = plt.subplots(figsize=(9, 5.5))
    kind = data.get("what", "time_to_accuracy")
    {"training": plot_training, "push_pull": plot_push_pull, "time_to_accuracy": plot_time_to_accuracy}[kind](data, axes)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
