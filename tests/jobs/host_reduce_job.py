"""Reducing by host (tests/clusters/test_host_reduce.py): each rank's place and what the servers
took, a mismatch inside a host, compressed tensors beside plain ones, and gossip by host with
DistributedTrainer. The test's collectives checks run tests/jobs/push_pull_job.py."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import testing


def places() -> None:
    """5 push_pulls of 1.2 MB and a small one: what each rank learned of its place, the servers' stats."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    hosts = testing.host_link()
    x = np.arange(300000, dtype=np.float32) * (rank + 1)
    for _ in range(5):
        out = bps.push_pull(x, "grad", average=False)
        assert np.array_equal(out, np.arange(300000, dtype=np.float32) * sum(range(1, size + 1))), out[:4]
    small = bps.push_pull(np.array([rank], dtype=np.int64), "small", average=False)
    bps.barrier()
    stats = bps.server_stats() if rank == 0 else None
    report({"rank": rank, "hosting": hosts.hosting, "leader": hosts.leader, "small": int(small[0]),
            "digest": float(out.sum()), "stats": stats,
            "summation_threads": any(t.name.startswith("bps-hostsum") for t in threading.enumerate())})
    bps.shutdown()


def mismatch(leader_late: str) -> None:
    """Rank 1 (a local of leader 0) pushes another shape; the leader comes late if ``leader_late`` is True."""
    from bps_gossip.errors import TensorMismatchError

    bps.init()
    rank = bps.rank()
    shape = (5,) if rank != 1 else (6,)  # rank 1 is a local of leader 0
    if rank == 0 and leader_late == "True":  # the leader's round then starts from its local's signature
        time.sleep(0.5)
    try:
        bps.push_pull(np.ones(shape, np.float32), "bad", average=False)
        report({"rank": rank, "error": None})
    except TensorMismatchError as exc:
        report({"rank": rank, "error": str(exc)})
    # The job goes on: the next push_pull works everywhere.
    out = bps.push_pull(np.ones(3, np.float32), "good", average=False)
    assert np.all(out == bps.size()), out
    bps.shutdown()


def compressed_and_plain() -> None:
    """A plain push_pull (checked here) and a onebit-compressed one: the compressed result's mean."""
    from bps_gossip.compression import CompressionSpec

    bps.init()
    rank, size = bps.rank(), bps.size()
    plain = bps.push_pull(np.full(200000, rank + 1, np.float32), "plain", average=False)
    assert np.all(plain == size * (size + 1) / 2), plain[:4]
    packed = bps.push_pull(np.full(200000, rank + 1.0, np.float32), "packed", average=True,
                           compression=CompressionSpec("onebit", scaling=True))
    report({"rank": rank, "packed": float(packed.mean())})
    bps.shutdown()


def params_digest(net: Any) -> str:
    """sha256 over a network's parameters, sorted by name."""
    h = hashlib.sha256()
    for _, p in sorted(net.collect_params().items()):
        h.update(p.data().asnumpy().tobytes())
    return h.hexdigest()


def gossip_by_host(hybridize: str) -> None:
    """4 steps of mobilenet0.25 with DistributedTrainer's default mode (``hybridize`` True or
    False): digests before and after averaging, the averager's class, finiteness, the distance."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.gluon.model_zoo import vision

    import mxnet_plugin as mxbps

    mxbps.init()
    rank = mxbps.rank()
    mx.random.seed(rank)
    net = vision.mobilenet0_25(classes=3)  # BatchNorm's running statistics are gossiped too
    net.initialize(mx.init.Xavier())
    if hybridize == "True":
        net.hybridize()
    trainer = mxbps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    rng = np.random.RandomState(rank)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(4):
        data, label = mx.nd.array(rng.uniform(-1, 1, (4, 3, 32, 32))), mx.nd.array(rng.randint(0, 3, 4))
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(4)
    trained = params_digest(net)
    averager = type(trainer.mode_object.gossip.averager).__name__
    finite = all(np.isfinite(p.data().asnumpy()).all() for p in net.collect_params().values())
    distance = trainer.consensus_distance()
    trainer.average_parameters()
    report({"rank": rank, "trained": trained, "averager": averager, "finite": finite, "distance": distance,
            "averaged": params_digest(net)})
    mxbps.shutdown()


if __name__ == "__main__":
    run({"places": places, "mismatch": mismatch, "compressed_and_plain": compressed_and_plain,
         "gossip_by_host": gossip_by_host})
