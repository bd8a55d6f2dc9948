"""Collectives on real clusters (tests/clusters/test_push_pull.py): push_pull, broadcast and
barrier, every dtype and shape, bit for bit; large partitions; thousands in flight; shared
memory and TCP in one round. Values are small integers, so sums are exact."""

from __future__ import annotations

import threading
import time

import numpy as np
from job_tools import report, run

import bps_gossip as bps

DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64")]
# 0-d to 4-d, zero-size, and (with 4 KiB partitions) tensors of several partitions.
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (0,), (3, 0, 2), (5051,), (40, 130), (3, 4, 5, 29)]
failures: list[str] = []
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def same(got, want):
    """Bit-exact equality of dtype, shape and bytes."""
    return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
            and got.tobytes() == want.tobytes())


def ints(shape, dtype, seed, signed=None):
    """Small integers (|v| <= 8): sums over up to 4 ranks are exact in every dtype."""
    n = int(np.prod(shape, dtype=np.int64))
    vals = (np.arange(n, dtype=np.int64) * 7 + seed * 3) % 9
    if dtype.kind != "u" if signed is None else signed:
        vals = vals - 4
    return vals.reshape(shape).astype(dtype)


def reduced(shape, dtype, size, average):
    """What push_pull must return: the sum over ranks, or the mean (floor-divided for integers)."""
    total = sum(ints(shape, np.dtype(np.int64), r, dtype.kind != "u") for r in range(size)).astype(dtype)
    if average and size > 1:
        divide = np.floor_divide if dtype.kind in "iu" else np.true_divide
        total = divide(total, dtype.type(size))
    return np.asarray(total, dtype=dtype).reshape(shape)


SPECIAL_BITS = {  # -0.0, quiet and signalling NaNs with payloads, -inf
    np.dtype("float16"): [0x8000, 0x7E01, 0xFC00, 0x7D55, 0xFE3F],
    np.dtype("float32"): [0x80000000, 0x7FC12345, 0xFF800000, 0x7F800001, 0xFFC00ABC],
    np.dtype("float64"): [1 << 63, 0x7FF8000000000123, 0xFFF0000000000000, 0x7FF0000000000001,
                          0xFFF800000000BEEF],
}


def payload(shape, dtype, seed):
    """Random bits of ``dtype`` (floats: with -0.0 and NaN payloads at the front)."""
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    flat = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).copy()
    if dtype.kind == "f":
        bits = flat.view(f"u{dtype.itemsize}")
        special = SPECIAL_BITS[dtype][:n]
        bits[:len(special)] = special
    return flat.reshape(shape)


