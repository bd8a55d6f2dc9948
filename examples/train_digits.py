"""Train a small MLP on scikit-learn's digits (shipped inside the package: no download)
with mxnet_plugin's DistributedTrainer, by gossip (SGP), by allreduce, or both.

    bpslaunch -np 4 python examples/train_digits.py --mode both

Every rank initializes with its own seed (the first step broadcasts rank 0's weights),
trains on its own shard of the training set, and prints its loss and accuracy per epoch.
Rank 0 also shows a progress bar on stderr when that is a terminal (not under bpslaunch,
whose workers write into pipes, nor into a log), and never on a line of its own output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import mxnet as mx
import numpy as np
from sklearn.datasets import load_digits
from tqdm import tqdm

import mxnet_plugin as bps
from bps_gossip import job_config


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 in [0, 1]: 1,500 training and 297 test images (fixed split)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def build_net(hidden: int = 64) -> mx.gluon.nn.Sequential:
    """A 64-``hidden``-10 MLP whose input size is inferred at the first forward (deferred init)."""
    net = mx.gluon.nn.Sequential()
    net.add(mx.gluon.nn.Dense(hidden, activation="relu"), mx.gluon.nn.Dense(10))
    return net


def accuracy(net: mx.gluon.nn.Sequential, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of correct predictions."""
    predictions = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float((predictions == y).mean())


def train(args: argparse.Namespace, mode: str, log_every: int = 0) -> dict[str, Any]:
    """Train one model in ``mode``; return final accuracy and, with ``log_every``, a per-step history
    of test accuracy and consensus distance (a collective: every rank records it)."""
    rank, size = bps.rank(), bps.size()
    started = time.time()  # wall clock: ranks on one machine (or its namespaces) share it
    x_train, y_train, x_test, y_test = load_data()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    mx.random.seed(args.seed + rank)  # different on every rank: the broadcast makes them agree
    net = build_net(getattr(args, "hidden", 64))  # getattr: callers may build args without --hidden
    net.initialize(mx.init.Xavier())
    options = {"graph": args.graph, "peers_per_itr": args.peers_per_itr, "overlap": args.overlap,
               "average_every": args.average_every} if mode in ("gossip", "auto") else {}
    if mode == "gossip" and getattr(args, "gossip_gamma", None) is not None:
        options["gossip_gamma"] = args.gossip_gamma  # compressed gossip's consensus step
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": args.lr, "momentum": 0.9},
                                     mode=mode, compression_params=compression_params(args), **options)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(args.seed + rank)
    steps_per_epoch = len(x_shard) // args.batch_size
    history: list[dict[str, float]] = []
    start, step_count = time.time(), 0
    # One bar on rank 0, one update per epoch, only on a terminal (disable=None): in a pipe or a
    # log its carriage returns would put the next line behind the bar's text.
    bar = tqdm(total=args.epochs, desc=f"{mode} epochs", unit="epoch", disable=None if rank == 0 else True,
               file=sys.stderr, ascii=True)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        total_loss = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            data, label = mx.nd.array(x_shard[batch]), mx.nd.array(y_shard[batch])
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size, loss=loss)  # mode="auto" follows its trend (the plateau)
            total_loss += float(loss.mean().asscalar())
            step_count += 1
            if log_every and step_count % log_every == 0:
                trainer.flush()
                history.append({"step": step_count, "accuracy": accuracy(net, x_test, y_test),
                                "consensus_distance": trainer.consensus_distance(),
                                "seconds": time.time() - start})
        bar.update(1)
        trainer.flush()
        epoch_accuracy = accuracy(net, x_test, y_test)
        running = f" ({trainer.active_mode} now)" if mode == "auto" else ""
        say(f"rank {rank} {mode} epoch {epoch + 1}/{args.epochs}: loss {total_loss / steps_per_epoch:.4f} "
            f"test accuracy {epoch_accuracy:.4f}{running}")
        if getattr(args, "log_json", None):
            log_epoch(args.log_json, {"rank": rank, "size": size, "mode": mode, "epoch": epoch + 1,
                                      "steps": step_count, "started": started, "time": time.time(),
                                      "loss": total_loss / steps_per_epoch, "accuracy": epoch_accuracy,
                                      "active_mode": trainer.active_mode})
    bar.close()
    trainer.flush()
    distance = trainer.consensus_distance()
    final = accuracy(net, x_test, y_test)
    return {"mode": mode, "accuracy": final, "consensus_distance": distance, "steps": step_count,
            "seconds": time.time() - start, "history": history, "mode_history": trainer.mode_history}


def say(line: str) -> None:
    """Print ``line`` whole: tqdm.write takes the progress bar off the terminal first and
    redraws it after, so that the two never share a line."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def compression_params(args: argparse.Namespace) -> dict[str, Any]:
    """BytePS's compression_params from the command line, every key always present (as in
    BytePS's examples): empty values mean no compression."""
    return {"compressor": getattr(args, "compressor", ""), "ef": getattr(args, "ef", ""),
            "momentum": getattr(args, "compress_momentum", ""), "scaling": getattr(args, "onebit_scaling", False),
            "k": getattr(args, "k", 1), "fp16": getattr(args, "fp16_pushpull", False),
            "seed": getattr(args, "seed_compress", None), "partition": getattr(args, "partition", ""),
            "normalize": getattr(args, "normalize", "")}


