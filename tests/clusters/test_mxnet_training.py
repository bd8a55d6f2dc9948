"""Training through mxnet_plugin on real processes: every rank trains on different data,
and every rank must end with exactly the same weights, equal (to float tolerance) to one
process training on the concatenated batches. Covers DistributedTrainer in allreduce
mode, DistributedOptimizer under the Module API and gluon.Trainer with
kvstore='bpsgossip'.
"""

from __future__ import annotations

import numpy as np
import pytest
from cluster import assert_all_ok
from test_mxnet_ops import HELPERS

from bps_gossip.compat import zip_exact

# Per-step data of every rank, the same arrays on every rank: X[step, rank] is that
# rank's batch, X[step].reshape(-1, F) the concatenated batch of the reference run.
DATA = """
B, STEPS, F, C = 6, 5, 10, 4
rs_data = np.random.RandomState(7)
X = rs_data.standard_normal((STEPS, size, B, F)).astype(np.float32)
Y = rs_data.randint(0, C, (STEPS, size, B)).astype(np.float32)
OPTIMIZER = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}

from mxnet import autograd, gluon
from mxnet.gluon import nn
from bps_gossip.compat import zip_exact
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

def build():
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation="relu"), nn.Dense(C))  # weights deferred; biases zeros
    net.hybridize()
    return net

def train(net, trainer, data, labels, batch_size, ctx=(mx.cpu(),), split_steps=()):
    # each batch split over the devices in ``ctx``; at split_steps, allreduce_grads() + update()
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

def reference(initial):
    # one process, plain gluon.Trainer, the concatenated batch of all ranks at each step
    net = build()
    net.initialize()
    net(mx.nd.array(X[0, 0]))
    for param, value in zip_exact(net.collect_params().values(), initial):
        param.set_data(mx.nd.array(value))
    trainer = gluon.Trainer(net.collect_params(), "sgd", OPTIMIZER, kvstore=None)
    train(net, trainer, X.reshape(STEPS, size * B, F), Y.reshape(STEPS, size * B), size * B)
    return [p.data().asnumpy() for p in net.collect_params().values()]

def weights(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]

# the Module API's network and data: X[:, rank] for one rank, X for the reference run
def symbol():
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"), act_type="relu")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=C, name="fc2"), name="softmax")

def iterator(data, labels, batch_size):
    return mx.io.NDArrayIter(data.reshape(-1, F), labels.reshape(-1), batch_size=batch_size)

def sorted_values(params):
    return [params[k] for k in sorted(params)]
"""


def assert_same_training(results: list[dict], key: str = "final") -> None:
    """Every rank holds bit-identical weights, close to the single-process reference."""
    assert len({r[key + "_digest"] for r in results}) == 1, f"ranks differ after training ({key})"
    reference = [np.array(w) for w in results[0]["reference"]]
    for r in results:
        for got, want in zip_exact(r[key], reference):
            np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


ALLREDUCE_SNIPPET = HELPERS + """
import mxnet_plugin as bps
bps.init()
rank, size = bps.rank(), bps.size()
""" + DATA + """
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
        "final": [w.tolist() for w in final], "reference": [w.tolist() for w in reference(initial)],
        "failures": failures})
bps.shutdown()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [2, 4])
def test_distributed_trainer_allreduce_matches_one_process(cluster, workers):
    job = cluster(workers)
    done = job.run_workers(ALLREDUCE_SNIPPET, timeout=140)
    assert_all_ok(done, job)
    results = sorted((f.result for f in done), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(workers))
    assert all(not r["failures"] for r in results), [r["failures"] for r in results]
    assert len({r["initial_digest"] for r in results}) == 1, "deferred parameters were not broadcast"
    assert_same_training(results)
    job.wait_servers_exit()


MODULE_SNIPPET = HELPERS + """
import pickle
import mxnet_plugin as bps
bps.init()
rank, size = bps.rank(), bps.size()
""" + DATA + """
def sgd(batch_size):
    # SoftmaxOutput's gradient is summed over the batch: rescale by the module's batch size
    return mx.optimizer.SGD(rescale_grad=1.0 / batch_size, multi_precision=True, **OPTIMIZER)

class Counting(bps.DistributedOptimizer):
    # counts the calls Module's updater makes (attributes set on the wrapper go to the wrapped optimizer)
    calls = 0

    def update_multi_precision(self, index, weight, grad, state):
        type(self).calls += 1
        super().update_multi_precision(index, weight, grad, state)

# rank-seeded initialization, then root's values everywhere (the BytePS Module recipe)
module = mx.mod.Module(symbol(), context=mx.cpu())
train_iter = iterator(X[:, rank], Y[:, rank], B)
module.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
mx.random.seed(rank)
module.init_params(mx.init.Uniform(0.5))
arg_params, aux_params = module.get_params()
out = {"rank": rank, "before_digest": digest(sorted_values(arg_params))}
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
multi.fit(iterator(X[:, rank], Y[:, rank], B), num_epoch=1, arg_params=initial, aux_params={}, force_init=True,
          optimizer=bps.DistributedOptimizer(sgd(B)))
