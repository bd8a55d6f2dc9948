"""The worker program of the real-network tests: every mxnet_plugin entry point on one
convolutional network, with oneDNN layouts in the weights (an inference forward runs
before each phase and between training steps, as evaluation would).

Usage: ``cnn_job.py NETWORK HYBRIDIZE`` with NETWORK in resnet18_v1, mobilenet0.25,
bn_dropout and HYBRIDIZE 0 or 1. Prints one RESULT line per phase, a dict with the
phase's name; the test (tests/clusters/test_mxnet_cnn.py) compares ranks and references.
"""

import hashlib
import json
import os
import sys
import tempfile
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.model_zoo import vision

import mxnet_plugin as bps
from bps_gossip.compat import zip_exact
from mxnet_plugin import elastic

NETWORK, HYBRIDIZE = sys.argv[1], sys.argv[2] == "1"
STEPS, B, CLASSES = 3, 2, 10
PIXELS = 255.0  # inputs on the scale of raw pixel values
OPTIMIZER = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

bps.init()
rank, size = bps.rank(), bps.size()
rs_data = np.random.RandomState(11)
X = rs_data.uniform(-1, 1, (STEPS, size, B, 3, 32, 32)).astype(np.float32)
Y = rs_data.randint(0, CLASSES, (STEPS, size, B)).astype(np.float32)
EVAL = mx.nd.array(rs_data.uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32))


def report(value):
    print("RESULT " + json.dumps(value), flush=True)


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.asnumpy().tobytes())
    return h.hexdigest()


def build(seed):
    """The network, initialized from ``seed``, shapes known (an inference forward: oneDNN layouts)."""
    mx.random.seed(seed)
    if NETWORK == "resnet18_v1":
        net = vision.resnet18_v1(classes=CLASSES)
    elif NETWORK == "mobilenet0.25":
        net = vision.mobilenet0_25(classes=CLASSES)
    else:  # every shape deferred; BatchNorm and Dropout
        net = nn.HybridSequential()
        net.add(nn.Conv2D(8, 3), nn.BatchNorm(), nn.Activation("relu"), nn.MaxPool2D(2),
                nn.Conv2D(8, 3, groups=8), nn.BatchNorm(), nn.Activation("relu"), nn.Dropout(0.3),
                nn.GlobalAvgPool2D(), nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    if HYBRIDIZE:
        net.hybridize()
    evaluate(net)
    return net


def evaluate(net):
    """An inference forward: leaves convolution weights in oneDNN layouts."""
    net(EVAL).wait_to_read()


def params(net):
    return [p for _, p in sorted(net.collect_params().items())]


def trained(net):
    """Values of the trained parameters (grad_req != 'null'), sorted by name."""
    return [p.data() for p in params(net) if p.grad_req != "null"]


def statistics(net):
    """Values of the parameters that are not trained (BatchNorm's running statistics)."""
    return [p.data() for p in params(net) if p.grad_req == "null"]


def backward(net, step, r, scale=1.0):
    """Forward and backward on rank ``r``'s batch of ``step`` (Dropout's masks seeded per rank),
    its inputs multiplied by ``scale``."""
    mx.random.seed(1000 * step + r)
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(X[step, r] * scale)), mx.nd.array(Y[step, r]))
    loss.backward()


def train(net, trainer, batch_size, steps=STEPS):
    for step in range(steps):
        backward(net, step, rank)
        trainer.step(batch_size)
        evaluate(net)  # evaluation between steps: the next update meets oneDNN layouts


def in_shared_memory(net):
    """Whether every trained gradient lies in this worker's shared memory (mxnet_plugin.shared_gradients)."""
    from bps_gossip import testing
    from mxnet_plugin.layouts import IdleViews
    mx.nd.waitall()
    pool, views = testing.segment_pool(), IdleViews()
    return all(pool.leased(views.flat(p.name, p.grad())) is not None for p in params(net) if p.grad_req != "null")


def compare(got, want):
    """What differs between two lists of arrays beyond float tolerance ('' if nothing)."""
    for a, b in zip_exact(got, want):
        a = a.asnumpy() if isinstance(a, mx.nd.NDArray) else a
        b = b.asnumpy() if isinstance(b, mx.nd.NDArray) else b
        if not np.allclose(a, b, rtol=2e-4, atol=2e-5):
            return f"max abs difference {np.abs(a - b).max():g} where values reach {np.abs(b).max():g}"
    return ""


