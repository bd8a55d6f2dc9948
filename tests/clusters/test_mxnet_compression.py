"""DistributedTrainer with BytePS's compression_params on real processes.

Two workers train a small network (one weight above BYTEPS_MIN_COMPRESS_BYTES, the rest
below) for a few SGD steps; every rank also replays the whole job locally: every rank's
gradients from the same batches, divided by batch x workers, through momentum, error
feedback and the compressors (worker and server side) of bps_gossip.compression, which
tests/clusters/test_compression.py checks against a numpy re-implementation. The trained weights
must equal the replay and be identical on both ranks.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

JOB = '''
import warnings
import mxnet as mx, numpy as np
import mxnet_plugin as bps
from bps_gossip.compression import PartitionState, compress_on_worker, merge_on_server, rng_for
from mxnet_plugin.compression import parse_compression_params

PARAMS = {params!r}
STEPS, BATCH, LR, MU = 3, 4, 0.1, 0.9

def make_net():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(320, in_units=64, activation="relu"), mx.gluon.nn.Dense(3, in_units=320))
    net.initialize(mx.init.Xavier(), force_reinit=True)
    return net

def batch(rank, step):
    rng = np.random.default_rng([rank, step])
    return mx.nd.array(rng.normal(size=(BATCH, 64))), mx.nd.array(rng.integers(0, 3, BATCH))

bps.init()
mx.random.seed(1)
net = make_net()
loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {{"learning_rate": LR, "momentum": MU}},
                                     compression_params=PARAMS)
for step in range(STEPS):
    data, label = batch(bps.rank(), step)
    with mx.autograd.record():
        loss = loss_fn(net(data), label)
    loss.backward()
    trainer.step(BATCH)
trained = [net.collect_params()[n].data().asnumpy() for n in sorted(net.collect_params())]

# The replay: the same network and batches, one process, the same compression pipeline.
optimizer_params = {{"momentum": MU}}
spec, fp16 = parse_compression_params(PARAMS, optimizer_params)
mu = optimizer_params.get("momentum", 0.0)  # what the optimizer keeps (nesterov moves it into spec)
mx.random.seed(1)
ref = make_net()
names = sorted(ref.collect_params())
weights = {{n: ref.collect_params()[n].data().asnumpy().astype(np.float32) for n in names}}
velocity = {{n: np.zeros_like(w) for n, w in weights.items()}}
exact_velocity = {{n: np.zeros_like(w) for n, w in weights.items()}}
exact = dict(weights)  # the same steps without compression, to show that compression acted
workers = {{(r, n): PartitionState() for r in range(2) for n in names}}
servers = {{n: PartitionState() for n in names}}
def gradients_at(values, rank, step):
    """rank's gradients at ``values``, divided by batch x workers as the trainer does."""
    for n in names:
        ref.collect_params()[n].set_data(mx.nd.array(values[n]))
    data, label = batch(rank, step)
    with mx.autograd.record():
        loss = loss_fn(ref(data), label)
    loss.backward()
    return {{n: ref.collect_params()[n].grad().asnumpy() / (BATCH * 2) for n in names}}

for step in range(STEPS):
    exact_grads = [gradients_at(exact, rank, step) for rank in range(2)]
    grads = [gradients_at(weights, rank, step) for rank in range(2)]
    for n in names:
        wire = [g[n].astype(np.float16) if fp16 else g[n] for g in grads]
        if spec is not None and wire[0].nbytes >= 65536:
            flat = [w.reshape(-1) for w in wire]
            codec = spec.codec(flat[0].size)
            total = sum(codec.decompress(compress_on_worker(spec, codec, flat[r], workers[r, n],
                                                             rng_for(spec.seed, 0, step, 0))) for r in range(2))
            merged = codec.decompress(merge_on_server(spec.ef, codec, total, servers[n], rng_for(spec.seed, 0, step, 1)))
            grad = merged.astype(wire[0].dtype).reshape(wire[0].shape)
        else:
            grad = (wire[0] + wire[1]).astype(wire[0].dtype)
        grad = grad.astype(np.float32)
        velocity[n] = mu * velocity[n] - LR * grad  # MXNet's SGD with momentum, rescale 1, no wd
        weights[n] = weights[n] + velocity[n]
        exact_velocity[n] = MU * exact_velocity[n] - LR * (exact_grads[0][n] + exact_grads[1][n])
        exact[n] = exact[n] + exact_velocity[n]
report({{"rank": bps.rank(), "warned": [str(w.message) for w in caught], "mode": trainer.mode,
         "diff": max(float(np.abs(mine - weights[n]).max()) for mine, n in zip(trained, names)),
         "off": max(float(np.abs(mine - exact[n]).max()) for mine, n in zip(trained, names)),
         "checksum": float(sum(np.abs(w).sum() for w in trained))}})
