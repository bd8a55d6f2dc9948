"""MXNet's gradient compression API on the 'bpsgossip' store (tests/clusters/test_mxnet_gradient_compression.py).

- ``kv STORE TYPE THRESHOLD``: kv.set_gradient_compression, init, then push/pull of known vectors
  for a few steps; run on our store and on MXNet's own dist_sync, the pulled sums must agree.
- ``trainer`` / ``module`` / ``distributed``: gluon.Trainer(kvstore='bpsgossip', compression_params=...),
  Module(compression_params=...) and DistributedTrainer train; every rank gathers every rank's raw gradients
  (uncompressed, gather_rows) and checks that the summed gradient it got is MXNet's 2bit sum
  computed by hand (residual carried), and that the server received 2 bits a value.
- ``errors``: bad settings and what is not supported, refused on every rank.
"""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet_job_helpers import check, failures, raises, symbol

import bps_gossip as core
import mxnet_plugin as bps

STEPS, THRESHOLD, BATCH = 3, 0.05, 8


def mxnet_2bit(residual, grad, threshold):
    """MXNet's quantize_2bit for one worker, by hand: what it sends, and its new residual (float32)."""
    t = np.float32(threshold)
    r = (residual + grad).astype(np.float32)
    sent = np.where(r >= t, t, np.where(r <= -t, -t, np.float32(0))).astype(np.float32)
    return sent, (r - sent).astype(np.float32)


def vectors(rank, step, sizes):
    """Rank's pushes at ``step``: normal values around the threshold."""
    rng = np.random.default_rng([rank, step, 7])
    return [(rng.normal(size=n) * 0.4).astype(np.float32) for n in sizes]


def kv(store, kind, threshold):
    """push/pull of two keys (37 and 1000 values) for STEPS steps; reports the pulled sums."""
    sizes = (37, 1000)
    store = mx.kv.create(store)
    try:
        store.set_gradient_compression({"type": kind, "threshold": float(threshold)})
    except mx.base.MXNetError as exc:
        report({"rank": store.rank, "refused": str(exc)})
        return
    for key, n in enumerate(sizes):
        store.init(key, mx.nd.zeros(n))
    pulled = []
    for step in range(STEPS):
        outs = [mx.nd.zeros(n) for n in sizes]
        for key, value in enumerate(vectors(store.rank, step, sizes)):
            store.push(key, mx.nd.array(value))
        for key, out in enumerate(outs):
            store.pull(key, out=out)
        pulled.append([out.asnumpy().tolist() for out in outs])
    report({"rank": store.rank, "pulled": pulled})


def _net():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(40, in_units=10, activation="relu"), mx.gluon.nn.Dense(3, in_units=40))
    net.initialize(mx.init.Xavier())
    return net


def _batch(rank, step):
    rng = np.random.default_rng([rank, step])
    return mx.nd.array(rng.normal(size=(BATCH, 10))), mx.nd.array(rng.integers(0, 3, BATCH))


class Expected:
    """Every rank's residual per parameter, and the check of one step's summed gradients."""

    def __init__(self, names, rank, size, threshold=THRESHOLD):
        self.residual = {(r, n): 0 for r in range(size) for n in names}
        self.rank, self.size, self.threshold, self.quantized = rank, size, threshold, 0

    def check(self, label, names, raw, summed):
        for name in names:
            rows = core.gather_rows(raw[name].reshape(-1), f"raw.{label}.{name}")  # every rank's raw gradient
            total = np.zeros(rows.shape[1], np.float32)
            for r in range(self.size):
                sent, self.residual[r, name] = mxnet_2bit(self.residual[r, name], rows[r], self.threshold)
                total += sent
            self.quantized += int(np.count_nonzero(total))
            got = summed[name].reshape(-1)
            check(f"{label} {name}", np.array_equal(got, total), f"max diff {np.abs(got - total).max()}")


def _compressed_bytes(sizes, workers):
    """What the servers receive for one step: 2 bits a value, padded to 4-byte words, per worker."""
    return workers * sum(4 * math.ceil(n / 16) for n in sizes)