def reference(seed):
    """One process: root's initial values, each rank's batch in turn, gradients summed."""
    net = build(seed)
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=None)
    learned = [p for p in params(net) if p.grad_req != "null"]
    for step in range(STEPS):
        total = None
        for r in range(size):
            backward(net, step, r)
            grads = [p.grad().copy() for p in learned]
            total = grads if total is None else [t + g for t, g in zip_exact(total, grads)]
        for p, t in zip_exact(learned, total):
            p.grad()[:] = t
        trainer.step(B * size)
        evaluate(net)
    return trained(net)


def phase_broadcast():
    net = build(seed=rank)
    before = digest([p.data() for p in params(net)])
    bps.broadcast_parameters(net.collect_params(), root_rank=0)
    evaluate(net)
    report({"phase": "broadcast", "before": before, "after": digest([p.data() for p in params(net)])})


def phase_allreduce(overlap, seed):
    net = build(seed=rank + seed)
    # The trainer broadcasts at its first step, after that step's backward: broadcasting
    # before it makes the first gradients root's, as in the reference.
    bps.broadcast_parameters(net.collect_params(), root_rank=0)
    evaluate(net)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", OPTIMIZER, mode="allreduce",
                                     overlap_backward=overlap)
    train(net, trainer, B)
    report({"phase": f"allreduce_overlap{int(overlap)}", "digest": digest(trained(net)),
            "mismatch": compare(trained(net), reference(seed)), "shared": in_shared_memory(net),
            "finite": all(np.isfinite(a.asnumpy()).all() for a in statistics(net))})


def phase_kvstore(seed):
    net = build(seed=rank + seed)
    bps.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=mx.kv.create("bpsgossip"))
    train(net, trainer, B * size)  # dist_sync semantics: the global batch size
    report({"phase": "kvstore", "digest": digest(trained(net)), "shared": in_shared_memory(net),
            "mismatch": compare(trained(net), reference(seed))})


def phase_gossip():
    net = build(seed=rank + 300)
    stats_before = [a.asnumpy() for a in statistics(net)]
    # overlap: a round arrives a step late, so two ranks are not exactly averaged by each round
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, overlap=True)
    train(net, trainer, B)
    moved = any(not np.array_equal(a.asnumpy(), b) for a, b in zip_exact(statistics(net), stats_before))
    # Learning rate 0 and one batch for all: the weights stay, the running statistics of every
    # rank move toward the same values, and mixing must draw the ranks together.
    trainer.set_learning_rate(0.0)
    distances = [trainer.consensus_distance()]
    for _ in range(3):
        backward(net, 0, 0)
        trainer.step(B)
        evaluate(net)
        distances.append(trainer.consensus_distance())
    finite = all(np.isfinite(p.data().asnumpy()).all() for p in params(net))
    trainer.average_parameters()
    report({"phase": "gossip", "distances": distances, "finite": finite, "statistics_moved": moved,
            "averaged": digest([p.data() for p in params(net)])})


def phase_compressed_allreduce():
    """BytePS's onebit recipe (scaling, error feedback, Nesterov momentum) on the host path."""
    net = build(seed=rank + 400)
    params_gc = {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov", "k": 1}
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", dict(OPTIMIZER), mode="allreduce",
                                     compression_params=params_gc)
    train(net, trainer, B)
    report({"phase": "compressed_allreduce", "digest": digest(trained(net)),
            "finite": all(np.isfinite(p.data().asnumpy()).all() for p in params(net))})


def phase_compressed_gossip():
    """The default mode with a compressor: CHOCO gossip of the parameters and BatchNorm statistics,
    dithering with 8 levels and the default consensus step, at learning rate 0 from the broadcast
    model with a little noise per rank. Inputs on the scale of raw pixels (x255) give the first
    BatchNorm running variances of ~1e4 beside weights of ~0.1: compressed as one buffer,
    resnet18_v1's distance went 0.044 -> 152 in 6 steps and mobilenet0.25's and bn_dropout's rose
    every step; each parameter compressed on its own, the statistics first follow the noise
    (about 1.7x) and every network turns down within 6 steps, the same numbers run after run.

    Training first at learning rate 0.01 on batches of 2 was no measure: gradients of 1e5 blow
    BatchNorm's scales up to ~300 on one rank, and mixing two such models moves the running
    variances by 25-75x now and then, compressed or not."""
    net = build(seed=rank + 500)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.0},
                                     compression_params={"compressor": "dithering", "k": 8})
    backward(net, 0, rank, PIXELS)
    trainer.step(B)  # broadcasts root's model
    evaluate(net)
    mx.random.seed(rank)
    for p in params(net):  # counted in the next step's displacement
        p.set_data(p.data() + mx.nd.random.uniform(-0.01, 0.01, p.shape))
    distances = []
    for _ in range(6):
        backward(net, 0, 0, PIXELS)
        trainer.step(B)
        evaluate(net)
        distances.append(trainer.consensus_distance())
    finite = all(np.isfinite(p.data().asnumpy()).all() for p in params(net))
    trainer.average_parameters()
    report({"phase": "compressed_gossip", "mode": trainer.mode, "distances": distances, "finite": finite,
            "averaged": digest([p.data() for p in params(net)])})