def log_epoch(pattern: str, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``pattern`` with ``{rank}`` filled in (one file per rank:
    no two processes append to the same file)."""
    with open(pattern.format(rank=record["rank"]), "a") as out:
        out.write(json.dumps(record) + "\n")


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (scripts/compare_modes.py extends it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # bpslaunch --mode sets BPS_GOSSIP_MODE: the example follows it unless told otherwise
    parser.add_argument("--mode", choices=["gossip", "allreduce", "auto", "async", "both"],
                        help="default: BPS_GOSSIP_MODE (bpslaunch --mode), async under BYTEPS_ENABLE_ASYNC=1, else "
                             "gossip (allreduce with --fp16-pushpull); auto: whichever trains faster here, measured "
                             "while training; async: no worker waits for another (docs/async.md)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (wider: more bytes per step)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--graph", default="npdde", help="gossip topology")
    parser.add_argument("--peers-per-itr", type=int, default=1)
    parser.add_argument("--overlap", action="store_true", help="gossip while the next step computes")
    parser.add_argument("--average-every", type=int, default=0, help="exact average every K steps (0: never)")
    gc = parser.add_argument_group("compression (BytePS's options; in gossip mode CHOCO compresses the messages)")
    gc.add_argument("--compressor", default="", help="onebit, topk, randomk or dithering (default: none)")
    gc.add_argument("--ef", default="", help="error feedback: vanilla")
    gc.add_argument("--compress-momentum", default="", help="nesterov: momentum applied before compression")
    gc.add_argument("--onebit-scaling", action="store_true", help="onebit: scale by the mean magnitude")
    gc.add_argument("--k", type=float, default=1, help="topk/randomk: elements kept (below 1: a fraction); "
                                                       "dithering: levels")
    gc.add_argument("--fp16-pushpull", action="store_true",
                    help="push gradients as float16 (allreduce: the mode without --mode or BPS_GOSSIP_MODE)")
    gc.add_argument("--seed-compress", type=int, help="randomk/dithering: seed of the random draws")
    gc.add_argument("--partition", default="", help="dithering: linear or natural")
    gc.add_argument("--normalize", default="", help="dithering: max or l2")
    gc.add_argument("--gossip-gamma", type=float, help="gossip with a compressor: CHOCO's consensus step "
                                                        "(default: the compressor's)")
    parser.add_argument("--log-json", metavar="PATH",
                        help="append one JSON line per epoch (wall-clock time, accuracy) to PATH, in which "
                             "{rank} is replaced by the rank (scripts/netns_cluster.py reads these)")
    return parser


def choose_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``--mode``, else BPS_GOSSIP_MODE (bpslaunch --mode), else async under BYTEPS_ENABLE_ASYNC=1
    (DistributedTrainer would refuse another mode beside it), else gossip. Only allreduce pushes
    gradients, so --fp16-pushpull picks it where no mode was chosen (or gossip came from
    BPS_GOSSIP_MODE, as DistributedTrainer does), and with another mode it is a usage error
    (exit 2) before the job starts."""
    given = os.environ.get("BPS_GOSSIP_MODE", "").strip().lower() or ("async" if job_config().enable_async else "")
    mode = args.mode or given or "gossip"
    if args.fp16_pushpull and mode != "allreduce":
        if args.mode is None and given in ("", "gossip"):
            return "allreduce"
        # the setting the user made: --mode, BPS_GOSSIP_MODE (or bpslaunch --mode), or BYTEPS_ENABLE_ASYNC=1
        where = (f"--mode {args.mode}" if args.mode else
                 f"BPS_GOSSIP_MODE={given} (bpslaunch --mode sets it)" if os.environ.get("BPS_GOSSIP_MODE", "").strip()
                 else "BYTEPS_ENABLE_ASYNC=1 (mode async)")
        parser.error(f"--fp16-pushpull pushes gradients as float16, which only mode allreduce does, not {where} "
                     f"(in gossip mode, --compressor compresses the messages)")
    return mode


def main(argv: list[str] | None = None) -> int:
    """Train and report; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.mode = choose_mode(parser, args)
    bps.init()
    if args.fp16_pushpull and bps.rank() == 0:
        print("--fp16-pushpull: gradients pushed as float16, mode allreduce", flush=True)
    modes = ["gossip", "allreduce"] if args.mode == "both" else [args.mode]
    results = [train(args, mode) for mode in modes]
    for result in results:
        print(f"rank {bps.rank()} final test accuracy ({result['mode']}, {bps.size()} workers, "
              f"{result['steps']} steps, {result['seconds']:.1f} s): {result['accuracy']:.4f}  "
              f"consensus distance {result['consensus_distance']:.2e}", flush=True)
        if result["mode"] == "auto" and bps.rank() == 0:
            for step, mode, why in result["mode_history"]:
                print(f"  mode='auto' at step {step}: {mode} ({why})", flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
