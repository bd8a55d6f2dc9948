"""mxnet_plugin's collectives (tests/clusters/test_mxnet_ops.py): BytePS's own
tests/test_mxnet.py with real expected values for every worker count, broadcast_parameters
(dicts, ParameterDicts, deferred initialization) and the errors every rank must see.

One scenario makes every check (importing mxnet costs seconds); a check that fails is recorded
rather than raised, so that every rank stays in step. The sections run in this order on every rank.
"""

from __future__ import annotations

import itertools
import time

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet.gluon import nn
from mxnet_job_helpers import check, digest, failures, param_digest, raises

import bps_gossip
import mxnet_plugin as bps


def param_order(rank):
    """BytePS test_byteps_trainer_param_order: layers added in a rank-dependent order.

    Constants differ per rank (BytePS's are equal): the trainer must give each weight root's
    value of the SAME name, whatever order each rank built its network in."""
    layers = {"ones_": 1, "zeros_": 0}
    net = nn.Sequential()
    for name in sorted(layers, reverse=rank % 2 == 1):
        net.add(nn.Dense(10, in_units=10, weight_initializer=mx.init.Constant(layers[name] + 10 * rank),
                         use_bias=False, prefix=name))
    params = net.collect_params()
    net.initialize()
    trainer = bps.DistributedTrainer(params, "sgd")
    trainer._init_params()
    for name, init in layers.items():
        value = params[name + "weight"].data().asnumpy()
        check("param_order " + name, (value == init).all(), f"{value.ravel()[:3]} != {init}")


def seeded_push_pull(rank, size):
    """BytePS test_byteps_push_pull: rank-seeded tensors; the expected mean and sum come from
    regenerating every rank's tensor here."""
    with mx.util.np_shape(True):
        for i, shape in enumerate([(), (17,)]):
            def seeded(r, shape=shape):
                mx.random.seed(10 + 10 * r)
                return mx.nd.random.uniform(-100, 100, shape=shape)
            mine = seeded(rank)
            every = np.array([seeded(r).asnumpy().astype(np.float64) for r in range(size)])
            bps.byteps_declare_tensor(f"tensor_{i}")
            tensor = mine.copy()
            bps.byteps_push_pull(tensor, name=f"tensor_{i}")
            tensor.wait_to_read()
            got = tensor.asnumpy()
            check(f"push_pull mean {shape}", got.shape == shape and tensor.dtype == np.float32
                  and np.allclose(got, every.mean(axis=0), rtol=1e-6, atol=1e-5),
                  f"{got} vs {every.mean(axis=0)}")
            summed = mine.copy()
            bps.byteps_push_pull(summed, version=0, priority=0, name=f"tensor_sum_{i}", is_average=False)
            got = summed.asnumpy()
            check(f"push_pull sum {shape}", got.shape == shape
                  and np.allclose(got, every.sum(axis=0), rtol=1e-6, atol=1e-5),
                  f"{got} vs {every.sum(axis=0)}")


def partitioned_and_view(rank, size):
    """A tensor split into partitions (> BYTEPS_PARTITION_BYTES), and a view into a bigger array."""
    big = mx.nd.full((1100, 1000), rank + 1.0)
    bps.byteps_push_pull(big, name="big", is_average=False)
    check("partitioned sum", (big.asnumpy() == size * (size + 1) / 2).all())
    rows = mx.nd.zeros((3, 4))
    rows[1] = rank + 1.0
    view = rows[1]
    bps.byteps_push_pull(view, name="view", is_average=False)
    check("view written through", (rows.asnumpy()[1] == size * (size + 1) / 2).all()
          and (rows.asnumpy()[[0, 2]] == 0).all(), str(rows.asnumpy()))


def inplace_every_dtype(size):
    """BytePS test_byteps_push_pull_inplace: the same small-integer tensor on every rank; the sum
    is exactly size * tensor, the (default) mean exactly the tensor."""
    dtypes = ["int32", "int64", "float32", "float64", "float16", "uint8", "int8"]
    shapes = [(17,), (17, 17), (17, 17, 17)]
    bounds = {"uint8": (0, 60), "int8": (-40, 40)}  # size * value must fit the dtype
    rs = np.random.RandomState(1234)
    for dtype, shape in itertools.product(dtypes, shapes):
        low, high = bounds.get(dtype, (-100, 100))
        base = rs.randint(low, high + 1, size=shape)
        tensor = mx.nd.array(base, dtype=dtype)
        bps.byteps_push_pull(tensor, name=f"inplace_sum_{dtype}_{len(shape)}", is_average=False)
        got = tensor.asnumpy()
        check(f"inplace sum {dtype} {shape}", got.dtype == np.dtype(dtype)
              and np.array_equal(got, (base * size).astype(dtype)),
              f"max diff {np.abs(got - base * size).max()}")
        tensor = mx.nd.array(base, dtype=dtype)
        bps.byteps_push_pull(tensor, name=f"inplace_mean_{dtype}_{len(shape)}")
        got = tensor.asnumpy()
        check(f"inplace mean {dtype} {shape}",
              got.dtype == np.dtype(dtype) and np.array_equal(got, base.astype(dtype)),
              f"max diff {np.abs(got - base).max()}")


