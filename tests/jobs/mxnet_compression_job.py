"""DistributedTrainer with BytePS's compression_params (tests/clusters/test_mxnet_compression.py):
two workers train and replay the whole job locally through bps_gossip.compression; CHOCO gossip
with a compressor; and the calls BytePS's compression example makes.
"""

from __future__ import annotations

import argparse
import json
import warnings

import mxnet as mx
import numpy as np
from job_tools import report, run

import mxnet_plugin as bps
from bps_gossip.compression import PartitionState, compress_on_worker, merge_on_server, rng_for
from mxnet_plugin.compression import parse_compression_params

STEPS, BATCH, LR, MU = 3, 4, 0.1, 0.9
loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()


def make_net():
    """One weight above BYTEPS_MIN_COMPRESS_BYTES, the rest below; Xavier from the current seed."""
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(320, in_units=64, activation="relu"), mx.gluon.nn.Dense(3, in_units=320))
    net.initialize(mx.init.Xavier(), force_reinit=True)
    return net


def batch(rank, step):
    """Rank's batch at ``step``."""
    rng = np.random.default_rng([rank, step])
    return mx.nd.array(rng.normal(size=(BATCH, 64))), mx.nd.array(rng.integers(0, 3, BATCH))


class Replay:
    """The job in one process: the same network and batches, the same compression pipeline, and
    the same steps without compression (to show that compression acted)."""

    def __init__(self, params):
        optimizer_params = {"momentum": MU}
        self.spec, self.fp16 = parse_compression_params(params, optimizer_params)
        self.mu = optimizer_params.get("momentum", 0.0)  # what the optimizer keeps (nesterov moves it into spec)
        mx.random.seed(1)
        self.ref = make_net()
        self.names = sorted(self.ref.collect_params())
        self.weights = {n: self.ref.collect_params()[n].data().asnumpy().astype(np.float32) for n in self.names}
        self.velocity = {n: np.zeros_like(w) for n, w in self.weights.items()}
        self.exact_velocity = {n: np.zeros_like(w) for n, w in self.weights.items()}
        self.exact = dict(self.weights)
        self.workers = {(r, n): PartitionState() for r in range(2) for n in self.names}
        self.servers = {n: PartitionState() for n in self.names}

    def gradients_at(self, values, rank, step):
        """rank's gradients at ``values``, divided by batch x workers as the trainer does."""
        for n in self.names:
            self.ref.collect_params()[n].set_data(mx.nd.array(values[n]))
        data, label = batch(rank, step)
        with mx.autograd.record():
            loss = loss_fn(self.ref(data), label)
        loss.backward()
        return {n: self.ref.collect_params()[n].grad().asnumpy() / (BATCH * 2) for n in self.names}

    def summed(self, n, grads, step):
        """The two ranks' gradients of ``n`` as the servers return them (compressed if large enough)."""
        spec = self.spec
        wire = [g[n].astype(np.float16) if self.fp16 else g[n] for g in grads]
        if spec is not None and wire[0].nbytes >= 65536:
            flat = [w.reshape(-1) for w in wire]
            codec = spec.codec(flat[0].size)
            total = sum(codec.decompress(compress_on_worker(spec, codec, flat[r], self.workers[r, n],
                                                             rng_for(spec.seed, 0, step, 0))) for r in range(2))
            merged = codec.decompress(merge_on_server(spec.ef, codec, total, self.servers[n],
                                                      rng_for(spec.seed, 0, step, 1)))
            grad = merged.astype(wire[0].dtype).reshape(wire[0].shape)
        else:
            grad = (wire[0] + wire[1]).astype(wire[0].dtype)
        return grad.astype(np.float32)

    def step(self, step):
        """One SGD step with momentum of both runs."""
        exact_grads = [self.gradients_at(self.exact, rank, step) for rank in range(2)]
        grads = [self.gradients_at(self.weights, rank, step) for rank in range(2)]
        for n in self.names:
            grad = self.summed(n, grads, step)
            self.velocity[n] = self.mu * self.velocity[n] - LR * grad  # MXNet's SGD with momentum, rescale 1, no wd
            self.weights[n] = self.weights[n] + self.velocity[n]
            self.exact_velocity[n] = MU * self.exact_velocity[n] - LR * (exact_grads[0][n] + exact_grads[1][n])
            self.exact[n] = self.exact[n] + self.exact_velocity[n]


