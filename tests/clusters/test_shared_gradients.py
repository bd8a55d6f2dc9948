"""Gradients in shared memory (mxnet_plugin.shared_gradients): gluon.Trainer with the 'bpsgossip'
KVStore and DistributedTrainer's allreduce mode move the trained gradients into the worker's
shared memory at their first step (the Module API when it sets up its optimizer), so push_pulls to a server on this host copy nothing in or out.
The weights are bit for bit those of MXNet's own gradient arrays (BPS_GOSSIP_SHM_GRADIENTS=0)."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

from bps_gossip.transport import shm

JOB = '''
import hashlib, mxnet as mx, numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn
import mxnet_plugin as bps
from bps_gossip import testing
from mxnet_plugin.layouts import IdleViews

bps.init()
rank, size = bps.rank(), bps.size()
pool = testing.segment_pool()


def build():
    mx.random.seed(5)
    net = nn.HybridSequential()
    # a large weight (sent alone), small ones (fused), BatchNorm (running statistics not trained)
    net.add(nn.Dense(300, in_units=400), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(10, in_units=300))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def run(make_trainer, batch):
    net = build()
    trainer = make_trainer(net)
    rs = np.random.RandomState(rank)
    for step in range(4):
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


def run_module():
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
    for step in range(4):
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


out = {
    "module": run_module(),
    "allreduce": run(lambda net: bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                                         mode="allreduce"), 8),
    "kvstore": run(lambda net: gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                             kvstore=mx.kv.create("bpsgossip")), 8 * size),
}
# gradients the worker staged (copied into a segment of the pool's own), by tensor name (a key the
# KVStore sends alone has its broadcast's name, which is staged: only fused keys are told apart)
out["staged"] = sorted(name for name in pool._free if "gradient" in name or "fused" in name)
report(out)
bps.shutdown()
'''


def _run(cluster, flag: str) -> list[dict]:
    job = cluster(2, env={"BPS_GOSSIP_SHM": "1", "BPS_GOSSIP_SHM_GRADIENTS": flag})
    done = job.run_workers(JOB, timeout=100)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}_{job.port}_*"))  # the buffers' names went with the job
    return [f.result for f in done]


@pytest.mark.timeout(240)
def test_gradients_in_shared_memory_are_sent_in_place_with_the_same_results(cluster):
    shared, copied = _run(cluster, "1"), _run(cluster, "0")
    for mode in ("allreduce", "kvstore", "module"):
        assert all(all(r[mode]["shared"]) and len(r[mode]["shared"]) == 6 for r in shared), shared
        assert not any(any(r[mode]["shared"]) for r in copied), copied
        # the same bits on every rank and with MXNet's own gradient arrays
        assert len({r[mode]["digest"] for r in shared + copied}) == 1, (mode, [r[mode]["digest"][:8] for r in shared + copied])
    assert all(r["staged"] == [] for r in shared), shared  # nothing copied into another segment
    assert all(r["staged"] for r in copied), copied


@pytest.mark.timeout(60)
def test_a_bad_switch_is_refused(cluster):
    job = cluster(1, env={"BPS_GOSSIP_SHM_GRADIENTS": "maybe"})
    done = job.run_workers('''
        import mxnet_plugin.shared_gradients as shared
        import bps_gossip as core
        try:
            shared.enabled()
            report("accepted")
        except core.ConfigError as exc:
            report(str(exc))
    ''')
    assert_all_ok(done, job)
    assert "BPS_GOSSIP_SHM_GRADIENTS='maybe'" in done[0].result