def broadcast_bits(rank, size):
    """broadcast / broadcast_: new array vs in place, bit-exact (NaN payload, -0.0); returns the payload."""
    special = (np.array([np.nan, -0.0, 1.5, -np.inf], dtype=np.float32)
               + np.float32(rank) * np.array([0, 0, 1, 0], np.float32))
    source = mx.nd.array(special, dtype="float32")
    result = bps.broadcast(source, root_rank=size - 1, name="bcast_new")
    check("broadcast leaves input", source.asnumpy().tobytes() == special.tobytes())
    root_special = special.copy()
    root_special[2] = np.float32(1.5 + size - 1)
    check("broadcast value", result.asnumpy().tobytes() == root_special.tobytes(), str(result.asnumpy()))
    same = bps.broadcast_(source, root_rank=size - 1, name="bcast_inplace")
    check("broadcast_ in place", same is source and source.asnumpy().tobytes() == root_special.tobytes())
    return special


def broadcast_dicts(rank, size, special):
    """broadcast_parameters on dicts of NDArrays, from root 0 and from root 1 (same names both
    times), inserted in a rank-dependent order: digests before and after, by root."""
    by_root = {}
    for root in sorted({0, min(1, size - 1)}):
        rs_dict = np.random.RandomState(100 + rank)
        values = {
            "w64": mx.nd.array(rs_dict.standard_normal((5, 3)), dtype="float64"),
            "w32": mx.nd.array(rs_dict.standard_normal((4,)), dtype="float32"),
            "h16": mx.nd.array(rs_dict.standard_normal((3, 2)), dtype="float16"),
            "i32": mx.nd.array(rs_dict.randint(-5, 5, (7,)), dtype="int32"),
            "u8": mx.nd.array(rs_dict.randint(0, 255, (6,)), dtype="uint8"),
            "odd": mx.nd.array(special, dtype="float32"),
        }
        if rank % 2:
            values = dict(reversed(list(values.items())))
        ordered = [values[k] for k in sorted(values)]
        before = digest(ordered)
        bps.broadcast_parameters(values, root_rank=root)
        by_root[str(root)] = {"before": before, "after": digest(ordered)}
    return by_root


def build_deferred(prefix, hybridize):
    """A network whose shapes are known only at the first forward (but its first layer's)."""
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(8, in_units=5, activation="relu", bias_initializer="uniform"),  # not deferred
                nn.Dense(6, activation="relu", bias_initializer="uniform"),  # deferred weight
                nn.BatchNorm(beta_initializer="uniform"),  # all deferred (in_channels unknown)
                nn.Dense(3, bias_initializer="uniform"))  # deferred weight
    if hybridize:
        net.hybridize()
    return net


def deferred_initialization(rank):
    """Shapes known only at the first forward, every rank seeded differently; broadcast_parameters
    is called before that forward. Digests of the values and of root's, by hybridize."""
    x = mx.nd.array(np.linspace(-1, 1, 10).reshape(2, 5))
    views = {}
    for hybridize in (False, True):
        mx.random.seed(rank)
        dnet = build_deferred(f"deferred{int(hybridize)}_", hybridize)
        dnet.initialize(mx.init.Uniform(1.0))
        dparams = dnet.collect_params()
        deferred = sorted(n for n, p in dparams.items() if p._data is None)
        check(f"deferred mix {hybridize}", 0 < len(deferred) < len(list(dparams.keys())), str(deferred))
        bps.broadcast_parameters(dparams, root_rank=0)
        y = dnet(x)
        # root's values: rebuild the network locally with root's seed and the same draws
        mx.random.seed(0)
        ref = build_deferred(f"reference{int(hybridize)}_", hybridize)
        ref.initialize(mx.init.Uniform(1.0))
        ref_y = ref(x)
        views[str(hybridize)] = {"params": param_digest(dparams), "output": digest([y]),
                                 "root_params": param_digest(ref.collect_params()),
                                 "root_output": digest([ref_y])}
        # the hook is gone: a later re-initialization is local (no collective, no hang)
        dnet.initialize(mx.init.Constant(rank), force_reinit=True)
        # (weights only: the biases' own bias_initializer takes precedence over Constant)
        check(f"deferred reinit local {hybridize}",
              all((p.data() == rank).asnumpy().all() for n, p in dparams.items() if n.endswith("weight")))
    return views


def broadcast_before_initialize(rank):
    """Gluon initializes even fully known shapes through the deferred path, so the values are
    root's right after initialize()."""
    mx.random.seed(rank)
    early = nn.Dense(3, in_units=4, prefix="early_", bias_initializer="uniform")
    bps.broadcast_parameters(early.collect_params(), root_rank=0)
    early.initialize(mx.init.Uniform(1.0))
    mx.random.seed(0)
    early_ref = nn.Dense(3, in_units=4, prefix="early_ref_", bias_initializer="uniform")
    early_ref.initialize(mx.init.Uniform(1.0))
    check("broadcast before initialize",
          param_digest(early.collect_params()) == param_digest(early_ref.collect_params()))


