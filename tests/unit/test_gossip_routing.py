"""Gossip that routes around a slow link (bps_gossip.gossip.routing): the decision from the
measurements, and push-sum over the thinned, deferred edges in process (tests.fakes)."""

from __future__ import annotations

import numpy as np
import pytest

from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.gossip.graphs import make_graph
from bps_gossip.gossip.routing import (
    MAX_OWED,
    MAX_PERIOD,
    MIN_MESSAGES,
    SlowLinkRouting,
    choose_slow,
)
from tests.fakes import FakeNetwork, run_ranks

pytestmark = pytest.mark.timeout(120)


def measured(n: int, edge_delay: dict[tuple[int, int], float], default: float = 0.001,
             graph: str = "npdde", rounds: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Summed delays and counts of ``rounds`` rounds of ``graph``, every edge ``default``
    seconds late unless ``edge_delay`` says otherwise."""
    delays, counts = np.zeros((n, n)), np.zeros((n, n))
    built = make_graph(graph, n)
    for rnd in range(rounds):
        for src in range(n):
            for dst in built.out_peers(src, rnd):
                delays[src, dst] += edge_delay.get((src, dst), default)
                counts[src, dst] += 1
    return delays, counts


def slow_rank_delays(n: int, slow: int, late: float) -> dict[tuple[int, int], float]:
    return {(a, b): late for a in range(n) for b in range(n) if slow in (a, b) and a != b}


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_rank_whose_edges_are_late_becomes_slow_with_a_period_its_link_can_carry(n):
    delays, counts = measured(n, slow_rank_delays(n, 2, 0.25))
    chosen = choose_slow(delays, counts, np.full(n, 0.02), {})  # 20 ms a round
    assert chosen == {2: min(MAX_PERIOD, int(np.ceil(0.25 / 0.02)) + 1)}


def test_a_uniform_network_has_no_slow_rank_however_slow():
    for late in (0.001, 0.05, 1.0):
        delays, counts = measured(8, {}, default=late)
        assert choose_slow(delays, counts, np.ones(8), {}) == {}


def test_small_delays_are_never_slow_and_one_rank_joins_per_window():
    delays, counts = measured(8, slow_rank_delays(8, 1, 0.015))  # 15 x the others, under the floor
    assert choose_slow(delays, counts, np.ones(8), {}) == {}
    delays, counts = measured(4, slow_rank_delays(4, 1, 0.077), default=0.051)  # 1.5x, but only 26 ms more
    assert choose_slow(delays, counts, np.ones(4), {}) == {}
    delays, counts = measured(4, slow_rank_delays(4, 3, 0.769), default=0.397)  # the 20 Mbit/s link's first window
    assert list(choose_slow(delays, counts, np.full(4, 0.3), {})) == [3]
    both = {**slow_rank_delays(8, 1, 0.5), **slow_rank_delays(8, 5, 0.3)}
    delays, counts = measured(8, both)
    first = choose_slow(delays, counts, np.ones(8), {})
    assert list(first) == [1]  # the worst first; the next window shows the other
    assert sorted(choose_slow(delays, counts, np.ones(8), first)) == [1, 5]


def test_a_slow_rank_stays_until_its_edges_are_fast_and_a_minority_is_slow():
    delays, counts = measured(4, slow_rank_delays(4, 3, 0.04))
    assert 3 in choose_slow(delays, counts, np.ones(4), {3: 5})
    delays, counts = measured(4, {})  # its link recovered
    assert choose_slow(delays, counts, np.ones(4), {3: 5}) == {}
    delays, counts = measured(4, slow_rank_delays(4, 0, 0.5))
    assert list(choose_slow(delays, counts, np.ones(4), {3: 5})) == [0]  # 3 recovered, 0 is slow now
    delays, counts = measured(4, {**slow_rank_delays(4, 3, 0.5), **slow_rank_delays(4, 0, 0.6)})
    assert choose_slow(delays, counts, np.ones(4), {}) == {}  # half of them slow: that is the norm
    delays, counts = measured(2, slow_rank_delays(2, 0, 0.5))
    assert choose_slow(delays, counts, np.ones(2), {}) == {}  # two ranks: nothing to route around


def test_a_slow_rank_leaves_once_its_link_and_compute_are_normal_however_late_it_comes():
    """Routed around, a rank lags: its messages come late against the others' rounds (lateness
    0.5 s) even when its link is fast. It stays slow while its pair transit or its busy seconds
    per round are high, and leaves when both are normal."""
    delays, counts = measured(4, slow_rank_delays(4, 3, 0.5))
    rounds, busy = np.full(4, 0.02), np.full(4, 0.01)
    offset = np.array([0.0, 3.0, -2.0, 7.0])  # each rank's clock: the pair sums cancel it
    sent_at = offset[:, None] - offset[None, :]  # receive stamp minus send stamp, beyond the transit

    def transits(transit: dict[tuple[int, int], float]) -> np.ndarray:
        return counts * (sent_at * -1 + np.vectorize(lambda a, b: transit.get((a, b), 0.002))(
            *np.indices((4, 4))))

    fast = transits({})
    assert choose_slow(delays, counts, rounds, {3: 8}, fast, busy) == {}  # lag only: it leaves
    assert 3 in choose_slow(delays, counts, rounds, {3: 8}, transits(slow_rank_delays(4, 3, 0.25)), busy)
    assert 3 in choose_slow(delays, counts, rounds, {3: 8}, fast, np.array([0.01, 0.01, 0.01, 0.15]))
    assert 3 in choose_slow(delays, counts, rounds, {3: 8})  # no transits: its lateness decides
    # 4 ranks of npdde: rank 1's only pair measured both ways is with rank 3; what is typical is
    # measured between the fast ranks (else a link 33 ms slower would pass for normal).
    assert 3 in choose_slow(delays, counts, rounds, {3: 8}, transits(slow_rank_delays(4, 3, 0.035)), busy)


def test_thinned_edges_carry_once_per_period_at_moving_places_and_the_rest_every_round():
    routing = SlowLinkRouting(4, 0)
    routing.slow = {3: 4}
    carried = [rnd for rnd in range(16) if routing.carries(3, 0, rnd)]
    assert len(carried) == 4 and len({rnd % 4 for rnd in carried}) == 4
    assert all(routing.carries(1, 2, rnd) for rnd in range(16))
    graph = make_graph("npdde", 4)
    for rnd in range(8):  # what one rank sends is what the others expect, deferred or not
        for src in range(4):
            sends, _, _ = SlowLinkRouting.split(_at(routing, src), graph.out_peers(src, rnd),
                                                graph.in_peers(src, rnd), rnd)
            for dst in sends:
                _, waits, deferred = SlowLinkRouting.split(_at(routing, dst), graph.out_peers(dst, rnd),
                                                           graph.in_peers(dst, rnd), rnd)
                assert (src in deferred) == (3 in (src, dst)) and (src in waits) == (3 not in (src, dst))


def _at(routing: SlowLinkRouting, rank: int) -> SlowLinkRouting:
    other = SlowLinkRouting(routing.size, rank)
    other.slow = dict(routing.slow)
    return other


def rows_of(delays: np.ndarray, counts: np.ndarray, transits: np.ndarray, round_seconds: np.ndarray,
            busy: np.ndarray) -> np.ndarray:
    """What gather_rows gives routing.decide: rank b's row holds what it measured on its
    in-edges (column b of each matrix) and its own seconds."""
    return np.concatenate([delays.T, counts.T, transits.T, round_seconds[:, None], busy[:, None]], axis=1)


def test_bad_measurements_are_left_out_never_raised(caplog):
    """A gathered array of the wrong shape is a programming error; one rank's NaN, inf or
    negative count is its own row dropped with a warning that names it, in every rank's step
    alike (issue 37: one NaN used to raise in every rank's step)."""
    routing = SlowLinkRouting(4, 0)
    with pytest.raises(ValueError, match="gathered measurements"):
        routing.decide(np.zeros((4, 3)), 32, 0.0)
    delays, counts = measured(4, {})
    rows = rows_of(delays, counts, delays, np.full(4, 0.01), np.full(4, 0.01))
    for bad in (np.nan, np.inf, -5.0):
        rows[1, 4 + 2] = bad  # rank 1's count of messages from rank 2
        with caplog.at_level("WARNING", logger="bps_gossip"):
            routing.decide(rows, 32, 0.0)
        assert "ranks [1] reported values that are not finite or out of range" in caplog.text
        caplog.clear()
    assert routing.slow == {}


def slow_job(n: int, slow: int, seed: int) -> tuple[FakeNetwork, list[np.ndarray], list[GossipAverager]]:
    """n ranks in process, every message to or from ``slow`` 100 ms late (twice
    ENTER_FLOOR); random starting x."""
    network = FakeNetwork(n, slow={slow: 0.1})
    rng = np.random.RandomState(seed)
    x0 = [rng.randn(6) for _ in range(n)]
    return network, x0, [GossipAverager({"w": x0[r]}, graph="npdde", tag="r", link=network.link(r))
                         for r in range(n)]


def test_push_sum_routes_around_a_slow_rank_and_stays_exact():
    """Every message to or from rank 3 takes 100 ms: after the first window the ranks agree that
    it is slow; nobody waits for its edges; the mass (held plus in flight) never changes and
    the exact average is still reached."""
    n, slow = 4, 3
    network, x0, averagers = slow_job(n, slow, seed=0)

    def body(rank):
        avg = averagers[rank]
        for _ in range(160):
            avg.step()
            assert sum(1 for pending in avg.owed if pending.sources == [slow]) <= MAX_OWED + 1
        owned = avg.owns_x
        avg.drain()
        return avg.routing.history, owned

    results = run_ranks(n, body, timeout=100)
    histories = [history for history, _ in results]
    assert all(history == histories[0] for history in histories)  # one decision, taken together
    assert histories[0] and slow in histories[0][0][1] and all(owned for _, owned in results)
    for timer in network.timers:
        timer.join(5)
    for avg in averagers:  # whatever was still on the way to a rank that had finished
        avg.drain()
    assert not network.in_flight
    assert sum(avg.weight for avg in averagers) == pytest.approx(n, rel=1e-9)
    held = sum(avg.x["w"] for avg in averagers)
    np.testing.assert_allclose(held, sum(x0), rtol=1e-9)
    run_ranks(n, lambda rank: averagers[rank].average_exactly())
    for avg in averagers:
        np.testing.assert_allclose(avg.model()["w"], sum(x0) / n, rtol=1e-9)


def test_when_the_slow_link_recovers_routing_ends_with_every_weight_one():
    """The slow rank's link recovers: the ranks agree it is fast again, average exactly once
    (every weight 1, nothing in flight) and stop sending weights: x may be the model's memory."""
    n = 4
    network, x0, averagers = slow_job(n, 2, seed=1)

    def body(rank):
        avg = averagers[rank]
        for _ in range(40):
            avg.step()
        assert avg.owns_x
        network.slow = {}  # every rank sees it by its next message at the latest
        for _ in range(400):
            avg.step()
            if not avg.routing.slow:
                break
        return avg.routing.history, avg.rnd

    results = run_ranks(n, body, timeout=100)
    assert len({rnd for _, rnd in results}) == 1 and all(h == results[0][0] for h, _ in results)
    assert results[0][0][-1][1] == {}, results[0][0]
    for avg in averagers:
        assert not avg.owns_x and avg.weight == 1.0 and not avg.owed and not avg.gossiper.track_weight
    np.testing.assert_allclose(sum(avg.x["w"] for avg in averagers), sum(x0), rtol=1e-9)
    averagers[0].use_buffers({"w": averagers[0].x["w"].copy()})  # allowed again


def test_routing_can_be_turned_off_and_is_off_for_two_ranks():
    network = FakeNetwork(4)
    assert GossipAverager({"w": np.zeros(2)}, link=network.link(0), route_slow_links=False).routing is None
    assert GossipAverager({"w": np.zeros(2)}, link=FakeNetwork(2).link(0)).routing is None
    with pytest.raises(ValueError, match="route_slow_links"):
        GossipAverager({"w": np.zeros(2)}, link=network.link(0), route_slow_links="yes")


def test_a_slow_rank_with_too_few_messages_is_kept_and_its_measurements_go_on():
    """Thinned edges carry few messages a window: a slow rank is judged only once MIN_MESSAGES
    came each way, and until then its edges' measurements add up across windows."""
    routing = SlowLinkRouting(4, 0)
    routing.slow = {2: 8}
    routing.record(2, 0.3)  # one message from the slow rank
    routing.record(1, 0.001)
    delays, counts = measured(4, {})
    delays[2, :] = counts[2, :] = 0
    delays[2, 0], counts[2, 0] = 0.3, 1
    n = 4
    assert not routing.decide(rows_of(delays, counts, delays, np.full(n, 0.01), np.full(n, 0.01)), 32, 1.0)  # kept
    assert routing.slow == {2: 8} and 2 not in routing.scores
    assert routing.messages(2, 0) == 1 and routing.messages(1, 0) == 0  # carried; the rest starts again
    assert MIN_MESSAGES > 1