def module_symbol():
    data = mx.sym.Variable("data")
    conv = mx.sym.Convolution(data, kernel=(3, 3), num_filter=8, name="conv1")
    pool = mx.sym.Pooling(mx.sym.Activation(conv, act_type="relu"), kernel=(2, 2), stride=(2, 2),
                          pool_type="max")
    conv2 = mx.sym.Convolution(pool, kernel=(3, 3), num_filter=8, num_group=8, name="conv2")
    flat = mx.sym.Flatten(mx.sym.Activation(conv2, act_type="relu"))
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(flat, num_hidden=CLASSES, name="fc"), name="softmax")


def module_train(data, labels, batch_size, optimizer, arg_params, seed=None):
    """Module training with an inference forward before every update (oneDNN weights)."""
    module = mx.mod.Module(module_symbol(), context=mx.cpu())
    module.bind(data_shapes=[("data", (batch_size, 3, 32, 32))], label_shapes=[("softmax_label", (batch_size,))])
    if seed is not None:
        mx.random.seed(seed)
        module.init_params(mx.init.Xavier())
        arg_params = module.get_params()[0]
        module.forward(mx.io.DataBatch([mx.nd.array(data[0])]), is_train=False)
        bps.broadcast_parameters(arg_params, root_rank=0)
        arg_params = {k: v.copy() for k, v in arg_params.items()}  # Module's own dict changes later
    module.init_params(arg_params=arg_params, aux_params={}, force_init=True)
    module.init_optimizer(optimizer=optimizer)
    for step in range(STEPS):
        batch = mx.io.DataBatch([mx.nd.array(data[step])], [mx.nd.array(labels[step])])
        module.forward(batch, is_train=False)
        module.forward_backward(batch)
        module.update()
    return arg_params, [module.get_params()[0][k] for k in sorted(module.get_params()[0])]


def phase_module():
    def sgd(batch_size):
        return mx.optimizer.SGD(rescale_grad=1.0 / batch_size, **OPTIMIZER)

    initial, final = module_train(X[:, rank], Y[:, rank], B, bps.DistributedOptimizer(sgd(B)), None, seed=rank + 400)
    merged = X.reshape(STEPS, size * B, 3, 32, 32), Y.reshape(STEPS, size * B)
    _, ref = module_train(*merged, size * B, sgd(size * B), initial)
    report({"phase": "module", "digest": digest(final), "mismatch": compare(final, ref)})


def phase_elastic_state():
    net = build(seed=rank + 500)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", OPTIMIZER, mode="allreduce")
    train(net, trainer, B, steps=1)  # momentum states exist
    mx.random.seed(rank)  # ranks now differ: local noise on every parameter
    for p in params(net):
        p.set_data(p.data() + mx.nd.random.uniform(-0.01, 0.01, p.shape))
    evaluate(net)
    state = elastic.GluonState(net, trainer, epoch=rank)
    state.sync()
    synced = digest([p.data() for p in params(net)])
    train(net, trainer, B, steps=1)
    evaluate(net)
    state.restore()
    restored = digest([p.data() for p in params(net)])
    path = os.path.join(tempfile.mkdtemp(), "trainer.states")
    trainer.save_states(path)
    trainer.load_states(path)
    train(net, trainer, B, steps=1)
    report({"phase": "elastic_state", "synced": synced, "restored": restored, "epoch": state.epoch,
            "finite": all(np.isfinite(p.data().asnumpy()).all() for p in params(net))})


PHASES = [phase_broadcast, lambda: phase_allreduce(True, 100), lambda: phase_allreduce(False, 200),
          lambda: phase_kvstore(250), phase_gossip, phase_compressed_allreduce, phase_compressed_gossip,
          phase_module, phase_elastic_state]
for phase in PHASES:
    started = time.perf_counter()
    phase()
    print(f"phase {PHASES.index(phase)} took {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
bps.shutdown()