def bad_roots(size, pnet):
    """Bad root ranks: ValueError on every rank, before any communication."""
    for bad in (size, -1, "0", 0.0, True):
        kind, msg = raises(ValueError, bps.broadcast_parameters, {"bad": mx.nd.ones(2)}, root_rank=bad)
        check(f"bad root {bad!r}", kind == "ValueError" and "root_rank" in msg, f"{kind} {msg}")
    kind, msg = raises(ValueError, bps.broadcast_parameters, pnet.collect_params(), root_rank=size)
    check("bad root ParameterDict", kind == "ValueError", f"{kind} {msg}")
    kind, msg = raises(ValueError, bps.broadcast, mx.nd.ones(2), root_rank=size, name="bad_root")
    check("bad root broadcast", kind == "ValueError", f"{kind} {msg}")
    kind, msg = raises(ValueError, bps.DistributedTrainer, pnet.collect_params(), "sgd", root_rank=size)
    check("bad root trainer", kind == "ValueError", f"{kind} {msg}")


def ordered_with_the_engine(rank, size):
    """A small tensor goes from this thread once MXNet's engine is done with it: queued writes land
    before the push_pull, queued reads see the value from before it, in both sizes' paths."""
    for count in (16, 40000):  # 64 B (this thread) and 160 KB (an operation in MXNet's engine)
        x = mx.nd.ones(count)
        x *= rank + 1  # queued write
        before = x * 10  # queued read
        bps.byteps_push_pull(x, name=f"ordered{count}", is_average=False)
        after = x + 0  # read after
        total = sum(range(1, size + 1))
        check(f"ordered {count}: queued write summed", (x.asnumpy() == total).all(), str(x.asnumpy()[:3]))
        check(f"ordered {count}: queued read saw the value before", (before.asnumpy() == 10 * (rank + 1)).all(),
              str(before.asnumpy()[:3]))
        check(f"ordered {count}: read after saw the sum", (after.asnumpy() == total).all(),
              str(after.asnumpy()[:3]))


def wrong_arguments():
    """ValueError for a missing name, TypeError for a non-NDArray."""
    for bad_name in (None, ""):
        kind, msg = raises(ValueError, bps.byteps_push_pull, mx.nd.ones(3), name=bad_name)
        check(f"name {bad_name!r}", kind == "ValueError" and "name" in msg, f"{kind} {msg}")
    kind, msg = raises(ValueError, bps.byteps_declare_tensor, None)
    check("declare None", kind == "ValueError", f"{kind} {msg}")
    for bad_tensor in (np.ones(3, np.float32), [1.0, 2.0], 3.0):
        kind, msg = raises(TypeError, bps.byteps_push_pull, bad_tensor, name="not_an_ndarray")
        check(f"tensor {type(bad_tensor).__name__}", kind == "TypeError", f"{kind} {msg}")
    kind, msg = raises(TypeError, bps.broadcast_parameters, {"bad": np.ones(2)})
    check("dict of numpy", kind == "TypeError", f"{kind} {msg}")


def shape_mismatch(rank, size):
    """Different shapes under one name: TensorMismatchError on every rank, quickly; [kind, message, seconds]."""
    start = time.monotonic()
    kind, msg = raises(bps_gossip.TensorMismatchError, bps.byteps_push_pull,
                       mx.nd.ones((3,) if rank == 0 else (4,)), name="mismatch")
    seen = [kind, msg, time.monotonic() - start]
    # the job goes on after the error; and nobody leaves before a slow rank got it too
    probe = mx.nd.ones(2)
    bps.byteps_push_pull(probe, name="after_mismatch", is_average=False)
    check("push_pull after mismatch", (probe.asnumpy() == size).all(), str(probe.asnumpy()))
    bps_gossip.barrier()
    return seen


def ops() -> None:
    """Every check of the collectives; reports digests to compare across ranks and the failures."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    out = {"rank": rank, "size": size}
    param_order(rank)
    seeded_push_pull(rank, size)
    partitioned_and_view(rank, size)
    inplace_every_dtype(size)
    special = broadcast_bits(rank, size)
    out["dict"] = broadcast_dicts(rank, size, special)
    # broadcast_parameters on an initialized Gluon ParameterDict, from the last rank
    mx.random.seed(rank)
    pnet = nn.Dense(4, in_units=3, prefix="pdict_", bias_initializer="uniform")
    pnet.initialize(mx.init.Uniform(1.0))
    before = param_digest(pnet.collect_params())
    bps.broadcast_parameters(pnet.collect_params(), root_rank=size - 1)
    out["pdict"] = {"before": before, "after": param_digest(pnet.collect_params())}
    out["deferred"] = deferred_initialization(rank)
    broadcast_before_initialize(rank)
    bad_roots(size, pnet)
    ordered_with_the_engine(rank, size)
    wrong_arguments()
    if size > 1:
        out["mismatch"] = shape_mismatch(rank, size)
    out["failures"] = failures
    report(out)
    bps.shutdown()


if __name__ == "__main__":
    run({"ops": ops})
