"""Training through mxnet_plugin (tests/clusters/test_mxnet_training.py): every rank trains on
its own data and reports its weights and those of one process training on the concatenated
batches. DistributedTrainer in allreduce mode, DistributedOptimizer under the Module API and
gluon.Trainer with kvstore='bpsgossip'.
"""

from __future__ import annotations

import os
import tempfile

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet_job_helpers import (
    OPTIMIZER,
    STEPS,
    B,
    build,
    check,
    digest,
    failures,
    iterator,
    raises,
    reference,
    sorted_values,
    symbol,
    train,
    training_data,
    weights,
)

import mxnet_plugin as bps


def allreduce() -> None:
    """DistributedTrainer(mode='allreduce'), even ranks on two devices, steps 2 and 3 split."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    X, Y = training_data(size)
    ctx = [mx.cpu(0), mx.cpu(1)] if rank % 2 == 0 else [mx.cpu(0)]  # even ranks: two devices
    mx.random.seed(rank)  # different initial values: the trainer's broadcast must fix them
    net = build()
    net.initialize(mx.init.Xavier(), ctx=ctx)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", OPTIMIZER, mode="allreduce")
    check("mode", trainer.mode == "allreduce")
    net(mx.nd.array(X[0, rank]))  # deferred shapes become known: root's values arrive now
    initial = weights(net)
    # per-worker batch size (see the docstring); steps 2 and 3 as allreduce_grads() + update()
    train(net, trainer, X[:, rank], Y[:, rank], B, ctx=ctx, split_steps=(2, 3))
    final = weights(net)
    check("device copies equal", all(digest(p.list_data()[:1] * len(ctx)) == digest(p.list_data())
                                     for p in net.collect_params().values()))
    report({"rank": rank, "initial_digest": digest(initial), "final_digest": digest(final),
            "final": [w.tolist() for w in final], "reference": [w.tolist() for w in reference(initial, X, Y)],
            "failures": failures})
    bps.shutdown()


def sgd(batch_size):
    """SoftmaxOutput's gradient is summed over the batch: rescale by the module's batch size."""
    return mx.optimizer.SGD(rescale_grad=1.0 / batch_size, multi_precision=True, **OPTIMIZER)


class Counting(bps.DistributedOptimizer):
    """Counts the calls Module's updater makes (attributes set on the wrapper go to the wrapped
    optimizer). At module level: the updater's states pickle it."""

    calls = 0

    def update_multi_precision(self, index, weight, grad, state):
        type(self).calls += 1
        super().update_multi_precision(index, weight, grad, state)


def module_training(rank, size, X, Y, out):
    """Module.fit with a DistributedOptimizer, its one-process reference and a two-device run;
    returns the module."""
    # rank-seeded initialization, then root's values everywhere (the BytePS Module recipe)
    module = mx.mod.Module(symbol(), context=mx.cpu())
    train_iter = iterator(X[:, rank], Y[:, rank], B)
    module.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mx.random.seed(rank)
    module.init_params(mx.init.Uniform(0.5))
    arg_params, aux_params = module.get_params()
    out["before_digest"] = digest(sorted_values(arg_params))
    bps.broadcast_parameters(arg_params, root_rank=0)
    bps.broadcast_parameters(aux_params, root_rank=0)
    initial = {k: v.copy() for k, v in arg_params.items()}
    out["initial_digest"] = digest(sorted_values(initial))
    module.fit(train_iter, num_epoch=1, arg_params=arg_params, aux_params=aux_params, force_init=True,
               optimizer=Counting(sgd(B)))
    check("update_multi_precision called", Counting.calls >= STEPS, str(Counting.calls))
    final = module.get_params()[0]
    out["final_digest"] = digest(sorted_values(final))
    out["final"] = [v.asnumpy().tolist() for v in sorted_values(final)]

    # the same training in one process, plain SGD, concatenated batches
    ref = mx.mod.Module(symbol(), context=mx.cpu())
    ref.fit(iterator(X, Y, size * B), num_epoch=1, arg_params=initial, aux_params={}, force_init=True,
            optimizer=sgd(size * B))
    ref_params = ref.get_params()[0]
    out["reference"] = [v.asnumpy().tolist() for v in sorted_values(ref_params)]

    # two devices per rank: Module then updates inside a local KVStore, whose updater calls
    # the optimizer with parameter names for indices (and ignores exceptions raised there)
    multi = mx.mod.Module(symbol(), context=[mx.cpu(0), mx.cpu(1)])
    multi.fit(iterator(X[:, rank], Y[:, rank], B), num_epoch=1, arg_params=initial, aux_params={},
              force_init=True, optimizer=bps.DistributedOptimizer(sgd(B)))
    check("multi-device module updates on a local kvstore",
          multi._update_on_kvstore and multi._kvstore.type == "local")
    multi_final = multi.get_params()[0]
    out["multi_digest"] = digest(sorted_values(multi_final))
    out["multi"] = [v.asnumpy().tolist() for v in sorted_values(multi_final)]
    return module