check("multi-device module updates on a local kvstore", multi._update_on_kvstore and multi._kvstore.type == "local")
multi_final = multi.get_params()[0]
out["multi_digest"] = digest(sorted_values(multi_final))
out["multi"] = [v.asnumpy().tolist() for v in sorted_values(multi_final)]

# optimizer states with the optimizer in them (Module checkpoints, gluon save_states)
updater = module._updater
kind, msg = raises(Exception, lambda: updater.set_states(updater.get_states(dump_optimizer=True)))
check("updater states round trip", kind == "none", f"{kind} {msg}")
check("wrapper survives pickling", isinstance(updater.optimizer, bps.DistributedOptimizer)
      and updater.optimizer.learning_rate == OPTIMIZER["learning_rate"], repr(updater.optimizer))

# float16 weights with an fp32 master copy, and aggregated (list) updates
opt = bps.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, multi_precision=True))
fp16_updater = mx.optimizer.get_updater(opt)
ref_updater = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, multi_precision=True))
start = [np.linspace(-1, 1, 12, dtype=np.float16).reshape(3, 4), np.arange(5, dtype=np.float16)]
w16 = [mx.nd.array(s, dtype="float16") for s in start]
ref_w16 = [mx.nd.array(s, dtype="float16") for s in start]
for step in range(3):
    every = [[np.random.RandomState(50 + 10 * r + step).uniform(-1, 1, s.shape).astype(np.float16) for s in start]
             for r in range(size)]
    grads = [mx.nd.array(g, dtype="float16") for g in every[rank]]
    fp16_updater([0, 1], grads, w16)
    mean = [(sum(e[i] for e in every) / np.float16(size)).astype(np.float16) for i in range(len(start))]
    ref_updater([0, 1], [mx.nd.array(m, dtype="float16") for m in mean], ref_w16)
check("fp16 master copy", all(isinstance(s, tuple) and s[1].dtype == np.float32
                              for s in fp16_updater.states.values()), str(fp16_updater.states))
out["fp16_digest"] = digest(w16)
check("fp16 update", all(w.dtype == np.float16 and np.allclose(w.asnumpy(), r.asnumpy(), atol=1e-3)
                         for w, r in zip(w16, ref_w16)), f"{[w.asnumpy() for w in w16]} vs {[r.asnumpy() for r in ref_w16]}")

# a DistributedOptimizer inside gluon.Trainer (Horovod style): save_states and load_states
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
import os, tempfile
states = os.path.join(tempfile.mkdtemp(), "trainer.states")
kind, msg = raises(Exception, gtrainer.save_states, states)
check("gluon save_states", kind == "none", f"{kind} {msg}")
if kind == "none":
    kind, msg = raises(Exception, gtrainer.load_states, states)
    check("gluon load_states", kind == "none" and isinstance(gtrainer._optimizer, bps.DistributedOptimizer),
          f"{kind} {msg}")

out["failures"] = failures
report(out)
bps.shutdown()
"""


@pytest.mark.timeout(120)
def test_distributed_optimizer_module_api(cluster):
    job = cluster(2)
    done = job.run_workers(MODULE_SNIPPET, timeout=110)
    assert_all_ok(done, job)
    results = sorted((f.result for f in done), key=lambda r: r["rank"])
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    assert results[0]["before_digest"] != results[1]["before_digest"]  # ranks really started apart
    assert len({r["initial_digest"] for r in results}) == 1
    assert results[0]["initial_digest"] == results[0]["before_digest"]  # root's values
    assert len({r["fp16_digest"] for r in results}) == 1
    assert_same_training(results)
    assert_same_training(results, "multi")
    job.wait_servers_exit()


KVSTORE_SNIPPET = HELPERS + """
import mxnet_plugin as bps
bps.init()
rank, size = bps.rank(), bps.size()
""" + DATA + """
out = {"rank": rank}
kv = mx.kv.create("bpsgossip")
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

# gluon.Trainer(kvstore='bpsgossip'): dist_sync semantics, so step(global batch size)
def kv_training(kvstore, seed_offset):
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

initial, final = kv_training("bpsgossip", 0)
out.update(final_digest=digest(final), final=[w.tolist() for w in final],
           reference=[w.tolist() for w in reference(initial)])
# the same run with an instance (always worked, also without our _create_kvstore hook)
initial2, final2 = kv_training(mx.kv.create("bpsgossip"), 100)
out.update(instance_digest=digest(final2), instance=[w.tolist() for w in final2],
           instance_reference=[w.tolist() for w in reference(initial2)])

# Module(kvstore='bpsgossip'), dist_sync style: rank-seeded weights become rank 0's, and
# Module itself rescales the summed gradients by 1 / (batch size x workers)
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

out["failures"] = failures
report(out)
bps.shutdown()
"""


@pytest.mark.timeout(120)
def test_gluon_trainer_with_bpsgossip_kvstore(cluster):
    job = cluster(2)
    done = job.run_workers(KVSTORE_SNIPPET, timeout=110)
    assert_all_ok(done, job)
    results = sorted((f.result for f in done), key=lambda r: r["rank"])
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    assert_same_training(results)
    for key in ("instance", "module"):
        for r in results:
            r["reference"] = r[key + "_reference"]
        assert_same_training(results, key)
    job.wait_servers_exit()
