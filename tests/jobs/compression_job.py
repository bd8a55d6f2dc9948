"""Compression on real clusters (tests/clusters/test_compression.py): compressed push_pulls the
test compares with its numpy reference, BYTEPS_TRACE_ON for push_pulls and gossip rounds, and
compressed gossip (CHOCO) on a ring."""

from __future__ import annotations

import json

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip.compression import CompressionSpec


def compressed_push_pull(specs: str, steps: str, size: str) -> None:
    """``steps`` compressed push_pulls of ``size`` random gradients for each of ``specs`` (JSON),
    then a small one below BYTEPS_MIN_COMPRESS_BYTES: every result."""
    bps.init()
    out = []
    for index, params in enumerate(json.loads(specs)):
        spec = CompressionSpec(**params)
        rounds = []
        for step in range(int(steps)):
            grad = np.random.default_rng([bps.rank(), step]).normal(size=int(size)).astype(np.float32)
            rounds.append(bps.push_pull(grad, f"g{index}", average=False, compression=spec).tolist())
        out.append(rounds)
    small = bps.push_pull(np.ones(10, np.float32), "small", compression=CompressionSpec("onebit"))
    report({"rounds": out, "small": small.tolist()})
    bps.shutdown()


def trace_push_pulls() -> None:
    """6 steps of a small push_pull and a big topk-compressed one, traced by BYTEPS_TRACE_ON."""
    bps.init()
    for _ in range(6):
        bps.push_pull(np.ones(10, np.float32), "small")
        bps.push_pull(np.ones(40000, np.float32), "big", compression=CompressionSpec("topk", k=0.1))
    bps.shutdown()
    report("ok")


def trace_gossip() -> None:
    """6 steps of DistributedTrainer's default (gossip) mode, traced by BYTEPS_TRACE_ON."""
    import mxnet as mx

    import mxnet_plugin as mxbps

    mxbps.init()
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize()
    plain = mxbps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    for _ in range(6):
        with mx.autograd.record():
            loss = net(mx.nd.ones((2, 4))).sum()
        loss.backward()
        plain.step(2)
    mxbps.shutdown()
    report("ok")


def choco(params: str) -> None:
    """150 rounds of CHOCO with the compressor ``params`` (JSON): sums over ranks every 50 rounds,
    the initial sum, distances, and the largest distance to the mean."""
    from bps_gossip.gossip.choco import ChocoAverager

    bps.init()
    start = np.random.default_rng(bps.rank()).normal(size=5000).astype(np.float32)
    averager = ChocoAverager({"w": start}, CompressionSpec(**json.loads(params)), gamma=0.2, tag="choco")
    sums, distances = [], []
    for rnd in range(150):
        averager.step()
        if rnd % 50 == 49:
            sums.append(bps.push_pull(averager.x["w"].astype(np.float64), f"sum{rnd}", average=False).tolist())
            distances.append(averager.consensus_distance())
    initial = bps.push_pull(start.astype(np.float64), "initial", average=False)
    report({"sums": sums, "initial": initial.tolist(), "distances": distances,
            "to_mean": float(np.abs(averager.x["w"] - initial / 3).max())})
    bps.shutdown()


if __name__ == "__main__":
    run({"compressed_push_pull": compressed_push_pull, "trace_push_pulls": trace_push_pulls,
         "trace_gossip": trace_gossip, "choco": choco})