def fp16_updates(rank, size, out):
    """float16 weights with an fp32 master copy, and aggregated (list) updates."""
    opt = bps.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, multi_precision=True))
    fp16_updater = mx.optimizer.get_updater(opt)
    ref_updater = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, multi_precision=True))
    start = [np.linspace(-1, 1, 12, dtype=np.float16).reshape(3, 4), np.arange(5, dtype=np.float16)]
    w16 = [mx.nd.array(s, dtype="float16") for s in start]
    ref_w16 = [mx.nd.array(s, dtype="float16") for s in start]
    for step in range(3):
        every = [[np.random.RandomState(50 + 10 * r + step).uniform(-1, 1, s.shape).astype(np.float16)
                  for s in start] for r in range(size)]
        grads = [mx.nd.array(g, dtype="float16") for g in every[rank]]
        fp16_updater([0, 1], grads, w16)
        mean = [(sum(e[i] for e in every) / np.float16(size)).astype(np.float16) for i in range(len(start))]
        ref_updater([0, 1], [mx.nd.array(m, dtype="float16") for m in mean], ref_w16)
    check("fp16 master copy", all(isinstance(s, tuple) and s[1].dtype == np.float32
                                  for s in fp16_updater.states.values()), str(fp16_updater.states))
    out["fp16_digest"] = digest(w16)
    check("fp16 update", all(w.dtype == np.float16 and np.allclose(w.asnumpy(), r.asnumpy(), atol=1e-3)
                             for w, r in zip(w16, ref_w16)),
          f"{[w.asnumpy() for w in w16]} vs {[r.asnumpy() for r in ref_w16]}")


def gluon_distributed_optimizer(rank, size):
    """A DistributedOptimizer inside gluon.Trainer (Horovod style): save_states and load_states."""
    gnet = nn.Dense(3, in_units=2, prefix="gopt_")
    gnet.initialize(mx.init.Constant(0.5))
    gtrainer = gluon.Trainer(gnet.collect_params(), bps.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1)),
                             kvstore=None)
    with autograd.record():
        gloss = gnet(mx.nd.full((1, 2), rank + 1.0)).sum()
    gloss.backward()
    gtrainer.step(1)
    check("gluon DistributedOptimizer averages", np.allclose(gnet.weight.data().asnumpy(),
                                                             0.5 - 0.1 * (size + 1) / 2), str(gnet.weight.data()))
    states = os.path.join(tempfile.mkdtemp(), "trainer.states")
    kind, msg = raises(Exception, gtrainer.save_states, states)
    check("gluon save_states", kind == "none", f"{kind} {msg}")
    if kind == "none":
        kind, msg = raises(Exception, gtrainer.load_states, states)
        check("gluon load_states", kind == "none" and isinstance(gtrainer._optimizer, bps.DistributedOptimizer),
              f"{kind} {msg}")


