"""Members that lie in what gossip decides together (issue 37), in process over a FakeNetwork:
each rank's measurements reach the others only as its own row (gather_rows), combined after a
range and finiteness check. A liar cannot get an honest rank routed around, and one rank's NaN
(a liar's, or an honest fault) raises in nobody's step."""

from __future__ import annotations

import numpy as np
import pytest

from bps_gossip.gossip.averager import GossipAverager
from tests.fakes import FakeNetwork, run_ranks

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def job(n: int, seed: int = 0) -> tuple[FakeNetwork, list[GossipAverager]]:
    network = FakeNetwork(n)
    rng = np.random.RandomState(seed)
    return network, [GossipAverager({"w": rng.randn(6)}, graph="npdde", tag="l", link=network.link(r))
                     for r in range(n)]


def lying(avg: GossipAverager, edit) -> None:
    """Make ``avg``'s rank report its measurements through ``edit(row)``."""
    honest = avg.routing.measurements

    def measurements(now: float) -> np.ndarray:
        row = honest(now)
        edit(row)
        return row
    avg.routing.measurements = measurements


def test_a_liar_cannot_get_an_honest_rank_routed_around():
    """Rank 5 reports every message of rank 0 as 1000 s late, and 10 of them a window: only its
    own in-edge from rank 0 can carry that, and rank 0's other edges are fast: nobody is slow."""
    n = 6
    network, averagers = job(n)

    def edit(row: np.ndarray) -> None:
        row[0], row[n] = 1000.0 * 10, 10  # delays[0 -> 5] summed over 10 messages
    lying(averagers[5], edit)

    def body(rank: int):
        for _ in range(140):
            averagers[rank].step()
        averagers[rank].drain()
        return averagers[rank].routing.history

    histories = run_ranks(n, body, timeout=100)
    assert all(history == histories[0] for history in histories)  # every rank decided alike
    assert list(histories[0]) == [], histories[0]  # nobody routed around


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_one_ranks_bad_measurement_raises_nowhere(bad, caplog):
    """An honest fault (or a liar): rank 2's measurements hold NaN, inf or a negative delay every
    window: its row is left out with a warning naming it, every rank steps on, decisions alike."""
    n = 5
    network, averagers = job(n, seed=1)
    lying(averagers[2], lambda row: row.__setitem__(1, bad))

    def body(rank: int):
        for _ in range(70):
            averagers[rank].step()
        averagers[rank].drain()
        return averagers[rank].routing.history

    with caplog.at_level("WARNING", logger="bps_gossip"):
        histories = run_ranks(n, body, timeout=100)
    assert all(history == histories[0] for history in histories)
    assert "ranks [2] reported values that are not finite or out of range" in caplog.text


@pytest.mark.parametrize("bad", [np.inf, np.nan, -1.0, 1e300])
def test_a_drift_lie_moves_no_ranks_measure(bad):
    """The drift an exact average measures: one rank's report of inf, NaN, a negative or a huge
    number is left out or outvoted; every rank gets the same finite number, none raises."""
    n = 5
    network, averagers = job(n, seed=2)
    link = averagers[4].link
    honest = link.gather_rows

    def gather_rows(row: np.ndarray, name: str) -> np.ndarray:
        return honest(np.full_like(row, bad) if name.endswith(".drift") else row, name)
    link.gather_rows = gather_rows

    def body(rank: int) -> float:
        for _ in range(6):
            averagers[rank].step()
        return averagers[rank].average_exactly(measure=True)

    drifts = run_ranks(n, body, timeout=100)
    assert len(set(drifts)) == 1 and np.isfinite(drifts[0]) and drifts[0] < 10, drifts
