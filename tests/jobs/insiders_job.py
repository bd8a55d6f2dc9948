"""What a process on the network must not be able to do to a job (tests/clusters/test_insiders.py):
the workers push_pull steadily while the test attacks the scheduler or a server; a member floods
the scheduler with barriers; a member reports a working rank as stalled."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import testing
from bps_gossip.futures import Future
from bps_gossip.worker import commands as cmd


def push_steadily() -> None:
    """50 push_pulls of ones(4), 0.12 s apart: report rank and total, shut down."""
    total = 0.0
    for _ in range(50):
        total += float(bps.push_pull(np.ones(4, np.float32), "x", average=False).sum())
        time.sleep(0.12)
    report({"rank": bps.rank(), "total": total})
    bps.shutdown()


def steady() -> None:
    """Say READY once joined, then push_pull steadily."""
    bps.init()
    print("READY", flush=True)
    push_steadily()


def steady_with_uid() -> None:
    """Say this worker's routing id, its server and rank 1's peer address once a push_pull came
    back (its server connection is up by then), then push_pull steadily."""
    bps.init()
    engine = testing.engine()
    bps.push_pull(np.ones(1, np.float32), "warm-up")
    print("UID", engine.uid.hex(), engine.book.servers[0], engine.book.workers[1].addr, flush=True)
    push_steadily()


def false_stall_report() -> None:
    """Rank 2's engine reports rank 0 as stuck once (by its own stall check); every rank push_pulls steadily."""
    bps.init()
    if bps.rank() == 2:  # a member that says rank 0 is stuck, sent by its engine's own stall check
        engine = testing.engine()
        said = []

        def overdue(now, stall):
            if said:
                return []
            said.append(now)
            return [([0], "pushed nothing of 'x' for 60.0 s (a false report)")]
        engine.peers.channel.overdue = overdue
    push_steadily()


def flood_barriers(go) -> None:
    """Rank 0: ask for 200 barriers at once; report how many failed at once, how many waited and
    how many completed once rank 1 came (told through the file ``go``)."""
    engine = testing.engine()
    futures = [Future() for _ in range(200)]
    for future in futures:
        engine.submit(cmd.Barrier(future))
    deadline = time.monotonic() + 5  # the refusals come at once (before the bound: never)
    while sum(f.done() for f in futures) < 184 and time.monotonic() < deadline:
        time.sleep(0.05)
    errors = [str(f.exception()) for f in futures if f.done() and f.exception() is not None]
    pending = sum(1 for f in futures if not f.done())
    open(go, "w").close()  # rank 1 may come to its barriers now
    deadline = time.monotonic() + 15
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.05)
    report({"failed_at_once": len(errors), "pending": pending, "why": errors[:1],
            "done_later": sum(1 for f in futures if f.done() and f.exception() is None)})


def barrier_flood() -> None:
    """Rank 0 floods the scheduler with barriers (flood_barriers()); rank 1 then takes 16."""
    go = os.path.join(tempfile.gettempdir(), "bpsg_test_go_" + os.environ["DMLC_PS_ROOT_PORT"])
    bps.init()
    if bps.rank() == 0:  # a member that asks for 200 barriers at once, each a new seq
        flood_barriers(go)
    else:
        while not os.path.exists(go):  # no barrier of rank 1 before rank 0 has counted
            time.sleep(0.05)
        for _ in range(16):
            bps.barrier()
        report({"done": 16})
    bps.shutdown()


def rank() -> None:
    """Join, report this rank, shut down."""
    bps.init()
    report(bps.rank())
    bps.shutdown()


run({"steady": steady, "steady_with_uid": steady_with_uid, "false_stall_report": false_stall_report,
     "barrier_flood": barrier_flood, "rank": rank})
