"""Gradient compression on emulated hosts: bytes on the wire and accuracy per compressor.

    .venv/bin/python scripts/bench_compression.py --mbit 1000 --epochs 5 --json compression.json   # as root

Every worker and the server run in their own network namespace (scripts/netns.py), so
every payload crosses a link whose byte counters the kernel keeps. For each setting
(no compression, fp16, onebit, topk, randomk, dithering, with BytePS's parameters),
examples/train_digits.py trains the same MLP in allreduce mode with the same seeds; the
table gives the bytes the server's link carried (both directions), their ratio to the
uncompressed run, the final test accuracy (rank 0) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import netns  # noqa: E402
from netns_job import build_network, host_names, run_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"
SETTINGS = [
    ("none", []),
    ("fp16", ["--fp16-pushpull"]),
    ("onebit (scaling, ef)", ["--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla"]),
    ("topk k=0.01 (ef)", ["--compressor", "topk", "--k", "0.01", "--ef", "vanilla"]),
    ("randomk k=0.01 (ef)", ["--compressor", "randomk", "--k", "0.01", "--ef", "vanilla", "--seed-compress", "1"]),
    ("dithering k=4", ["--compressor", "dithering", "--k", "4"]),
    ("dithering k=2 natural (ef)", ["--compressor", "dithering", "--k", "2", "--partition", "natural",
                                    "--ef", "vanilla"]),
    ("dithering k=8 l2", ["--compressor", "dithering", "--k", "8", "--normalize", "l2"]),
    ("dithering k=2 natural, l2 (ef)", ["--compressor", "dithering", "--k", "2", "--partition", "natural",
                                        "--normalize", "l2", "--ef", "vanilla"]),
    ("onebit (scaling, ef, nesterov)", ["--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla",
                                        "--compress-momentum", "nesterov"]),
]


def traffic(net: netns.Network, args: argparse.Namespace) -> tuple[int, int]:
    """(received, sent) bytes: the server's link (allreduce: every payload crosses it), or the
    sum over every host's link (gossip: workers talk to each other)."""
    if args.mode == "allreduce":
        return net.traffic("server0")
    counts = [net.traffic(host) for host in host_names(args.workers, 1)]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _words(name: str, mode: str) -> tuple[str, ...]:
    """A setting's name as words: commas and parentheses do not count, nor ``ef`` in gossip mode
    (ignored there), so docs/compression.md's spellings ("onebit, scaling, ef") name it too."""
    words = tuple(name.replace(",", " ").replace("(", " ").replace(")", " ").split())
    return tuple(w for w in words if w != "ef") if mode == "gossip" else words


def select_settings(only: str | None, mode: str = "allreduce") -> list[tuple[str, list[str]]]:
    """The SETTINGS that ``--only`` names (semicolon-separated; all when empty); ValueError
    naming every unknown one and listing the settings."""
    if not only:
        return list(SETTINGS)
    wanted = [name.strip() for name in only.split(";") if name.strip()]
    by_words = {_words(label, mode): (label, extra) for label, extra in SETTINGS}
    unknown = [name for name in wanted if _words(name, mode) not in by_words]
    if unknown:
        raise ValueError(f"no setting named {', '.join(map(repr, unknown))}; the settings are "
                         f"{'; '.join(s[0] for s in SETTINGS)}")
    chosen = {_words(name, mode) for name in wanted}
    return [setting for words, setting in by_words.items() if words in chosen]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; ``settings`` holds the chosen SETTINGS."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=1000.0, help="link rate of every emulated host")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048, help="MLP width: weights above 64 KiB get compressed")
    parser.add_argument("--mode", choices=["allreduce", "gossip"], default="allreduce",
                        help="gossip: compressed gossip (CHOCO); bytes are then every link's")
    parser.add_argument("--only", help="setting names to run, separated by semicolons, as printed or as in "
                                       "docs/compression.md's tables, e.g. 'none;onebit, scaling, ef' (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        args.settings = select_settings(args.only, args.mode)
    except ValueError as exc:
        parser.error(f"--only: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every chosen setting on one emulated network and print the table."""
    args = parse_args(argv)
    settings = args.settings
    try:
        net = build_network(args.workers, 1, args.mbit, {})
    except netns.NetnsError as exc:
        print(f"bench_compression: {exc}", file=sys.stderr)
        return 2
    rows = []
    try:
        for label, extra in settings:
            with tempfile.TemporaryDirectory(prefix="bench_gc_") as tmp:
                log = Path(tmp) / "rank{rank}.jsonl"
                before = traffic(net, args)
                start = time.time()
                command = [sys.executable, str(EXAMPLE), "--mode", args.mode, "--epochs", str(args.epochs),
                           "--hidden", str(args.hidden), "--log-json", str(log), *extra]
                code = run_job(net, args.workers, 1, command)
                seconds = time.time() - start
                after = traffic(net, args)
                if code != 0:
                    print(f"bench_compression: {label} failed with exit code {code}", file=sys.stderr)
                    return 1
                epochs = [json.loads(line) for line in Path(tmp, "rank0.jsonl").read_text().splitlines()]
            moved = (after[0] - before[0]) + (after[1] - before[1])
            rows.append({"setting": label, "bytes": moved, "accuracy": epochs[-1]["accuracy"], "seconds": seconds,
                         "steps": epochs[-1]["steps"]})
            print(f"  {label}: {moved / 1e6:.1f} MB, accuracy {epochs[-1]['accuracy']:.4f}", file=sys.stderr,
                  flush=True)
    finally:
        net.destroy()
    base = next((r["bytes"] for r in rows if r["setting"] == "none"), None)
    where = "server link" if args.mode == "allreduce" else "all links"
    print(f"\n{args.mode}: {args.workers} workers, 1 server, {args.mbit:g} Mbit/s links, {args.epochs} epochs, MLP 64-"
          f"{args.hidden}-10 on digits; bytes = {where}, received + sent")
    print(f"{'setting':34} {'MB':>9} {'vs none':>8} {'accuracy':>9} {'seconds':>8}")
    for row in rows:
        ratio = f"{row['bytes'] / base:.3f}" if base else "-"
        print(f"{row['setting']:34} {row['bytes'] / 1e6:9.1f} {ratio:>8} {row['accuracy']:9.4f} {row['seconds']:8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "workers": args.workers, "mbit": args.mbit, "epochs": args.epochs,
                                         "hidden": args.hidden, "hosts": host_names(args.workers, 1),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