def _socket_bytes():
    """Payload bytes the servers received so far, read while every rank waits between two barriers
    (so that no rank's push is in flight)."""
    core.barrier()
    received = sum(s["socket_bytes"] for s in core.server_stats())
    core.barrier()
    return received


def trainer():
    bps.init()
    mx.random.seed(3)
    net = _net()
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="bpsgossip",
                               compression_params={"type": "2bit", "threshold": THRESHOLD})
    params = net.collect_params()
    names = sorted(params)
    expected = Expected(names, bps.rank(), bps.size())
    step_bytes = []
    for step in range(STEPS):
        data, label = _batch(bps.rank(), step)
        with mx.autograd.record():
            loss = mx.gluon.loss.SoftmaxCrossEntropyLoss()(net(data), label)
        loss.backward()
        raw = {n: params[n].grad().asnumpy().copy() for n in names}
        before = _socket_bytes() if step else None
        trainer.step(BATCH * bps.size())
        if before is not None:
            step_bytes.append(_socket_bytes() - before)
        expected.check(f"step {step}", names, raw, {n: params[n].grad().asnumpy() for n in names})
    sizes = [params[n].data().size for n in names]
    store = trainer._kvstore
    report({"rank": bps.rank(), "failures": failures, "quantized": expected.quantized, "store": type(store).__name__,
            "compression": store.gradient_compression.describe(), "step_bytes": step_bytes,
            "compressed": _compressed_bytes(sizes, bps.size()), "float32": bps.size() * 4 * sum(sizes)})
    bps.shutdown()


def distributed():
    """DistributedTrainer with MXNet's dict: allreduce, gradients divided by batch x workers first
    (as for BytePS's compressors), then MXNet's 2bit with its residual."""
    bps.init()
    mx.random.seed(3)
    net = _net()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     compression_params={"type": "2bit", "threshold": THRESHOLD / 10})
    params = net.collect_params()
    names = sorted(params)
    expected = Expected(names, bps.rank(), bps.size(), THRESHOLD / 10)
    scale = np.float32(BATCH * bps.size())
    for step in range(STEPS):
        data, label = _batch(bps.rank(), step)
        with mx.autograd.record():
            loss = mx.gluon.loss.SoftmaxCrossEntropyLoss()(net(data), label)
        loss.backward()
        raw = {n: params[n].grad().asnumpy() / scale for n in names}
        trainer.step(BATCH)
        expected.check(f"step {step}", names, raw, {n: params[n].grad().asnumpy() for n in names})
    report({"rank": bps.rank(), "failures": failures, "quantized": expected.quantized, "mode": trainer.mode})
    bps.shutdown()


def module():
    bps.init()
    mod = mx.mod.Module(symbol(), context=mx.cpu(), compression_params={"type": "2bit", "threshold": THRESHOLD})
    mod.bind(data_shapes=[("data", (BATCH, 10))], label_shapes=[("softmax_label", (BATCH,))])
    mx.random.seed(3)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore="bpsgossip", optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    names = list(mod._exec_group.param_names)
    grads = dict(zip(names, mod._exec_group.grad_arrays))
    expected = Expected(names, bps.rank(), bps.size())
    for step in range(STEPS):
        data, label = _batch(bps.rank(), step)
        mod.forward_backward(mx.io.DataBatch([data], [label]))
        raw = {n: grads[n][0].asnumpy().copy() for n in names}
        mod.update()
        expected.check(f"step {step}", names, raw, {n: grads[n][0].asnumpy() for n in names})
    report({"rank": bps.rank(), "failures": failures, "quantized": expected.quantized,
            "store": type(mod._kvstore).__name__,
            "compression": mod._kvstore.gradient_compression.describe()})
    bps.shutdown()


