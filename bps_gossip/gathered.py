"""What the ranks decide together, from what each observed itself: ``gather_rows`` and robust
statistics over its rows.

A decision every rank must take alike (mode='auto''s windows, gossip's routing, the drift of
an exact average) needs the same numbers on every rank. A sum through the servers gives that,
but any rank can then add anything anywhere: one rank's lie about itself, or about another,
moves every rank's decision, and one NaN breaks it. :func:`~bps_gossip.collectives.gather_rows`
gives every rank each rank's own row instead: each worker pushes a (size, n) array with only its row filled, and
the servers keep of each push only its sender's row (they know the sender from its
connection), so a rank can only speak for itself. :func:`usable_rows` drops the rows that fail
a range and finiteness check, naming their ranks, and :func:`robust_mean` combines the rest by
the median, which a minority of liars cannot move past the honest ranks' values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("bps_gossip")


def usable_rows(matrix: np.ndarray, low: Sequence[float] | float, high: Sequence[float] | float,
                what: str) -> np.ndarray:
    """Which rows of ``matrix`` are finite and within [``low``, ``high``] (per column or for all);
    the others are dropped with a warning naming their ranks and ``what`` they reported."""
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(matrix).all(axis=1) & (matrix >= low).all(axis=1) & (matrix <= high).all(axis=1)
    if not ok.all():
        log.warning("%s: ranks %s reported values that are not finite or out of range; left out",
                    what, [int(rank) for rank in np.flatnonzero(~ok)])
    return ok


def robust_mean(matrix: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Per column, the median of the usable rows (zeros when none is usable)."""
    rows = matrix[usable]
    return np.median(rows, axis=0) if len(rows) else np.zeros(matrix.shape[1])