def collectives() -> None:
    """Hundreds of checks of every collective, reported as (checks, failures)."""
    bps.init()
    rank, size = bps.rank(), bps.size()

    # -- blocking push_pull: returned array, out= another array, in place ------------------
    for average in (False, True):
        for dt in DTYPES:
            for shape in SHAPES:
                tag = f"{dt.name}{shape}{'-avg' if average else '-sum'}"
                want = reduced(shape, dt, size, average)
                x = ints(shape, dt, rank)
                keep = x.copy()
                got = bps.push_pull(x, "ret" + tag, average=average)
                check(same(got, want) and got is not x, f"push_pull returned {tag}: {got!r} != {want!r}")
                check(same(x, keep), f"push_pull returned {tag}: input changed")
                other = np.full(shape, 99, dtype=dt)
                got = bps.push_pull(x, "out" + tag, average=average, out=other)
                check(got is other and same(other, want), f"push_pull out= {tag}: {other!r} != {want!r}")
                check(same(x, keep), f"push_pull out= {tag}: input changed")
                got = bps.push_pull(x, "inplace" + tag, average=average, out=x)
                check(got is x and same(x, want), f"push_pull in place {tag}: {x!r} != {want!r}")

    # the default is the mean, as in BytePS
    got = bps.push_pull(ints((6,), DTYPES[1], rank), "default-average")
    check(same(got, reduced((6,), DTYPES[1], size, True)), f"default average: {got!r}")

    # -- inputs that are not plain C-contiguous writable arrays --------------------------------
    base = ints((6, 8), DTYPES[5], rank)
    for label, x in [("strided", base[:, ::3]), ("transposed", base.T), ("fortran", np.asfortranarray(base))]:
        want = sum(ints((6, 8), DTYPES[5], r) for r in range(size))
        want = np.ascontiguousarray(want[:, ::3] if label == "strided" else want.T if label == "transposed" else want)
        check(same(bps.push_pull(x, "odd-" + label, average=False), want), f"push_pull of a {label} input")
    frozen = ints((5,), DTYPES[2], rank)
    frozen.setflags(write=False)
    check(same(bps.push_pull(frozen, "odd-readonly", average=False), reduced((5,), DTYPES[2], size, False)),
          "push_pull of a read-only input")

    # -- several threads, each with its own names ----------------------------------------------
    thread_errors = []
    def worker_thread(t):
        try:
            for i in range(15):
                got = bps.push_pull(ints((50 * i,), DTYPES[t], rank), f"thread{t}-{i}", average=t % 2 == 0)
                if not same(got, reduced((50 * i,), DTYPES[t], size, t % 2 == 0)):
                    thread_errors.append(f"thread {t} call {i}")
        except Exception as exc:
            thread_errors.append(repr(exc))
    threads = [threading.Thread(target=worker_thread, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    check(not thread_errors and not any(t.is_alive() for t in threads), f"threads: {thread_errors}")

    # -- asynchronous push_pulls: declared and issued in a rank-dependent order ------------
    rng = np.random.default_rng(100 + rank)
    jobs = [(dt, shape, average) for dt in DTYPES for shape in [(), (7,), (0,), (40, 130), (3, 4, 5, 29)]
            for average in (False, True)]
    names = [f"async-{dt.name}{shape}{average}" for dt, shape, average in jobs]
    for i in rng.permutation(len(names)):
        bps.declare(names[i])
    handles = {}
    for i in rng.permutation(len(jobs)):
        dt, shape, average = jobs[i]
        x = ints(shape, dt, rank)
        out = x if i % 2 else None  # half in place
        handles[i] = (bps.push_pull_async(x, names[i], average=average, priority=int(rng.integers(-5, 6)),
                                          out=out), x, out)
    # several rounds of one name in flight at once, with priorities that reorder them
    same_name = [bps.push_pull_async(ints((3000,), DTYPES[2], rank + 10 * k), "async-same", average=False,
                                     priority=k) for k in range(4)]
    deadline = time.monotonic() + 30
    while not all(bps.poll(h) for h, _, _ in handles.values()) and time.monotonic() < deadline:
        time.sleep(0.005)
    check(all(bps.poll(h) for h, _, _ in handles.values()), "poll: async handles not done within 30 s")
    for i in sorted(handles, reverse=True):
        dt, shape, average = jobs[i]
        handle, x, out = handles[i]
        got = bps.synchronize(handle)
        want = reduced(shape, dt, size, average)
        check(same(got, want) and (out is None or got is x), f"async {names[i]}: {got!r} != {want!r}")
    for k, handle in enumerate(same_name):
        want = sum(ints((3000,), DTYPES[2], r + 10 * k) for r in range(size))
        check(same(bps.synchronize(handle), want), f"async-same round {k}")

    # -- broadcast: bit-exact from several roots, returned / out= / in place ---------------
    roots = sorted({0, 1 % size, size - 1})
    for root in roots:
        for dt in DTYPES:
            for shape in SHAPES:
                tag = f"{dt.name}{shape}-root{root}"
                want = payload(shape, dt, 1000 * root + len(shape))
                x = payload(shape, dt, 1000 * rank + len(shape))
                keep = x.copy()
                bits = f"u{dt.itemsize}"
                got = bps.broadcast(x, "bc" + tag, root_rank=root)
                check(same(got.view(bits), want.view(bits)) and same(x.view(bits), keep.view(bits)),
                      f"broadcast returned {tag}")
                other = np.zeros(shape, dtype=dt)
                got = bps.broadcast(x, "bcout" + tag, root_rank=root, out=other)
                check(got is other and same(other.view(bits), want.view(bits)), f"broadcast out= {tag}")
                got = bps.broadcast(x, "bcin" + tag, root_rank=root, out=x)
                check(got is x and same(x.view(bits), want.view(bits)), f"broadcast in place {tag}")
    bc = [bps.broadcast_async(payload((9,), dt, 7 * rank), "bc-async-" + dt.name, root_rank=size - 1,
                              priority=i) for i, dt in enumerate(DTYPES)]
    for dt, handle in zip(DTYPES, bc):
        want = payload((9,), dt, 7 * (size - 1)).view(f"u{dt.itemsize}")
        check(same(bps.synchronize(handle).view(f"u{dt.itemsize}"), want), f"broadcast_async {dt.name}")

    report({"rank": rank, "size": size, "checks": checks, "failures": failures[:40]})
    bps.shutdown()


def big_partitions() -> None:
    """Partitions over 64 KiB (credit) and over 1 MiB (the server's pool), and a large broadcast."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    # Partitions above 64 KiB are acknowledged and use credit; above 1 MiB the server sums
    # them on its thread pool. Several tensors in flight, in a rank-dependent order.
    jobs = [(np.dtype("float32"), (700, 1000)), (np.dtype("int64"), (150001,)), (np.dtype("uint8"), (3, 333333)),
            (np.dtype("float64"), (50000,)), (np.dtype("float16"), (2, 2))]
    order = np.random.default_rng(rank).permutation(len(jobs))
    handles = {i: bps.push_pull_async(ints(jobs[i][1], jobs[i][0], rank), f"big{i}", average=bool(i % 2),
                                      priority=int(i)) for i in order}
    for i, handle in handles.items():
        dt, shape = jobs[i]
        check(same(bps.synchronize(handle), reduced(shape, dt, size, bool(i % 2))), f"big{i} {dt} {shape}")
    x = payload((300000,), np.dtype("float32"), 5 + rank)
    check(same(bps.broadcast(x, "big-bc", root_rank=size - 1, out=x).view("u4"),
               payload((300000,), np.dtype("float32"), 5 + size - 1).view("u4")), "big broadcast")
    report({"checks": checks, "failures": failures})
    bps.shutdown()


def spread() -> None:
    """One tensor of 10 partitions and one of 1: where they landed, from the servers' counters."""
    bps.init()
    big = bps.push_pull(np.ones(10000, np.float32), "spread-big", average=False)   # 10 partitions
    bps.push_pull(np.ones(5, np.float32), "spread-small", average=False)          # 1 partition
    report({"ok": bool((big == 2).all()), "stats": bps.server_stats(),
            "big": str(bps.declare("spread-big")), "small": str(bps.declare("spread-small"))})
    bps.shutdown()


def barrier() -> None:
    """Three barriers, each rank arriving at its own time."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    times = []
    for i in range(3):
        time.sleep(0.25 * ((rank + i) % size))
        before = time.time()
        bps.barrier()
        times.append((before, time.time()))
    report({"rank": rank, "times": times})
    bps.shutdown()


def thousands_in_flight() -> None:
    """About 6000 partitions of one tensor and 2000 small tensors queued at once."""
    bps.init()
    rank = bps.rank()
    handles = [bps.push_pull_async(np.full(6_000_000, rank + 1, np.float32), "huge", average=False)]
    handles += [bps.push_pull_async(np.full(10, i + rank, np.int32), f"tiny{i}", average=False)
                for i in range(2000)]
    results = [bps.synchronize(h) for h in handles]
    report({"huge": bool((results[0] == 3).all()),
            "tiny": all((r == 2 * i + 1).all() for i, r in enumerate(results[1:]))})
    bps.shutdown()


def mixed_paths() -> None:
    """40 rounds of 4 MiB, every round different (a later round's result would show)."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    failures = []
    n = 1 << 20  # 4 MiB of float32: summed on the server's pool, copies that take a while
    value = np.empty(n, np.float32)
    out = np.empty(n, np.float32)
    for step in range(40):
        value.fill(rank + 10 * step)  # every round differs: a result from the next round shows
        bps.push_pull(value, "mixed", average=False, out=out)
        want = sum(r + 10 * step for r in range(size))
        if not (out == want).all():
            bad = out[out != want]
            failures.append(f"step {step}: {bad.size} elements wrong, e.g. {bad[0]} (want {want})")
            break
    report({"rank": rank, "failures": failures})
    bps.shutdown()




if __name__ == "__main__":
    run({"collectives": collectives, "big_partitions": big_partitions, "spread": spread, "barrier": barrier,
         "thousands_in_flight": thousands_in_flight, "mixed_paths": mixed_paths})