bps.shutdown()
'''

CASES = [
    {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True, "k": 1, "fp16": False},
    {"compressor": "topk", "ef": "vanilla", "momentum": "", "scaling": False, "k": 0.1, "fp16": False},
    {"compressor": "dithering", "ef": "", "momentum": "", "k": 4, "seed": 3, "partition": "natural",
     "normalize": "l2"},
    {"compressor": "randomk", "ef": "vanilla", "momentum": "nesterov", "k": 100, "seed": 7},
    {"compressor": "", "ef": "", "momentum": "", "scaling": False, "k": 1, "fp16": True},
    {"compressor": "", "ef": "", "momentum": "", "scaling": False, "k": 1, "fp16": False},  # BytePS's "none"
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("params", CASES, ids=[c["compressor"] or ("fp16" if c.get("fp16") else "none") for c in CASES])
def test_trainer_with_compression_params_equals_the_replay(cluster, params):
    # The compressor cases choose allreduce through BPS_GOSSIP_MODE (gossip would compress by CHOCO);
    # fp16 alone switches to allreduce with a warning; no compression stays in the default gossip mode.
    env = {"OMP_NUM_THREADS": "1", **({"BPS_GOSSIP_MODE": "allreduce"} if params["compressor"] else {})}
    job = cluster(2, 1, env)
    done = job.run_workers(JOB.format(params=params), timeout=150)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["checksum"] == second["checksum"], (first, second)  # identical models
    compressing = bool(params["compressor"] or params.get("fp16"))
    assert first["mode"] == ("allreduce" if compressing else "gossip"), first
    assert any("allreduce" in w for w in first["warned"]) == bool(params.get("fp16") and not params["compressor"]), first
    if params["compressor"] or params.get("fp16"):
        assert first["diff"] < 1e-6 and first["off"] > 1e-5, first  # the replay, and not the exact run


@pytest.mark.timeout(120)
def test_gossip_mode_compresses_its_messages(cluster):
    """The default mode with a compressor: CHOCO gossip; the models stay close, the optimizer
    keeps its momentum (nesterov and ef apply to gradients only), and an exact average ends equal."""
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_workers('''
        import mxnet as mx, numpy as np
        import mxnet_plugin as bps
        bps.init()
        mx.random.seed(bps.rank())
        net = mx.gluon.nn.Dense(300, in_units=64)
        net.initialize(mx.init.Xavier())
        params = {"compressor": "topk", "k": 0.05, "ef": "vanilla", "momentum": "nesterov", "fp16": False}
        trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                                         compression_params=params)
        rng = np.random.default_rng(bps.rank())
        losses = []
        for step in range(30):
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
    ''', timeout=100)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["mode"] == "gossip" and first["momentum"] == 0.9, first
    assert first["last"] < first["first"] and 0 < first["distance"] < 0.05, first
    assert first["after"] < 1e-6 and abs(first["checksum"] - second["checksum"]) < 1e-3, (first, second)


GC_EXAMPLE = '''
import argparse
import mxnet as mx, numpy as np
import mxnet_plugin as bps

# The calls BytePS's train_gluon_mnist_byteps_gc.py makes, in its order, with its options;
# the data is made here instead of downloaded (their scripts cannot ship with ours).
parser = argparse.ArgumentParser()
parser.add_argument("--compressor", type=str, default="")
parser.add_argument("--ef", type=str, default="")
parser.add_argument("--compress-momentum", type=str, default="")
parser.add_argument("--scaling", action="store_true", default=False)
parser.add_argument("--k", type=int, default=1)
parser.add_argument("--fp16-pushpull", action="store_true", default=False)
args = parser.parse_args({argv!r})
bps.init()
ctx = mx.cpu(bps.local_rank())
num_workers = bps.size()
net = mx.gluon.nn.HybridSequential()
net.add(mx.gluon.nn.Dense(256, activation="relu"), mx.gluon.nn.Dense(10))
net.initialize(mx.init.MSRAPrelu(), ctx=ctx)
net.hybridize()
compression_params = {{"compressor": args.compressor, "ef": args.ef, "momentum": args.compress_momentum,
                      "scaling": args.scaling, "k": args.k, "fp16": args.fp16_pushpull}}
optimizer_params = {{"momentum": 0.9, "wd": 1e-4, "learning_rate": 0.01 * num_workers}}
trainer = bps.DistributedTrainer(net.collect_params(), "sgd", optimizer_params,
                                 compression_params=compression_params)
loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.default_rng(bps.rank())
for step in range(20):
    data = mx.nd.array(rng.normal(size=(32, 784)), ctx=ctx)
    label = mx.nd.array(rng.integers(0, 10, 32), ctx=ctx)
    with mx.autograd.record():
        loss = loss_fn(net(data), label)
    loss.backward()
    trainer.step(32)
bps.byteps_declare_tensor("acc")
acc = mx.nd.array([float(bps.rank() + 1)], ctx=ctx)
bps.byteps_push_pull(acc, name="acc", is_average=False)
report({{"acc": float(acc.asscalar()), "mode": trainer.mode,
        "checksum": float(sum(p.data().abs().sum().asscalar() for p in net.collect_params().values()))}})
bps.shutdown()
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [[], ["--compressor", "onebit", "--ef", "vanilla", "--compress-momentum", "nesterov",
                                       "--scaling"], ["--compressor", "topk", "--k", "100"]],
                         ids=["none", "onebit", "topk"])
def test_byteps_gc_example_calls(cluster, argv):
    """BytePS's compression example, as a user would run it with allreduce chosen from outside
    (BPS_GOSSIP_MODE, i.e. bpslaunch --mode allreduce): ranks end identical."""
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1", "BPS_GOSSIP_MODE": "allreduce"})
    done = job.run_workers(GC_EXAMPLE.format(argv=argv), timeout=100)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["acc"] == second["acc"] == 3.0 and first["mode"] == "allreduce"
    assert first["checksum"] == second["checksum"], (first, second)
