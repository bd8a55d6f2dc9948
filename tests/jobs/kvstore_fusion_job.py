"""The 'bpsgossip' KVStore fusing a step's gradients (tests/clusters/test_kvstore_fusion.py):
gluon.Trainer and Module on the store, and the same training with one pushpull per key, on a
network of many small layers with BatchNorm; the servers' round counts tell fusion apart.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet_job_helpers import digest, failures

import bps_gossip
import mxnet_plugin as bps

B, STEPS = 4, 3
OPTIMIZER = {"learning_rate": 0.05, "momentum": 0.9}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


class Training:
    """One rank's data and network, hybridized or not."""

    def __init__(self, rank, size, hybrid):
        self.size, self.hybrid = size, hybrid
        self.data = np.random.RandomState(rank).standard_normal((STEPS, B, 3, 8, 8)).astype(np.float32)
        self.labels = np.random.RandomState(rank + 10).randint(0, 5, (STEPS, B)).astype(np.float32)

    def build(self, seed):
        """Three Conv2D + BatchNorm + relu, two Dense; initialized with ``seed``, shapes known."""
        mx.random.seed(seed)
        net = nn.HybridSequential()
        for channels in (4, 6, 8):
            net.add(nn.Conv2D(channels, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"))
        net.add(nn.Dense(12, activation="relu"), nn.Dense(5))
        net.initialize(mx.init.Xavier())
        if self.hybrid:
            net.hybridize()
        net(mx.nd.array(self.data[0]))
        return net

    def backward(self, net, step):
        """Forward and backward of one step's batch."""
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(self.data[step])), mx.nd.array(self.labels[step]))
        loss.backward()

    def fused_run(self):
        """gluon.Trainer(kvstore='bpsgossip'): the store fuses each step's gradients."""
        net = self.build(0)  # every rank starts from the same weights: the two runs start alike
        trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore="bpsgossip")
        for step in range(STEPS):
            self.backward(net, step)
            trainer.step(B * self.size)
        return net

    def separate_run(self, kv):
        """The same training with one kv.pushpull per gradient (what gluon.Trainer did before fusion)."""
        net = self.build(0)  # every rank starts from the same weights: the two runs start alike
        params = list(net.collect_params().values())
        trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=None)
        for step in range(STEPS):
            self.backward(net, step)
            if step == 0:  # where gluon.Trainer initializes its store: at the first step, after backward
                kv.broadcast([f"sep{i}" for i in range(len(params))], [p.data() for p in params],
                             out=[p.list_data() for p in params])
            for i, p in enumerate(params):
                if p.grad_req != "null":
                    kv.pushpull(f"sep{i}", p.list_grad(), priority=-i)
            trainer.step(B * self.size)
        return net


def rounds_done():
    """Rounds the servers finished so far, all together."""
    return sum(s["rounds_done"] for s in bps_gossip.server_stats())


def fuse_and_match(hybrid: str) -> None:
    """Fused and separate trainings' digests and round counts, then Module(kvstore='bpsgossip')'s."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    training = Training(rank, size, hybrid == "True")
    out = {"rank": rank}
    fused = training.fused_run()
    mx.nd.waitall()  # the last step's sums run in MXNet's engine
    rounds_fused = rounds_done()
    separate = training.separate_run(mx.kv.create("bpsgossip"))
    mx.nd.waitall()
    rounds_all = rounds_done()
    trained = [p for p in fused.collect_params().values() if p.grad_req != "null"]
    out.update(fused_trained=digest([p.data() for p in trained]),
               fused=digest([p.data() for p in fused.collect_params().values()]),
               separate=digest([p.data() for p in separate.collect_params().values()]),
               trained=len(trained), rounds_fused=rounds_fused, rounds_separate=rounds_all - rounds_fused)

    # Module(kvstore='bpsgossip') takes the same road (mxnet.model._update_params)
    data_sym = mx.sym.var("data")
    module_net = training.build(rank + 100)
    symbol = mx.sym.SoftmaxOutput(module_net(data_sym), name="softmax")
    module = mx.mod.Module(symbol, context=mx.cpu())
    it = mx.io.NDArrayIter(training.data.reshape(-1, 3, 8, 8), training.labels.reshape(-1), B)
    before = rounds_done()
    module.fit(it, num_epoch=1, kvstore="bpsgossip", optimizer="sgd", optimizer_params=OPTIMIZER,
               initializer=mx.init.Xavier())
    mx.nd.waitall()
    out["module_rounds"] = rounds_done() - before
    out["module"] = digest(list(module.get_params()[0].values()))
    out["failures"] = failures
    report(out)
    bps.shutdown()


if __name__ == "__main__":
    run({"fuse_and_match": fuse_and_match})
