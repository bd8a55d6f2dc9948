"""Horovod's collectives on real processes (tests/clusters/test_horovod_collectives.py): allgather
with a first dimension that differs by rank, the errors every rank must see, objects across
ranks, and the grouped allreduce. Every rank computes every rank's inputs (they depend on the rank
only), so each checks its own results; a failed check is recorded, not raised, to keep the
ranks in step.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet_job_helpers import check, failures, raises

import bps_gossip as core
import mxnet_plugin as bps


def rows_of(rank, dtype=np.float32, width=(2, 3)):
    """Rank ``rank``'s tensor: rank + 1 rows (rank 1: none at all where ``empty_rank`` says)."""
    count = rank + 1
    return (np.arange(count * int(np.prod(width))).reshape(count, *width) + 100 * rank).astype(dtype)


def gather_arrays(rank, size):
    """core.allgather and bps.allgather: first dimensions 1, 2, 3...; bit-exact specials; a rank
    with no rows; pieces smaller than the whole (the test sets a small BYTEPS_PARTITION_BYTES)."""
    got = core.allgather(rows_of(rank), "g.float32")
    want = np.concatenate([rows_of(r) for r in range(size)])
    check("float32", got.shape == want.shape and (got == want).all(), f"{got.shape} {got.ravel()[:8]}")
    for dtype in (np.int8, np.float64, np.float16, np.int64):
        got = core.allgather(rows_of(rank, dtype, (5,)), f"g.{np.dtype(dtype).name}")
        want = np.concatenate([rows_of(r, dtype, (5,)) for r in range(size)])
        check(f"dtype {np.dtype(dtype).name}", got.dtype == dtype and (got == want).all(), str(got))
    special = np.array([[-0.0, np.nan], [np.inf, -1.5]], np.float32)[: rank % 2 + 1]
    got = core.allgather(special, "g.special")
    want = np.concatenate([np.array([[-0.0, np.nan], [np.inf, -1.5]], np.float32)[: r % 2 + 1] for r in range(size)])
    check("bit-exact", got.tobytes() == want.tobytes(), str(got))
    mine = np.ones((0 if rank == 1 else 2, 4), np.int32) * rank
    got = core.allgather(mine, "g.empty")
    want = np.concatenate([np.ones((0 if r == 1 else 2, 4), np.int32) * r for r in range(size)])
    check("a rank with no rows", got.shape == want.shape and (got == want).all(), str(got))
    none = core.allgather(np.zeros((0, 3), np.float32), "g.nothing")
    check("no rows anywhere", none.shape == (0, 3) and none.dtype == np.float32, str(none.shape))
    big = np.full((1000 * (rank + 1), 7), rank, np.float64)  # pieces: several windows of gathers
    got = core.allgather(big, "g.big")
    want = np.concatenate([np.full((1000 * (r + 1), 7), r, np.float64) for r in range(size)])
    check("many pieces", got.shape == want.shape and (got == want).all(), str(got.shape))
    nd = bps.allgather(mx.nd.array(rows_of(rank)), name="nd")
    check("NDArray", isinstance(nd, mx.nd.NDArray) and (nd.asnumpy() == np.concatenate(
        [rows_of(r) for r in range(size)])).all(), str(nd))
    unnamed = [bps.allgather(mx.nd.ones((rank + 1, 2)) * i).asnumpy() for i in range(2)]
    check("unnamed calls match by order", [u.sum() for u in unnamed] == [0.0, 2.0 * sum(range(1, size + 1))],
          str(unnamed))


def gather_errors(rank, size):
    """What every rank sees when one rank's tensor does not fit the others'."""
    last = size - 1
    trailing = np.zeros((rank + 1, 4 if rank == last else 3), np.float32)
    dtype = np.zeros((2, 3), np.float64 if rank == last else np.float32)
    zero_d = np.float32(1.0) if rank == last else np.zeros((1,), np.float32)
    listed = [1, 2] if rank == last else np.zeros((1,), np.float32)
    errors = {what: raises(Exception, core.allgather, value, f"e.{what}")
              for what, value in (("trailing", trailing), ("dtype", dtype), ("0-d", zero_d), ("list", listed))}
    after = core.allgather(np.full((1, 2), rank, np.int32), "e.after")  # the ranks are still in step
    check("in step after the errors", after.ravel().tolist() == [r for r in range(size) for _ in (0, 1)], str(after))
    return errors


