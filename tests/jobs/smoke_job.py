"""The smallest end-to-end job (tests/clusters/test_smoke.py): one push_pull."""

from __future__ import annotations

import numpy as np
from job_tools import report, run

import bps_gossip as bps


def sum_of_ranks() -> None:
    """Each rank pushes arange(6) * (rank + 1) and reports the sum."""
    bps.init()
    x = np.arange(6, dtype=np.float32) * (bps.rank() + 1)
    report(bps.push_pull(x, "x", average=False).tolist())
    bps.shutdown()


if __name__ == "__main__":
    run({"sum_of_ranks": sum_of_ranks})
