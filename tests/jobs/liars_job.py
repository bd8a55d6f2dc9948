"""Members that lie (tests/clusters/test_liars.py): in what the ranks decide together, every rank
gathers its own row and the liar (the last rank) writes into every row, as a rank that reports
numbers for the others would; in a broadcast, the liar pushes a payload where zeros belong."""

from __future__ import annotations

import time

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import collectives
from bps_gossip.runtime import current


def gather(rounds: str) -> None:
    """``rounds`` gathers of a row [rank, rank + 0.5]; the liar pushes a whole array of 1e9.
    Every rank reports what it got."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    got = []
    for _ in range(int(rounds)):
        row = np.array([rank, rank + 0.5], np.float64)
        if rank == size - 1:  # the project's own code with one thing changed: every row filled
            lie = np.full((size, 2), 1e9)
            future = collectives._submit(current("liar"), "rows", "rows", lie, lie.reshape(-1),
                                         np.empty_like(lie), lie.dtype, 0, None, rows=True)
            got.append(bps.synchronize(future).tolist())
        else:
            got.append(bps.gather_rows(row, "rows").tolist())
    report({"rank": rank, "got": got})
    bps.shutdown()


def broadcast() -> None:
    """Rank 0 broadcasts [1, 2, 3, 4]; the liar (the last rank) pushes 1000s, not zeros, under the
    same name and root. Every rank reports what it got."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    if rank == size - 1:
        lie = np.full(4, 1000.0, np.float32)
        future = collectives._submit(current("liar"), "b", "broadcast from root 0", lie, lie.view(np.uint32),
                                     np.empty_like(lie), np.dtype(np.uint32), 0, None, root=0)
        got = bps.synchronize(future)
    else:
        got = bps.broadcast(np.arange(1, 5, dtype=np.float32) * (rank == 0), "b", root_rank=0)
    report({"rank": rank, "got": np.asarray(got).tolist()})
    bps.shutdown()


def sum_where_rows_are_gathered() -> None:
    """Three rounds in which every rank gathers rows of "decide" but the liar (the last rank, a
    local of rank 0's host) pushes a sum of the same shape under that name: at once, after the
    leader's gather (the liar waits), before it (the leader waits). Then every rank gathers rows
    of "after". Every rank reports what each "decide" gave it (the error's type) and "after"."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    decided = []
    for liar_waits, leader_waits in ((0.0, 0.0), (0.5, 0.0), (0.0, 0.5)):
        try:
            if rank == size - 1:
                time.sleep(liar_waits)
                bps.push_pull(np.zeros((size, 2)), "decide", average=False)
            else:
                time.sleep(leader_waits if rank == 0 else 0.0)
                bps.gather_rows(np.array([rank, rank + 0.5]), "decide")
            decided.append("gathered")
        except bps.BpsGossipError as error:
            decided.append(type(error).__name__)
    after = bps.gather_rows(np.array([rank, rank + 0.5]), "after").tolist()
    report({"rank": rank, "decided": decided, "after": after})
    bps.shutdown()


run({"gather": gather, "broadcast": broadcast, "sum_where_rows_are_gathered": sum_where_rows_are_gathered})
