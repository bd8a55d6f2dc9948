"""Failures that end in a clear exception (tests/clusters/test_errors.py): usage errors,
mismatched tensors, dead workers, servers and schedulers, bad environments, rendezvous that
never completes. Scenarios record each expected failure as [exception type, message, seconds
taken] (:func:`expect_error`) and report them all at once."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import numpy as np
from job_tools import report, run

import bps_gossip as bps

outcomes: dict[str, Any] = {}


def expect_error(label: str, call: Callable[[], Any]) -> None:
    """Run call(); record [type, message, seconds] of what it raised (or 'no error')."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        outcomes[label] = [type(exc).__name__, str(exc), time.monotonic() - start]
    else:
        outcomes[label] = ["no error", "", time.monotonic() - start]


def usage_errors() -> None:
    """Calls before init, bad names, dtypes, outputs and roots, and calls after shutdown."""
    x = np.arange(4, dtype=np.float32)
    for label, call in [
        ("push_pull", lambda: bps.push_pull(x, "x")),
        ("push_pull_async", lambda: bps.push_pull_async(x, "x")),
        ("broadcast", lambda: bps.broadcast(x, "x")),
        ("broadcast_async", lambda: bps.broadcast_async(x, "x")),
        ("rank()", bps.rank), ("size()", bps.size), ("local_rank()", bps.local_rank),
        ("local_size()", bps.local_size), ("declare()", lambda: bps.declare("x")),
        ("barrier", bps.barrier), ("server_stats", bps.server_stats),
    ]:
        expect_error("before init: " + label, call)
    bps.init()
    rank = bps.rank()
    expect_error("name None", lambda: bps.push_pull(x, None))
    expect_error("name ''", lambda: bps.push_pull(x, ""))
    expect_error("broadcast name ''", lambda: bps.broadcast(x, ""))
    expect_error("declare name None", lambda: bps.declare(None))
    expect_error("complex64", lambda: bps.push_pull(x.astype(np.complex64), "cplx"))
    expect_error("bool", lambda: bps.push_pull(x > 1, "flags"))
    expect_error("broadcast bool", lambda: bps.broadcast(x > 1, "bflags"))
    expect_error("list", lambda: bps.push_pull([1.0, 2.0], "alist"))
    expect_error("out shape", lambda: bps.push_pull(x, "o1", out=np.empty(5, np.float32)))
    expect_error("out dtype", lambda: bps.push_pull(x, "o2", out=np.empty(4, np.float64)))
    expect_error("broadcast out shape", lambda: bps.broadcast(x, "o3", out=np.empty((2, 2), np.float32)))
    for root in (2, -1, 7, True, 0.0):
        expect_error(f"root {root!r}", lambda root=root: bps.broadcast(x, "bad-root", root_rank=root))
    # none of the above reached the servers: the job goes on, and the names are fresh
    ok = bps.push_pull(x, "x", average=False)
    outcomes["still works"] = ok.tolist()
    lonely = bps.push_pull_async(x, f"lonely{rank}")  # no other rank ever pushes it
    bps.shutdown()
    expect_error("pending at shutdown", lambda: bps.synchronize(lonely))
    expect_error("after shutdown", lambda: bps.push_pull(x, "x"))
    report({"rank": rank, "outcomes": outcomes})


def mismatches() -> None:
    """Odd and even ranks disagree on shape, dtype, parts, average, root or kind of operation."""
    bps.init()
    rank = bps.rank()
    odd = rank % 2 == 1
    f32 = np.float32
    cases = [  # label, this rank's call
        ("shape", lambda: bps.push_pull(np.ones((4, 3) if odd else (3, 4), f32), "t-shape")),
        ("dtype", lambda: bps.push_pull(np.ones(6, np.int32 if odd else f32), "t-dtype")),
        ("itemsize", lambda: bps.push_pull(np.ones(3000, np.float64 if odd else f32), "t-itemsize")),
        ("parts", lambda: bps.push_pull(np.ones(100 if odd else 10000, f32), "t-parts")),
        ("zero-size", lambda: bps.push_pull(np.ones((0, 3) if odd else (3,), f32), "t-zero")),
        ("average", lambda: bps.push_pull(np.ones(5, f32), "t-average", average=not odd)),
        ("root", lambda: bps.broadcast(np.ones(5, f32), "t-root", root_rank=rank % 2)),
        ("push_pull vs broadcast", lambda: (bps.broadcast if odd else bps.push_pull)(np.ones(5, f32), "t-kind")),
    ]
    for label, call in cases:
        expect_error(label, call)
    # asynchronous: a mismatch among correct operations in flight fails only its own handle
    good = [bps.push_pull_async(np.full(2000, rank, f32), f"t-good{i}", average=False) for i in range(3)]
    bad = bps.push_pull_async(np.ones(20 if odd else 30, f32), "t-async")
    expect_error("async", lambda: bps.synchronize(bad))
    outcomes["good"] = [bps.synchronize(h)[:2].tolist() for h in good]
    # the job is not broken: the names work again once the shapes agree
    outcomes["again"] = bps.push_pull(np.ones((3, 4), f32), "t-shape", average=False).sum().item()
    report({"rank": rank, "outcomes": outcomes})
    bps.shutdown()


