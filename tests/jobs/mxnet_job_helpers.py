"""What the mxnet_plugin jobs share (tests/jobs/mxnet_ops_job.py, mxnet_training_job.py,
mxnet_overlap_job.py, kvstore_fusion_job.py): check() records a failed expectation with its
label (every rank stays in step and the test reports all failures at once), digests of
arrays, and the small training problem every rank trains on its own data.
"""

from __future__ import annotations

import hashlib

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn

from bps_gossip.compat import zip_exact

failures: list[str] = []


def check(label, ok, detail=""):
    """Record ``label: detail`` unless ``ok``."""
    if not ok:
        failures.append(f"{label}: {detail}")


def digest(arrays):
    """sha256 over the raw bytes of NDArrays or numpy arrays, in the given order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update((a.asnumpy() if isinstance(a, mx.nd.NDArray) else np.asarray(a)).tobytes())
    return h.hexdigest()


def param_digest(params):
    """digest() of a ParameterDict's values."""
    return digest([p.data() for p in params.values()])


def raises(exc, fn, *args, **kwargs):
    """The name of what fn raised ("none" if nothing) and its message; "wrong: ..." unless an ``exc``."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        return type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - reported to the test as a wrong exception
        return "wrong: " + type(e).__name__, str(e)
    return "none", ""


# -- the training problem: per-step data of every rank, the same arrays on every rank --------
B, STEPS, F, C = 6, 5, 10, 4
OPTIMIZER = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
CPU = (mx.cpu(),)


def training_data(size):
    """X, Y: X[step, rank] is that rank's batch, X[step].reshape(-1, F) the concatenated batch."""
    rs_data = np.random.RandomState(7)
    x = rs_data.standard_normal((STEPS, size, B, F)).astype(np.float32)
    y = rs_data.randint(0, C, (STEPS, size, B)).astype(np.float32)
    return x, y


def build():
    """Two Dense layers, hybridized; weights deferred, biases zeros."""
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation="relu"), nn.Dense(C))
    net.hybridize()
    return net


def train(net, trainer, data, labels, batch_size, ctx=CPU, split_steps=()):
    """Each batch split over the devices in ``ctx``; at split_steps, allreduce_grads() + update()."""
    for step in range(STEPS):
        xs = gluon.utils.split_and_load(mx.nd.array(data[step]), list(ctx))
        ys = gluon.utils.split_and_load(mx.nd.array(labels[step]), list(ctx))
        with autograd.record():
            losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
        autograd.backward(losses)
        if step in split_steps:
            trainer.allreduce_grads()
            trainer.update(batch_size)
        else:
            trainer.step(batch_size)


def reference(initial, x, y):
    """One process, plain gluon.Trainer, the concatenated batch of all ranks at each step."""
    size = x.shape[1]
    net = build()
    net.initialize()
    net(mx.nd.array(x[0, 0]))
    for param, value in zip_exact(net.collect_params().values(), initial):
        param.set_data(mx.nd.array(value))
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=None)
    train(net, trainer, x.reshape(STEPS, size * B, F), y.reshape(STEPS, size * B), size * B)
    return [p.data().asnumpy() for p in net.collect_params().values()]


def weights(net):
    """The network's parameters as numpy arrays."""
    return [p.data().asnumpy() for p in net.collect_params().values()]


def symbol():
    """The Module API's network."""
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"), act_type="relu")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=C, name="fc2"), name="softmax")


def iterator(data, labels, batch_size):
    """The Module API's data: X[:, rank] for one rank, X for the reference run."""
    return mx.io.NDArrayIter(data.reshape(-1, F), labels.reshape(-1), batch_size=batch_size)


def sorted_values(params):
    """A dict's values in the order of its sorted keys."""
    return [params[k] for k in sorted(params)]
