"""Members that lie in what the ranks decide together (tests/clusters/test_liars.py): every rank
gathers its own row; the liar (the last rank) writes into every row, as a rank that reports
numbers for the others would."""

from __future__ import annotations

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


run({"gather": gather})