def module_api() -> None:
    """DistributedOptimizer under the Module API, its states, float16 and inside gluon.Trainer."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    X, Y = training_data(size)
    out = {"rank": rank}
    module = module_training(rank, size, X, Y, out)

    # optimizer states with the optimizer in them (Module checkpoints, gluon save_states)
    updater = module._updater
    kind, msg = raises(Exception, lambda: updater.set_states(updater.get_states(dump_optimizer=True)))
    check("updater states round trip", kind == "none", f"{kind} {msg}")
    check("wrapper survives pickling", isinstance(updater.optimizer, bps.DistributedOptimizer)
          and updater.optimizer.learning_rate == OPTIMIZER["learning_rate"], repr(updater.optimizer))

    fp16_updates(rank, size, out)
    gluon_distributed_optimizer(rank, size)
    out["failures"] = failures
    report(out)
    bps.shutdown()


def kvstore_calls(kv, rank, size):
    """Every call of the 'bpsgossip' KVStore on its own."""
    # the name it was created by, as MXNet's own tests and users' scripts compare it (issue 23, item 1);
    # Module's dist_sync rescaling still holds (the Module runs below check the sums and the steps)
    check("kv type", isinstance(kv, bps.BpsGossip) and kv.type == "bpsgossip", repr(kv))
    check("is_capable on the class", not type(kv).is_capable("optimizer") and type(kv).is_capable("pushpull"))
    check("kv rank", (kv.rank, kv.num_workers) == (rank, size), f"{kv.rank} {kv.num_workers}")
    check("kv no server optimizer", not kv.is_capable("optimizer") and kv.is_capable("pushpull"))
    total = size * (size + 1) / 2

    value = mx.nd.ones((2, 3)) * (rank + 1)
    result = mx.nd.zeros((2, 3))
    kv.pushpull("pp", value, out=result)
    check("pushpull out", (result.asnumpy() == total).all(), str(result))
    check("pushpull leaves input", (value.asnumpy() == rank + 1).all(), str(value))
    kv.pushpull("pp_inplace", value)
    check("pushpull in place", (value.asnumpy() == total).all(), str(value))
    pair = [mx.nd.full((3,), rank + 1.0), mx.nd.full((2, 2), 10.0 * (rank + 1), dtype="float64")]
    pair_out = [mx.nd.zeros((3,)), mx.nd.zeros((2, 2), dtype="float64")]
    kv.pushpull(["list_a", "list_b"], pair, out=pair_out)
    check("pushpull lists", (pair_out[0].asnumpy() == total).all() and (pair_out[1].asnumpy() == 10 * total).all()
          and pair_out[1].dtype == np.float64, str(pair_out))

    source = mx.nd.array(np.random.RandomState(rank).standard_normal(5), dtype="float64")
    root_value = np.random.RandomState(0).standard_normal(5)
    targets = [mx.nd.zeros(5, dtype="float64"), mx.nd.zeros(5, dtype="float64")]
    kv.broadcast("bc", source, out=targets)
    check("broadcast", all(t.asnumpy().tobytes() == root_value.tobytes() for t in targets), str(targets))
    check("broadcast leaves input", source.asnumpy().tobytes()
          == np.random.RandomState(rank).standard_normal(5).tobytes())
    kv.init("init", source)
    check("init", source.asnumpy().tobytes() == root_value.tobytes(), str(source))

    pushed = mx.nd.full((4,), rank + 1.0)
    pulled = mx.nd.zeros((4,))
    kv.push("push", pushed)
    kv.pull("push", out=pulled)
    check("push/pull", (pulled.asnumpy() == total).all() and (pushed.asnumpy() == rank + 1).all(), str(pulled))
    kind, msg = raises(ValueError, kv.pull, "never_pushed", out=pulled)
    check("pull without push", kind == "ValueError", f"{kind} {msg}")


def kv_training(kvstore, seed_offset, rank, size, X, Y):
    """gluon.Trainer(kvstore=...): dist_sync semantics, so step(global batch size); returns root's
    initial weights and the trained ones."""
    mx.random.seed(rank + seed_offset)
    net = build()
    net.initialize(mx.init.Xavier())
    bps.broadcast_parameters(net.collect_params(), root_rank=0)  # before the first forward
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=kvstore)
    # the first forward, inside autograd.record(), initializes the deferred weights: root's
    # values must arrive before they are used
    train(net, trainer, X[:, rank], Y[:, rank], size * B)
    check(f"trainer kvstore {kvstore!r}", isinstance(trainer._kvstore, bps.BpsGossip)
          and not trainer._update_on_kvstore, repr(trainer._kvstore))
    # root's initial values: the same draws with root's seed, here
    mx.random.seed(seed_offset)
    root = build()
    root.initialize(mx.init.Xavier())
    root(mx.nd.array(X[0, 0]))
    return weights(root), weights(net)


def kvstore_module(rank, size, X, Y, out):
    """Module(kvstore='bpsgossip'), dist_sync style: rank-seeded weights become rank 0's, and
    Module itself rescales the summed gradients by 1 / (batch size x workers)."""
    module = mx.mod.Module(symbol(), context=mx.cpu())
    train_iter = iterator(X[:, rank], Y[:, rank], B)
    module.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mx.random.seed(rank + 200)
    module.init_params(mx.init.Uniform(0.5))
    root_initial = {k: v.copy() for k, v in module.get_params()[0].items()}
    bps.broadcast_parameters(root_initial)  # only to know root's values for the reference
    module.fit(train_iter, num_epoch=1, kvstore="bpsgossip", optimizer="sgd", optimizer_params=OPTIMIZER)
    check("module rescale", abs(module._optimizer.rescale_grad - 1.0 / (size * B)) < 1e-12,
          str(module._optimizer.rescale_grad))
    final = module.get_params()[0]
    ref = mx.mod.Module(symbol(), context=mx.cpu())
    ref.fit(iterator(X, Y, size * B), num_epoch=1, arg_params=root_initial, aux_params={}, force_init=True,
            optimizer="sgd", optimizer_params=OPTIMIZER)
    out.update(module_digest=digest(sorted_values(final)),
               module=[v.asnumpy().tolist() for v in sorted_values(final)],
               module_reference=[v.asnumpy().tolist() for v in sorted_values(ref.get_params()[0])])


def kvstore() -> None:
    """The 'bpsgossip' KVStore's calls, gluon.Trainer on it (by name and instance) and Module on it."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    X, Y = training_data(size)
    out = {"rank": rank}
    kv = mx.kv.create("bpsgossip")
    kvstore_calls(kv, rank, size)

    initial, final = kv_training("bpsgossip", 0, rank, size, X, Y)
    out.update(final_digest=digest(final), final=[w.tolist() for w in final],
               reference=[w.tolist() for w in reference(initial, X, Y)])
    # the same run with an instance (always worked, also without our _create_kvstore hook)
    initial2, final2 = kv_training(mx.kv.create("bpsgossip"), 100, rank, size, X, Y)
    out.update(instance_digest=digest(final2), instance=[w.tolist() for w in final2],
               instance_reference=[w.tolist() for w in reference(initial2, X, Y)])

    kvstore_module(rank, size, X, Y, out)
    out["failures"] = failures
    report(out)
    bps.shutdown()


if __name__ == "__main__":
    run({"allreduce": allreduce, "module_api": module_api, "kvstore": kvstore})