def death(where: str) -> None:
    """Rank 1 kills itself (``where``: push_pull, pushed, barrier); the others record what fails."""
    bps.init()
    rank = bps.rank()
    bps.push_pull(np.ones(3, np.float32), "warm-up")
    bps.barrier()
    if rank == 1:
        if where == "pushed":  # its partitions reach the servers before it dies
            bps.push_pull_async(np.ones(10000, np.float32), "after-death")
            time.sleep(0.5)
        os.kill(os.getpid(), 9)
    time.sleep(0.2)
    if where == "pushed" and rank == 2:
        time.sleep(3)  # pushes only after the servers heard of the death
    if where in ("push_pull", "pushed"):
        expect_error("first", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death"))
    else:
        expect_error("first", bps.barrier)
    expect_error("second", lambda: bps.push_pull(np.ones(3, np.float32), "after-death-2"))
    report({"rank": rank, "outcomes": outcomes})
    bps.shutdown()


def dead_server(victim: str) -> None:
    """Rank 0 kills server process ``victim``; every rank records the next two push_pulls."""
    bps.init()
    rank = bps.rank()
    bps.push_pull(np.ones(3, np.float32), "warm-up")
    bps.barrier()
    if rank == 0:
        os.kill(int(victim), 9)
    # 10 partitions: some live on the dead server
    expect_error("first", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death"))
    expect_error("second", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death-2"))
    report({"rank": rank, "outcomes": outcomes})
    bps.shutdown()


def dead_server_on_one_host(victim: str) -> None:
    """Rank 0 kills the one server ``victim``: a compressed push_pull fails, a plain one is summed."""
    from bps_gossip.compression import CompressionSpec

    bps.init()
    rank = bps.rank()
    onebit = CompressionSpec("onebit")
    bps.push_pull(np.ones(64, np.float32), "warm-up", compression=onebit)
    bps.barrier()
    if rank == 0:
        os.kill(int(victim), 9)
    expect_error("compressed", lambda: bps.push_pull(np.ones(64, np.float32), "after-death", compression=onebit))
    summed = bps.push_pull(np.full(1000, rank + 1, np.float32), "summed", average=False)
    report({"rank": rank, "outcomes": outcomes, "summed": sorted(set(summed.tolist()))})
    bps.shutdown()


def dead_scheduler(victim: str) -> None:
    """Rank 0 kills the scheduler ``victim``; push_pulls go on until its silence is noticed."""
    bps.init()
    rank = bps.rank()
    bps.push_pull(np.ones(3, np.float32), "warm-up")
    bps.barrier()
    # through the server: both ranks have their barrier's answer before the scheduler dies
    bps.push_pull(np.ones(3, np.float32), "both past the barrier")
    if rank == 0:
        os.kill(int(victim), 9)

    def loop():  # push_pulls go on (the server lives) until the scheduler's silence is noticed
        for _ in range(100000):
            bps.push_pull(np.ones(3, np.float32), "loop")
            time.sleep(0.01)

    expect_error("first", loop)
    expect_error("second", lambda: bps.push_pull(np.ones(3, np.float32), "after"))
    expect_error("barrier", bps.barrier)
    report({"rank": rank, "outcomes": outcomes})
    bps.shutdown()


def unreachable_scheduler() -> None:
    """init() twice with nobody listening: both time out, and the retry leaks no descriptor."""
    expect_error("init", bps.init)
    time.sleep(0.3)  # ZeroMQ closes a socket's descriptors in the background
    fds = len(os.listdir("/proc/self/fd"))
    expect_error("again", bps.init)  # a retry fails the same way and leaks nothing
    time.sleep(0.3)
    outcomes["leaked"] = len(os.listdir("/proc/self/fd")) - fds
    outcomes["initialized"] = bps.is_initialized()
    report(outcomes)


def bad_environment(*settings: str) -> None:
    """init() under each bad VAR=VALUE of ``settings``, one at a time."""
    for setting in settings:
        var, _, value = setting.partition("=")
        saved = os.environ.get(var)
        os.environ[var] = value
        expect_error(f"{var}={value}", bps.init)
        os.environ[var] = saved if saved is not None else ""
    outcomes["initialized"] = bps.is_initialized()
    report(outcomes)


def init_fails() -> None:
    """Record what init() raises."""
    expect_error("init", bps.init)
    report(outcomes)


def rendezvous_never_completes() -> None:
    """init() while a worker is missing: report ["joined"] or the error's type and message."""
    try:
        bps.init()
        report(["joined"])
    except bps.BpsGossipError as exc:
        report([type(exc).__name__, str(exc)])


def alone() -> None:
    """One push_pull of ones(2) by a worker that runs alone."""
    bps.init()
    report(bps.push_pull(np.ones(2), "alone").tolist())
    bps.shutdown()


def register_and_die() -> None:
    """Register (init in a thread, waiting for the others), then die by SIGKILL."""
    threading.Thread(target=bps.init, daemon=True).start()
    time.sleep(2)   # registered, waiting for worker 1
    os.kill(os.getpid(), 9)


def sum_of_ones() -> None:
    """One push_pull of ones(4), summed."""
    bps.init()
    report(bps.push_pull(np.ones(4, np.float32), "x", average=False).tolist())
    bps.shutdown()


if __name__ == "__main__":
    run({"usage_errors": usage_errors, "mismatches": mismatches, "death": death, "dead_server": dead_server,
         "dead_server_on_one_host": dead_server_on_one_host, "dead_scheduler": dead_scheduler,
         "unreachable_scheduler": unreachable_scheduler, "bad_environment": bad_environment,
         "init_fails": init_fails, "rendezvous_never_completes": rendezvous_never_completes, "alone": alone,
         "register_and_die": register_and_die, "sum_of_ones": sum_of_ones})