def objects(rank, size):
    """broadcast_object and allgather_object of plain data, and what cannot be sent."""
    value = {"rank": rank, "name": f"worker-{rank}", "items": [1, 2.5, None, True], "pair": (rank, "x"),
             "array": np.arange(3) * rank, 7: "int key"}
    got = bps.broadcast_object(value if rank == 1 else None, root_rank=1, name="o.broadcast")
    check("broadcast_object", got["rank"] == 1 and got["pair"] == (1, "x") and got[7] == "int key"
          and got["array"].tolist() == [0, 1, 2], str(got))
    everyone = bps.allgather_object(value)
    check("allgather_object", [v["name"] for v in everyone] == [f"worker-{r}" for r in range(size)]
          and [v["array"].tolist() for v in everyone] == [[0, r, 2 * r] for r in range(size)], str(everyone))
    sizes = bps.allgather_object("x" * (100 * rank), name="o.strings")  # different lengths
    check("strings of different lengths", sizes == ["x" * (100 * r) for r in range(size)], str([len(s) for s in sizes]))
    scalar = bps.allgather_object(rank * 1.5, name="o.numbers")
    check("numbers", scalar == [r * 1.5 for r in range(size)], str(scalar))
    return {
        "allgather_set": raises(TypeError, bps.allgather_object, {1, 2} if rank == 1 else rank, name="o.set"),
        "broadcast_set": raises(TypeError, bps.broadcast_object, {"a": {1, 2}} if rank == 0 else None, 0, "o.bset"),
        "after": bps.allgather_object(rank, name="o.after"),
    }


def grouped(rank, size):
    """grouped_allreduce (mean and sum, scaled), its in-place form, allreduce and grouped_push_pull."""
    shapes = [(3,), (2, 2), (), (5, 1)]

    def tensors_of(r):
        return [mx.nd.array(np.arange(int(np.prod(s))).reshape(s) + 10 * r + i, dtype="float32") if s
                else mx.nd.array([7.0 * r]).reshape(()) for i, s in enumerate(shapes)]

    every = [[t.asnumpy() for t in tensors_of(r)] for r in range(size)]
    total = [sum(every[r][i] for r in range(size)) for i in range(len(shapes))]
    mine = tensors_of(rank)
    before = [t.asnumpy().copy() for t in mine]
    mean = bps.grouped_allreduce(mine, name="gr.mean")
    check("grouped mean", all(m.shape == s and np.allclose(m.asnumpy(), t / size) for m, s, t in zip(mean, shapes, total)),
          str([m.asnumpy() for m in mean]))
    check("inputs unchanged", all((t.asnumpy() == b).all() for t, b in zip(mine, before)), "")
    summed = bps.grouped_allreduce(mine, name="gr.sum", op=bps.Sum, prescale_factor=2.0, postscale_factor=0.5)
    check("grouped sum scaled", all(np.allclose(m.asnumpy(), t) for m, t in zip(summed, total)),
          str([m.asnumpy() for m in summed]))
    bps.grouped_allreduce_(mine, average=False, name="gr.inplace")
    check("grouped in place", all(np.allclose(m.asnumpy(), t) for m, t in zip(mine, total)), "")
    one = bps.allreduce(mx.nd.ones((4,)) * rank, name="gr.one")
    check("allreduce", np.allclose(one.asnumpy(), sum(range(size)) / size), str(one))
    pushed = tensors_of(rank)
    bps.grouped_push_pull(pushed, name="gr.pp", is_average=False)
    check("grouped_push_pull", all(np.allclose(m.asnumpy(), t) for m, t in zip(pushed, total)), "")
    check("empty group", bps.grouped_allreduce([]) == [], "")
    return {"both": raises(ValueError, bps.grouped_allreduce, mine, True, "gr.bad", op=bps.Sum),
            "process_set": raises(NotImplementedError, bps.allgather, mine[0], "gr.ps", 0, object())}


def main():
    bps.init()
    rank, size = bps.rank(), bps.size()
    gather_arrays(rank, size)
    result = {"rank": rank, "errors": gather_errors(rank, size), "objects": objects(rank, size),
              "grouped": grouped(rank, size)}
    report({**result, "failures": failures})
    bps.shutdown()


def alone():
    """One worker, no servers: every call answers from this process alone."""
    bps.init()
    got = bps.allgather(mx.nd.array(rows_of(0)), name="a")
    check("allgather alone", (got.asnumpy() == rows_of(0)).all(), str(got))
    check("objects alone", bps.allgather_object({"a": (1, 2)}) == [{"a": (1, 2)}]
          and bps.broadcast_object([1, "x"]) == [1, "x"], "")
    summed = bps.grouped_allreduce([mx.nd.ones((2,)) * 3], op=bps.Sum, postscale_factor=2.0)
    check("grouped alone", summed[0].asnumpy().tolist() == [6.0, 6.0], str(summed))
    report({"failures": failures, "set": raises(TypeError, bps.allgather_object, {1}),
            "0-d": raises(ValueError, bps.allgather, mx.nd.array([1.0]).reshape(()))})
    bps.shutdown()


run({"all": main, "alone": alone})