def _bad_compression(bps):
    store = mx.kv.create("bpsgossip")
    for params, exc, text in (
            ({"type": "3bit", "threshold": 0.5}, ValueError, "'3bit' is not a type of gradient compression"),
            ({"threshold": 0.5}, ValueError, "has no 'type'"),
            ({"type": "2bit", "threshold": -0.5}, ValueError, "must be greater than 0"),
            ({"type": "2bit", "threshold": 0}, ValueError, "must be greater than 0"),
            ({"type": "2bit", "threshold": float("nan")}, ValueError, "finite"),
            ({"type": "1bit", "threshold": float("inf")}, ValueError, "finite"),
            ({"type": "2bit", "threshold": "half"}, TypeError, "must be a number"),
            ({"type": "2bit", "threshold": None}, TypeError, "must be a number"),
            ({"type": "2bit", "treshold": 0.5}, ValueError, "unknown key 'treshold' (did you mean 'threshold'?)"),
            ("2bit", TypeError, "must be a dict")):
        name, message = raises(Exception, store.set_gradient_compression, params)
        check(f"set_gradient_compression({params!r})", name == exc.__name__ and text in message, (name, message))
    net = _net()
    name, message = raises(Exception, mx.gluon.Trainer, net.collect_params(), "sgd", kvstore="bpsgossip",
                           compression_params={"type": "2bit", "threshold": -1})
    check("gluon.Trainer bad threshold at construction", name == "ValueError" and "greater than 0" in message,
          (name, message))
    name, message = raises(Exception, bps.DistributedTrainer, net.collect_params(), "sgd",
                           compression_params={"type": "2bit", "threshold": "x"}, mode="allreduce")
    check("DistributedTrainer bad threshold", name == "TypeError" and "must be a number" in message, (name, message))
    name, message = raises(Exception, bps.DistributedTrainer, net.collect_params(), "sgd",
                           compression_params={"type": "2bit"}, mode="gossip")
    check("DistributedTrainer 2bit in gossip mode", name == "ValueError" and "mode='allreduce'" in message,
          (name, message))


def _unsupported(bps):
    net = _net()
    for kvstore in ("bpsgossip", mx.kv.create("bpsgossip")):
        name, message = raises(Exception, mx.gluon.Trainer, net.collect_params(), "sgd", kvstore=kvstore,
                               update_on_kvstore=True)
        check(f"update_on_kvstore=True ({kvstore})", name == "ValueError" and "update_on_kvstore=False" in message,
              (name, message))
    name, message = raises(Exception, bps.DistributedTrainer, net.collect_params(), "sgd", update_on_kvstore=True)
    check("DistributedTrainer update_on_kvstore=True", name == "ValueError" and "update_on_kvstore=False" in message,
          (name, message))
    embedding = mx.gluon.nn.Embedding(20, 4, sparse_grad=True)
    embedding.initialize()
    for make in (lambda: mx.gluon.Trainer(embedding.collect_params(), "sgd", kvstore="bpsgossip"),
                 lambda: bps.DistributedTrainer(embedding.collect_params(), "sgd", mode="allreduce"),
                 lambda: bps.DistributedTrainer(embedding.collect_params(), "sgd")):
        name, message = raises(Exception, make)
        check("sparse_grad Embedding", name == "ValueError" and "sparse_grad=False" in message
              and "row_sparse" in message, (name, message))
    store = mx.kv.create("bpsgossip")
    for call, text in ((lambda: store.set_optimizer(mx.optimizer.SGD()), "do not give the optimizer to the store"),
                       (lambda: store.row_sparse_pull(0, out=mx.nd.zeros((2, 2)).tostype("row_sparse"),
                                                      row_ids=mx.nd.array([0])), "dense")):
        name, message = raises(Exception, call)
        check("store method", name == "NotImplementedError" and text in message, (name, message))
    name, message = raises(Exception, store.pushpull, "sparse", mx.nd.zeros((2, 2)).tostype("row_sparse"))
    check("row_sparse pushpull", name == "ValueError" and "dense" in message, (name, message))
    store.set_gradient_compression({"type": "2bit"})
    name, message = raises(Exception, store.pushpull, "f64", mx.nd.zeros(3, dtype="float64"))
    check("float64 compressed", name == "TypeError" and "float32" in message, (name, message))


def errors():
    bps.init()
    _bad_compression(bps)
    _unsupported(bps)
    report({"failures": failures, "rank": bps.rank()})
    bps.shutdown()


if __name__ == "__main__":
    run({"kv": kv, "trainer": trainer, "distributed": distributed, "module": module, "errors": errors})
