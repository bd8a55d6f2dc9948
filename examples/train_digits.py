"""Train a small MLP on scikit-learn's digits (shipped inside the package: no download)
with mxnet_plugin's DistributedTrainer.

    bpslaunch -np 4 python examples/train_digits.py --epochs 10

Every rank initializes with its own seed (the first step broadcasts rank 0's weights),
trains on its own shard of the training set, and prints its loss and accuracy per epoch.
"""

from __future__ import annotations

import argparse
import sys
import time

import mxnet as mx
import numpy as np
from sklearn.datasets import load_digits
from tqdm import tqdm

import mxnet_plugin as bps


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 in [0, 1]: 1,500 training and 297 test images (fixed split)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def build_net() -> mx.gluon.nn.Sequential:
    """A 64-64-10 MLP whose input size is inferred at the first forward (deferred init)."""
    net = mx.gluon.nn.Sequential()
    net.add(mx.gluon.nn.Dense(64, activation="relu"), mx.gluon.nn.Dense(10))
    return net


def accuracy(net: mx.gluon.nn.Sequential, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of correct predictions."""
    predictions = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float((predictions == y).mean())


def main(argv: list[str] | None = None) -> int:
    """Train and report; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=["allreduce"], default="allreduce")
    args = parser.parse_args(argv)

    bps.init()
    rank, size = bps.rank(), bps.size()
    x_train, y_train, x_test, y_test = load_data()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    mx.random.seed(args.seed + rank)  # different on every rank: the broadcast makes them agree
    net = build_net()
    net.initialize(mx.init.Xavier())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": args.lr, "momentum": 0.9}, mode=args.mode)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(args.seed + rank)
    steps_per_epoch = len(x_shard) // args.batch_size
    start = time.time()
    # One bar on rank 0 (the others print their epoch lines only), one update per epoch.
    bar = tqdm(total=args.epochs, desc="epochs", unit="epoch", disable=rank != 0, file=sys.stderr, ascii=True)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        total_loss = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            data, label = mx.nd.array(x_shard[batch]), mx.nd.array(y_shard[batch])
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size)
            total_loss += float(loss.mean().asscalar())
        bar.update(1)
        print(f"rank {rank} epoch {epoch + 1}/{args.epochs}: loss {total_loss / steps_per_epoch:.4f} "
              f"train-shard accuracy {accuracy(net, x_shard, y_shard):.4f} "
              f"test accuracy {accuracy(net, x_test, y_test):.4f}", flush=True)
    bar.close()
    final = accuracy(net, x_test, y_test)
    print(f"rank {rank} final test accuracy ({args.mode}, {size} workers, "
          f"{time.time() - start:.1f} s): {final:.4f}", flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