def replay(params_json: str) -> None:
    """Train with compression_params (JSON), replay the job locally, report the differences."""
    params = json.loads(params_json)
    bps.init()
    mx.random.seed(1)
    net = make_net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR, "momentum": MU},
                                         compression_params=params)
    for step in range(STEPS):
        data, label = batch(bps.rank(), step)
        with mx.autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(BATCH)
    trained = [net.collect_params()[n].data().asnumpy() for n in sorted(net.collect_params())]

    local = Replay(params)
    for step in range(STEPS):
        local.step(step)
    names = local.names
    report({"rank": bps.rank(), "warned": [str(w.message) for w in caught], "mode": trainer.mode,
            "diff": max(float(np.abs(mine - local.weights[n]).max()) for mine, n in zip(trained, names)),
            "off": max(float(np.abs(mine - local.exact[n]).max()) for mine, n in zip(trained, names)),
            "checksum": float(sum(np.abs(w).sum() for w in trained))})
    bps.shutdown()


def gossip() -> None:
    """30 steps of CHOCO gossip with topk; the consensus distance before and after an exact average."""
    bps.init()
    mx.random.seed(bps.rank())
    net = mx.gluon.nn.Dense(300, in_units=64)
    net.initialize(mx.init.Xavier())
    params = {"compressor": "topk", "k": 0.05, "ef": "vanilla", "momentum": "nesterov", "fp16": False}
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                                     compression_params=params)
    rng = np.random.default_rng(bps.rank())
    losses = []
    for _step in range(30):
        data = mx.nd.array(rng.normal(size=(8, 64)))
        with mx.autograd.record():
            loss = (net(data) ** 2).mean()
        loss.backward()
        trainer.step(8)
        losses.append(float(loss.asscalar()))
    distance = trainer.consensus_distance()
    trainer.average_parameters()
    report({"mode": trainer.mode, "momentum": trainer._optimizer.momentum, "distance": distance,
            "first": losses[0], "last": losses[-1], "after": trainer.consensus_distance(),
            "checksum": float(net.weight.data().abs().sum().asscalar())})
    bps.shutdown()


def gc_example(*argv: str) -> None:
    """The calls BytePS's train_gluon_mnist_byteps_gc.py makes, in its order, with its options
    (``argv``); the data is made here instead of downloaded (their scripts cannot ship with ours)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--compressor", type=str, default="")
    parser.add_argument("--ef", type=str, default="")
    parser.add_argument("--compress-momentum", type=str, default="")
    parser.add_argument("--scaling", action="store_true", default=False)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--fp16-pushpull", action="store_true", default=False)
    args = parser.parse_args(list(argv))
    bps.init()
    ctx = mx.cpu(bps.local_rank())
    num_workers = bps.size()
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(256, activation="relu"), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.MSRAPrelu(), ctx=ctx)
    net.hybridize()
    compression_params = {"compressor": args.compressor, "ef": args.ef, "momentum": args.compress_momentum,
                          "scaling": args.scaling, "k": args.k, "fp16": args.fp16_pushpull}
    optimizer_params = {"momentum": 0.9, "wd": 1e-4, "learning_rate": 0.01 * num_workers}
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", optimizer_params,
                                     compression_params=compression_params)
    rng = np.random.default_rng(bps.rank())
    for _step in range(20):
        data = mx.nd.array(rng.normal(size=(32, 784)), ctx=ctx)
        label = mx.nd.array(rng.integers(0, 10, 32), ctx=ctx)
        with mx.autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(32)
    bps.byteps_declare_tensor("acc")
    acc = mx.nd.array([float(bps.rank() + 1)], ctx=ctx)
    bps.byteps_push_pull(acc, name="acc", is_average=False)
    report({"acc": float(acc.asscalar()), "mode": trainer.mode,
            "checksum": float(sum(p.data().abs().sum().asscalar() for p in net.collect_params().values()))})
    bps.shutdown()


if __name__ == "__main__":
    run({"replay": replay, "gossip": gossip, "gc_example": gc_example})
