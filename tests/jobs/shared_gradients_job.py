"""Gradients in shared memory (tests/clusters/test_shared_gradients.py): the Module API,
DistributedTrainer's allreduce mode and gluon.Trainer on the 'bpsgossip' KVStore each train,
and report whether their gradients lie in the worker's segment pool and a digest of the weights.
"""

from __future__ import annotations

import hashlib

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet import autograd, gluon
from mxnet.gluon import nn

import bps_gossip as core
import mxnet_plugin as bps
import mxnet_plugin.shared_gradients as shared_gradients
from bps_gossip import testing
from mxnet_plugin.layouts import IdleViews


def build():
    """A large weight (sent alone), small ones (fused), BatchNorm (running statistics not trained)."""
    mx.random.seed(5)
    net = nn.HybridSequential()
    net.add(nn.Dense(300, in_units=400), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(10, in_units=300))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def train_gluon(pool, rank, make_trainer, batch):
    """Four steps with an inference forward between them; the digest and which gradients are shared."""
    net = build()
    trainer = make_trainer(net)
    rs = np.random.RandomState(rank)
    for _step in range(4):
        x, y = mx.nd.array(rs.uniform(-1, 1, (8, 400))), mx.nd.array(rs.randint(0, 10, 8))
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
        loss.backward()
        trainer.step(batch)
        net(x).wait_to_read()  # an inference forward between steps
    mx.nd.waitall()
    views = IdleViews()
    learned = [p for p in net.collect_params().values() if p.grad_req != "null"]
    shared = [pool.leased(views.flat(p.name, p.grad())) is not None for p in learned]
    digest = hashlib.sha256(b"".join(p.data().asnumpy().tobytes() for p in learned)).hexdigest()
    return {"digest": digest, "shared": shared}


def train_module(pool, rank):
    """Module(kvstore='bpsgossip') for four steps; the digest and which gradients are shared."""
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=300, name="fc1")
    net = mx.sym.Activation(mx.sym.BatchNorm(net, name="bn"), act_type="relu")
    net = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(net, num_hidden=10, name="fc2"), name="softmax")
    module = mx.mod.Module(net, context=mx.cpu())
    module.bind(data_shapes=[("data", (8, 400))], label_shapes=[("softmax_label", (8,))])
    module.init_params(mx.init.Xavier())
    seeded = np.random.RandomState(5)  # the same start in every run, for comparing runs bit for bit
    args, auxs = module.get_params()
    module.set_params({name: mx.nd.array(seeded.uniform(-0.1, 0.1, a.shape)) for name, a in args.items()}, auxs)
    module.init_optimizer(kvstore="bpsgossip", optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    rs = np.random.RandomState(rank)
    for _step in range(4):
        batch = mx.io.DataBatch([mx.nd.array(rs.uniform(-1, 1, (8, 400)))], [mx.nd.array(rs.randint(0, 10, 8))])
        module.forward_backward(batch)
        module.update()
        # (no inference forward here: with one between steps, Module's results differ from run to run
        # in MXNet itself, one process without a store; the comparison is bit for bit)
    mx.nd.waitall()
    views, group = IdleViews(), module._exec_group
    shared = [pool.leased(views.flat(name, grads[0])) is not None
              for name, grads in zip(group.param_names, group.grad_arrays) if grads[0] is not None]
    args, _ = module.get_params()
    digest = hashlib.sha256(b"".join(args[name].asnumpy().tobytes() for name in sorted(args))).hexdigest()
    return {"digest": digest, "shared": shared}


def three_ways() -> None:
    """Module, allreduce and kvstore trainings; and the gradient segments the worker staged."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    pool = testing.segment_pool()
    out = {
        "module": train_module(pool, rank),
        "allreduce": train_gluon(pool, rank, lambda net: bps.DistributedTrainer(
            net.collect_params(), "sgd", {"learning_rate": 0.1}, mode="allreduce"), 8),
        "kvstore": train_gluon(pool, rank, lambda net: gluon.Trainer(
            net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=mx.kv.create("bpsgossip")), 8 * size),
    }
    # gradients the worker staged (copied into a segment of the pool's own), by tensor name (a key the
    # KVStore sends alone has its broadcast's name, which is staged: only fused keys are told apart)
    out["staged"] = [name for name in pool.staged_names() if "gradient" in name or "fused" in name]
    report(out)
    bps.shutdown()


def bad_switch() -> None:
    """Reports what shared_gradients.enabled() says of BPS_GOSSIP_SHM_GRADIENTS (no job started)."""
    try:
        shared_gradients.enabled()
        report("accepted")
    except core.ConfigError as exc:
        report(str(exc))


if __name__ == "__main__":
    run({"three_ways": three_ways, "bad_switch": bad_switch})
