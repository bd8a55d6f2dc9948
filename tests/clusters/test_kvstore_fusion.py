"""The 'bpsgossip' KVStore fuses a step's gradients (mxnet_plugin.kvstore_fusion).

gluon.Trainer(kvstore='bpsgossip') and Module(kvstore='bpsgossip') hand the store the whole
step: the servers must see fused tensors (few rounds, not one per gradient), and the
trained weights must be bit-identical to the same training with one pushpull per key,
on every rank, for a network of many small layers with BatchNorm, hybridized or not.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok
from test_mxnet_ops import HELPERS

from mxnet_plugin.kvstore_fusion import StepFusion

SNIPPET = HELPERS + """
import bps_gossip
import mxnet_plugin as bps
from mxnet import autograd, gluon
from mxnet.gluon import nn

bps.init()
rank, size = bps.rank(), bps.size()
HYBRID = @HYBRID@
B, STEPS = 4, 3
OPTIMIZER = {"learning_rate": 0.05, "momentum": 0.9}
data = np.random.RandomState(rank).standard_normal((STEPS, B, 3, 8, 8)).astype(np.float32)
labels = np.random.RandomState(rank + 10).randint(0, 5, (STEPS, B)).astype(np.float32)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

def build(seed):
    mx.random.seed(seed)
    net = nn.HybridSequential()
    for channels in (4, 6, 8):
        net.add(nn.Conv2D(channels, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"))
    net.add(nn.Dense(12, activation="relu"), nn.Dense(5))
    net.initialize(mx.init.Xavier())
    if HYBRID:
        net.hybridize()
    net(mx.nd.array(data[0]))
    return net

def backward(net, step):
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(data[step])), mx.nd.array(labels[step]))
    loss.backward()

def fused_run():
    net = build(0)  # every rank starts from the same weights: the two runs start alike
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore="bpsgossip")
    for step in range(STEPS):
        backward(net, step)
        trainer.step(B * size)
    return net

def separate_run(kv):
    # the same training with one kv.pushpull per gradient (what gluon.Trainer did before fusion)
    net = build(0)  # every rank starts from the same weights: the two runs start alike
    params = list(net.collect_params().values())
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=None)
    for step in range(STEPS):
        backward(net, step)
        if step == 0:  # where gluon.Trainer initializes its store: at the first step, after backward
            kv.broadcast([f"sep{i}" for i in range(len(params))], [p.data() for p in params],
                         out=[p.list_data() for p in params])
        for i, p in enumerate(params):
            if p.grad_req != "null":
                kv.pushpull(f"sep{i}", p.list_grad(), priority=-i)
        trainer.step(B * size)
    return net

out = {"rank": rank}
fused = fused_run()
mx.nd.waitall()  # the last step's sums run in MXNet's engine
rounds_fused = sum(s["rounds_done"] for s in bps_gossip.server_stats())
separate = separate_run(mx.kv.create("bpsgossip"))
mx.nd.waitall()
rounds_all = sum(s["rounds_done"] for s in bps_gossip.server_stats())
trained = [p for p in fused.collect_params().values() if p.grad_req != "null"]
out.update(fused_trained=digest([p.data() for p in trained]), fused=digest([p.data() for p in fused.collect_params().values()]),
           separate=digest([p.data() for p in separate.collect_params().values()]),
           trained=len(trained), rounds_fused=rounds_fused, rounds_separate=rounds_all - rounds_fused)

# Module(kvstore='bpsgossip') takes the same road (mxnet.model._update_params)
data_sym = mx.sym.var("data")
module_net = build(rank + 100)
symbol = mx.sym.SoftmaxOutput(module_net(data_sym), name="softmax")
module = mx.mod.Module(symbol, context=mx.cpu())
it = mx.io.NDArrayIter(data.reshape(-1, 3, 8, 8), labels.reshape(-1), B)
before = sum(s["rounds_done"] for s in bps_gossip.server_stats())
module.fit(it, num_epoch=1, kvstore="bpsgossip", optimizer="sgd", optimizer_params=OPTIMIZER,
           initializer=mx.init.Xavier())
mx.nd.waitall()
out["module_rounds"] = sum(s["rounds_done"] for s in bps_gossip.server_stats()) - before
out["module"] = digest(list(module.get_params()[0].values()))
out["failures"] = failures
report(out)
bps.shutdown()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hybrid", [False, True], ids=["imperative", "hybridized"])
def test_trainer_and_module_fuse_and_match_separate_pushpulls(cluster, hybrid):
    job = cluster(2, env={"BPS_GOSSIP_HOST_REDUCE": "off"})  # the servers count the rounds (on one host they take none)
    done = job.run_workers(SNIPPET.replace("@HYBRID@", str(hybrid)), timeout=140)
    assert_all_ok(done, job)
    results = sorted((f.result for f in done), key=lambda r: r["rank"])
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    for r in results:
        assert r["fused"] == r["separate"], "fusion changed the trained weights"
        # 3 steps of one round per trained gradient, were nothing fused (the servers' count
        # includes the start-up broadcasts of both runs, the same number for both)
        assert r["rounds_fused"] < r["rounds_separate"] - 2 * r["trained"], r
        assert r["module_rounds"] < 3 * r["trained"], r
    # gradients are summed, BatchNorm's running statistics stay each rank's own (as with dist_sync)
    assert len({r["fused_trained"] for r in results}) == 1 and len({r["module"] for r in results}) == 1
    job.wait_servers_exit()


def test_plan_cuts_by_size_dtype_and_devices():
    import mxnet as mx

    pushed = []
    fusion = StepFusion("kv_", lambda key, arrays, priority: pushed.append(key))
    small = [mx.nd.zeros((8,)), mx.nd.zeros((8,)), mx.nd.zeros((8,), dtype="float64"), mx.nd.zeros((8,))]
    big = mx.nd.zeros((1 << 17,))  # 512 KiB: alone
    calls = [(0, [small[0]], 0), (1, [small[1]], -1), (2, [small[2]], -2), (3, [big], -3), (4, [small[3]], -4),
             (5, [mx.nd.zeros((8,)), mx.nd.zeros((8,))], -5)]
    fusion._plan(calls, ())
    assert [(indices, name) for indices, name, _ in fusion.buckets] == [
        ([0, 1], "kv_fused_0_2"), ([2], "kv_fused_2_1"), ([4], "kv_fused_4_1"), ([5], "kv_fused_5_1")]
    assert fusion.alone == [3]
    assert fusion.buckets[0][2] == "fused [kv_0(8,), kv_1(8,)]"
