"""Gossip in one process over a fake link (tests/fakes.py): graphs, mixing weights, push-sum's
mass balance and exact averaging, push-pull, CHOCO. No sockets, no processes."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
from fakes import FakeNetwork, run_ranks

from bps_gossip import futures
from bps_gossip.compression import CompressionSpec
from bps_gossip.errors import CommTimeoutError, NotInitializedError
from bps_gossip.gossip import GRAPHS, ExplicitGraph, UniformMixing, make_graph
from bps_gossip.gossip import link as gossip_link
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.gossip.choco import ChocoAverager, plan_pieces
from bps_gossip.gossip.graphs import exponential_phases, symmetric_mixing_is_doubly_stochastic

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16]


def graphs_named(name):
    """Every buildable (size, peers_per_itr) variant of a named graph."""
    for size in SIZES:
        for peers in (1, 2, 3):
            try:
                yield make_graph(name, size, peers)
            except ValueError:
                continue


def rounds(graph):
    return range(2 * graph.period)


# -- graphs ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_out_and_in_peers_agree_on_every_rank(name):
    for graph in graphs_named(name):
        n = graph.world_size
        for rnd in rounds(graph):
            outs = {r: graph.out_peers(r, rnd) for r in range(n)}
            for rank, out in outs.items():
                assert out == sorted(set(out)) and rank not in out and all(0 <= p < n for p in out), (graph, rnd)
            for rank in range(n):
                senders = sorted(src for src in range(n) if rank in outs[src])
                assert graph.in_peers(rank, rnd) == senders, (graph, rank, rnd)
                assert graph.symmetric_peers(rank, rnd) == sorted(set(outs[rank]) | set(senders))
                assert graph.out_peers(rank, rnd + graph.period) == outs[rank], (graph, "period")


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_schedule_is_the_same_on_every_rank(name):
    """Each rank builds its own graph: every copy gives the same schedule."""
    for graph in graphs_named(name):
        copies = [make_graph(name, graph.world_size, graph.peers_per_itr) for _ in range(3)]
        for rnd in rounds(graph):
            for rank in range(graph.world_size):
                assert {tuple(c.out_peers(rank, rnd)) for c in copies} == {tuple(graph.out_peers(rank, rnd))}
        assert {(c.period, c.is_regular, c.is_bipartite) for c in copies} == {
            (graph.period, graph.is_regular, graph.is_bipartite)}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_flags_hold(name):
    for graph in graphs_named(name):
        n = graph.world_size
        for rnd in range(graph.period):
            if graph.is_regular:
                degrees = {(len(graph.out_peers(r, rnd)), len(graph.in_peers(r, rnd))) for r in range(n)}
                assert len(degrees) == 1 and all(o == i for o, i in degrees), (graph, rnd, degrees)
            if graph.is_bipartite:
                assert all((r + p) % 2 == 1 for r in range(n) for p in graph.out_peers(r, rnd)), graph
            if name.startswith("bipartite"):
                assert all(graph.out_peers(r, rnd) == graph.in_peers(r, rnd) for r in range(n)), graph
        assert graph.is_dynamic == (graph.period > 1)


def test_which_graphs_are_regular():
    """Circulant graphs always; bipartite ones unless an odd world leaves a rank idle."""
    for name in GRAPHS:
        for graph in graphs_named(name):
            odd = graph.world_size % 2 == 1 and graph.world_size > 1
            assert graph.is_regular == (not (name.startswith("bipartite") and odd)), graph
    star = ExplicitGraph(4, [{1: [0], 2: [0], 3: [0], 0: [1]}])
    assert not star.is_regular


def test_graph_errors():
    with pytest.raises(ValueError, match="unknown gossip graph"):
        make_graph("nope", 4)
    with pytest.raises(ValueError, match="peers_per_itr"):
        make_graph("bipartite-exp", 4, 2)
    with pytest.raises(ValueError, match="dde"):
        make_graph("dde", 4, 2)
    with pytest.raises(ValueError, match="world_size"):
        make_graph("ring", 0)
    with pytest.raises(ValueError, match="outside"):
        ExplicitGraph(2, [{0: [5]}])


def test_exponential_phases_are_exact_integers():
    assert [exponential_phases(n, 2) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    assert exponential_phases(3 ** 5, 3) == 5 and exponential_phases(3 ** 5 + 1, 3) == 6


# -- mixing ----------------------------------------------------------------------------
def push_sum_matrix(graph, rnd, mixing=None):
    """Column j: where rank j's mass goes in round rnd."""
    mixing = mixing or UniformMixing()
    n = graph.world_size
    matrix = np.zeros((n, n))
    for src in range(n):
        kept, shares = mixing.weights(src, graph.out_peers(src, rnd))
        matrix[src, src] = kept
        for dst, share in shares.items():
            matrix[dst, src] += share
    return matrix


def test_uniform_mixing_weights_sum_to_one():
    mixing = UniformMixing()
    for degree in range(10):
        peers = list(range(1, degree + 1))
        kept, shares = mixing.weights(0, peers)
        assert sorted(shares) == peers
        assert kept + sum(shares.values()) == pytest.approx(1.0, abs=1e-15)
        assert all(share == kept for share in shares.values())


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_push_sum_matrix_is_column_stochastic(name):
    for graph in graphs_named(name):
        for rnd in range(graph.period):
            np.testing.assert_allclose(push_sum_matrix(graph, rnd).sum(axis=0), 1.0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_symmetric_mixing_check_matches_the_matrix(name):
    """symmetric_mixing_is_doubly_stochastic says True exactly when push-pull's matrix is."""
    for graph in graphs_named(name):
        doubly = True
        for rnd in range(graph.period):
            n = graph.world_size
            matrix = np.zeros((n, n))
            for rank in range(n):
                peers = graph.symmetric_peers(rank, rnd)
                matrix[rank, [rank, *peers]] = 1.0 / (len(peers) + 1)
            np.testing.assert_allclose(matrix.sum(axis=1), 1.0, atol=1e-12)
            doubly = doubly and np.allclose(matrix.sum(axis=0), 1.0, atol=1e-12)
        assert symmetric_mixing_is_doubly_stochastic(graph) == doubly, graph


@pytest.mark.parametrize("name,peers,n", [("dde", 1, 8), ("npdde", 1, 16), ("npdde", 2, 9), ("npdde", 3, 16)])
def test_exponential_graph_averages_exactly_in_its_phases(name, peers, n):
    graph = make_graph(name, n, peers)
    product = np.eye(n)
    for rnd in range(exponential_phases(n, peers + 1)):
        product = push_sum_matrix(graph, rnd) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1.0 / n), atol=1e-12)


# -- push-sum over the fake network ------------------------------------------------------
def starts(n, length=4):
    """Integer-valued starting points: their averages by halving are exact in floating point."""
    return [np.arange(length, dtype=np.float64) * (rank + 1) + 3 * rank for rank in range(n)]


@pytest.mark.parametrize("local", [1, 2], ids=["remote", "shared-memory"])
@pytest.mark.parametrize("graph", ["dde", "npdde"])
def test_push_sum_reaches_the_exact_average_in_log2_n_rounds(graph, local):
    n = 8
    network = FakeNetwork(n, local=local)
    x0 = starts(n)
    mean = np.mean(x0, axis=0)
    links = network.links()

    def body(rank):
        avg = GossipAverager({"w": x0[rank]}, graph=graph, tag="g", link=links[rank])
        for _ in range(3):
            avg.step()
        return avg.model()["w"], avg.weight

    for model, weight in run_ranks(n, body):
        assert weight == 1.0
        np.testing.assert_array_equal(model, mean)
    assert not network.in_flight and not network.unacked
    assert (sum(link.scaled_sends for link in links) > 0) == (local > 1)


@pytest.mark.parametrize("graph,n", [("ring", 5), ("npdde", 6), ("linear", 4), ("bipartite-exp", 6)])
def test_push_sum_keeps_the_mass_every_round(graph, n):
    """Closed rounds: at a barrier after each step nothing is in flight and sum(x) is the start."""
    network = FakeNetwork(n, local=2)
    x0 = starts(n)
    total = np.sum(x0, axis=0)
    failures = []

    def check():
        held = np.sum([avg.x["w"] for avg in averagers], axis=0)
        if network.in_flight or not np.allclose(held, total, rtol=1e-12):
            failures.append((held, total))

    barrier = threading.Barrier(n, action=check)
    averagers = [GossipAverager({"w": x0[r]}, graph=graph, tag="m", link=network.link(r)) for r in range(n)]

    def body(rank):
        for _ in range(60):
            averagers[rank].step()
            barrier.wait()

    run_ranks(n, body)
    assert not failures
    for avg in averagers:
        np.testing.assert_allclose(avg.model()["w"], total / n, rtol=1e-3)


@pytest.mark.parametrize("synch_freq,every", [(0, 1), (1, 2), (3, 4)])
def test_overlapped_push_sum_keeps_mass_in_flight_and_converges(synch_freq, every):
    """Rounds stay open: x and w held plus what is in flight is the start, at every step; the
    network holds messages for ``every`` steps (no more than synch_freq + 1 rounds open)."""
    n = 8
    network = FakeNetwork(n, local=2, hold=True)
    x0 = starts(n)
    total = np.sum(x0, axis=0).sum()
    averagers = [GossipAverager({"w": x0[r]}, graph="npdde", overlap=True, synch_freq=synch_freq, tag="o",
                                link=network.link(r), route_slow_links=False)  # stepped in one thread
                 for r in range(n)]
    for step in range(150):
        for avg in averagers:  # lockstep: each step only absorbs rounds already delivered
            avg.step()
            assert len(avg.open) <= synch_freq + 1
        held = sum(float(avg.x["w"].sum()) for avg in averagers)
        assert held + network.in_flight_sum() == pytest.approx(total, rel=1e-12)
        weight = sum(avg.weight for avg in averagers)
        assert weight + network.in_flight_weight() == pytest.approx(n, rel=1e-12)
        if step % every == every - 1:
            network.deliver()
    network.deliver()
    for avg in averagers:
        avg.flush()
    assert not network.in_flight and not network.unacked
    assert sum(avg.weight for avg in averagers) == pytest.approx(n, rel=1e-12)
    mean = np.mean(x0, axis=0)
    for avg in averagers:
        np.testing.assert_allclose(avg.model()["w"], mean, rtol=1e-6)


def test_push_sum_on_an_irregular_graph_tracks_the_weight():
    """A star (everyone sends to 0, 0 to 1): the weights differ, z = x / w still averages."""
    n = 4
    star = ExplicitGraph(n, [{1: [0], 2: [0], 3: [0], 0: [1]}, {0: [1, 2, 3], 1: [2], 2: [3], 3: [1]}])
    network = FakeNetwork(n)
    x0 = starts(n)

    def body(rank):
        avg = GossipAverager({"w": x0[rank]}, graph=star, tag="s", link=network.link(rank))
        for _ in range(80):
            avg.step()
        return avg

    averagers = run_ranks(n, body)
    assert sum(avg.weight for avg in averagers) == pytest.approx(n)
    assert len({round(avg.weight, 6) for avg in averagers}) > 1
    for avg in averagers:
        np.testing.assert_allclose(avg.model()["w"], np.mean(x0, axis=0), rtol=1e-6)


# -- push-pull (D-PSGD) ----------------------------------------------------------------
@pytest.mark.parametrize("graph,n", [("ring", 5), ("bipartite-exp", 8), ("bipartite-linear", 6)])
def test_push_pull_keeps_the_average(graph, n):
    network = FakeNetwork(n, local=2)
    x0 = starts(n)
    total = np.sum(x0, axis=0)
    failures = []
    averagers = [GossipAverager({"w": x0[r]}, graph=graph, push_sum=False, tag="pp", link=network.link(r))
                 for r in range(n)]

    def check():
        held = np.sum([avg.x["w"] for avg in averagers], axis=0)
        if not np.allclose(held, total, rtol=1e-12):
            failures.append(held)

    barrier = threading.Barrier(n, action=check)

    def body(rank):
        for _ in range(40):
            averagers[rank].step()
            barrier.wait()

    run_ranks(n, body)
    assert not failures and not network.in_flight
    for avg in averagers:
        assert avg.weight == 1.0
        np.testing.assert_allclose(avg.x["w"], total / n, rtol=1e-4)


def test_push_pull_refuses_irregular_neighbourhoods():
    star = ExplicitGraph(4, [{1: [0], 2: [0], 3: [0]}])
    with pytest.raises(ValueError, match="push_sum=False"):
        GossipAverager({"w": np.zeros(2)}, graph=star, push_sum=False, link=FakeNetwork(4).link(0))
    with pytest.raises(ValueError, match="overlap=True needs push_sum=True"):
        GossipAverager({"w": np.zeros(2)}, graph="ring", push_sum=False, overlap=True, link=FakeNetwork(4).link(0))
    with pytest.raises(ValueError, match="the graph is for 3 workers"):
        GossipAverager({"w": np.zeros(2)}, graph=make_graph("ring", 3), link=FakeNetwork(4).link(0))
    with pytest.raises(TypeError, match="floating point"):
        GossipAverager({"w": np.zeros(2, np.int32)}, link=FakeNetwork(4).link(0))


# -- the exact collectives through the (fake) servers ---------------------------------------
def test_average_exactly_and_consensus_distance():
    n = 4
    network = FakeNetwork(n, hold=True)
    x0 = starts(n)
    mean = np.mean(x0, axis=0)

    def body(rank):
        avg = GossipAverager({"w": x0[rank]}, graph="npdde", overlap=True, tag="e", link=network.link(rank))
        before = avg.consensus_distance()
        avg.step()  # one round left open (held by the network): average_exactly flushes it
        network.deliver()
        avg.drain()
        z = avg.debiased()["w"].copy()  # what the ranks hold before the average
        drift = avg.average_exactly(measure=True)
        return before, avg.weight, avg.x["w"], avg.consensus_distance(), z, drift

    results = run_ranks(n, body)
    # the measured drift: RMS over ranks and elements of z - average, the same on every rank
    expected = np.sqrt(np.mean([np.mean((z - mean) ** 2) for *_, z, _ in results]))
    for before, weight, x, after, _, drift in results:
        assert before > 1 and weight == 1.0 and after == pytest.approx(0.0, abs=1e-12)
        np.testing.assert_allclose(x, mean, rtol=1e-12)
        assert drift == pytest.approx(expected, rel=1e-9) and drift > 0.1


# -- CHOCO ----------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [{"compressor": "topk", "k": 0.25}, {"compressor": "dithering", "k": 4, "seed": 1}],
                         ids=["topk", "dithering"])
def test_choco_keeps_the_sum_and_reaches_consensus(params):
    n = 3
    network = FakeNetwork(n)
    x0 = [np.random.default_rng(rank).normal(size=64).astype(np.float32) for rank in range(n)]
    total = np.sum(x0, axis=0, dtype=np.float64)

    def body(rank):
        avg = ChocoAverager({"w": x0[rank]}, CompressionSpec(**params), gamma=0.2, tag="c", link=network.link(rank))
        start = avg.consensus_distance()
        for _ in range(150):
            avg.step()
        return avg.x["w"], start, avg.consensus_distance()

    results = run_ranks(n, body)
    np.testing.assert_allclose(np.sum([x for x, _, _ in results], axis=0, dtype=np.float64), total, atol=1e-3)
    for _, start, end in results:
        assert end < start / 50


def test_choco_pieces_follow_the_parts_split_at_partitions_and_leave_small_ones_raw():
    spec = CompressionSpec(compressor="onebit", scaling=True)
    pieces = plan_pieces([10, 100, 3], 4, spec, min_compress_bytes=40, partition_bytes=256)
    assert [(p.start, p.stop) for p in pieces] == [(0, 10), (10, 74), (74, 110), (110, 113)]
    assert [p.codec is None for p in pieces] == [False, False, False, True]  # 3 * 4 bytes < 40
    assert all(p.offset % 8 == 0 for p in pieces)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(pieces, pieces[1:]))
    assert pieces[-1].nbytes == 12  # three raw float32


def test_choco_default_consensus_step_is_the_compressors():
    link = FakeNetwork(1).link(0)
    steps = {name: ChocoAverager({"w": np.ones(8)}, CompressionSpec(compressor=name, k=2), link=link).gamma
             for name in ("topk", "randomk", "dithering")}
    assert steps == {"topk": 0.2, "randomk": 0.05, "dithering": 0.2}
    l2 = CompressionSpec(compressor="dithering", k=2, l2=True)
    assert ChocoAverager({"w": np.ones(8)}, l2, link=link).gamma == 0.05
    assert ChocoAverager({"w": np.ones(8)}, CompressionSpec(compressor="randomk", k=2), 0.5, link=link).gamma == 0.5


def test_choco_compresses_every_part_on_its_own_scale():
    """onebit's one scale per piece: small weights beside large ones (BatchNorm's running
    variances beside conv weights) reach consensus when each part has its own scale; as one
    buffer, the large part's scale swamps them and they drift 10x further apart."""
    n = 3
    rngs = [np.random.default_rng(rank) for rank in range(n)]
    x0 = [np.concatenate([1000 + 100 * r.normal(size=256), 1e-3 * r.normal(size=256)]).astype(np.float32)
          for r in rngs]

    def small_parts_distance(parts):
        network = FakeNetwork(n)

        def body(rank):
            avg = ChocoAverager({"w": x0[rank]}, CompressionSpec(compressor="onebit", scaling=True), gamma=0.2,
                                tag="c", link=network.link(rank), parts=parts)
            for _ in range(150):
                avg.step()
            return avg.x["w"][256:]

        small = np.array(run_ranks(n, body), dtype=np.float64)
        return float(np.sqrt(((small - small.mean(axis=0)) ** 2).mean()))

    start = float(np.sqrt(((np.array(x0)[:, 256:] - np.mean(x0, axis=0)[256:]) ** 2).mean()))
    apart = small_parts_distance({"w": [256, 256]})
    assert apart < start / 10
    assert small_parts_distance(None) > 10 * apart


def test_choco_scales_l2_dithering_down_to_a_contraction():
    """L2-normalized dithering errs by up to sqrt(n) / s times what it compresses: unscaled, the
    public copies run away (distance 0.8 -> 2e19 in 300 rounds); scaled by 1 / (1 + omega) they
    converge."""
    n = 3
    network = FakeNetwork(n)
    x0 = [np.random.default_rng(rank).normal(size=4096).astype(np.float32) for rank in range(n)]

    def body(rank):
        spec = CompressionSpec(compressor="dithering", k=2, l2=True, seed=1)
        avg = ChocoAverager({"w": x0[rank]}, spec, tag="c", link=network.link(rank))
        assert avg.pieces["w"][0].scale == pytest.approx(1 / (1 + 32))  # omega = min(4096 / 4, 64 / 2)
        start = avg.consensus_distance()
        for _ in range(300):
            avg.step()
        return start, avg.consensus_distance()

    for start, end in run_ranks(n, body):
        assert end < start / 4


def test_choco_uncompressed_pieces_reach_the_exact_average():
    n = 3
    network = FakeNetwork(n)
    x0 = [np.random.default_rng(rank).normal(size=40) for rank in range(n)]

    def body(rank):
        avg = ChocoAverager({"w": x0[rank]}, CompressionSpec(compressor="topk", k=0.5), gamma=0.5, tag="c",
                            link=network.link(rank), parts={"w": [30, 10]}, min_compress_bytes=1 << 20)
        for _ in range(60):
            avg.step()
        return avg.x["w"]

    for x in run_ranks(n, body):
        np.testing.assert_allclose(x, np.mean(x0, axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["size", "nan"])
def test_choco_refuses_a_message_of_another_size_or_not_finite(bad):
    network = FakeNetwork(2)

    def body(rank):
        x = np.ones(16, np.float32)
        k = 0.25
        if rank == 1 and bad == "size":
            k = 0.5
        if rank == 1 and bad == "nan":
            x[3] = np.nan
        avg = ChocoAverager({"w": x}, CompressionSpec(compressor="topk", k=k), tag="c", link=network.link(rank),
                            min_compress_bytes=1 << 20 if bad == "nan" else 0)
        avg.step()

    with pytest.raises(ValueError, match="rank 1 sent" if bad == "size" else "not finite"):
        run_ranks(2, lambda rank: body(rank) if rank == 0 else _quietly(body, rank))


def _quietly(body, rank):
    """Rank 1's own round (it may fail on rank 0's message too): only rank 0's error is tested."""
    try:
        body(rank)
    except ValueError:
        pass


# -- the default link ---------------------------------------------------------------------
def test_default_link_comes_from_the_registered_provider():
    network = FakeNetwork(2)
    fake = network.link(1)
    saved = gossip_link._provider
    try:
        gossip_link.set_default_link_provider(lambda: fake)
        avg = GossipAverager({"w": np.zeros(3)}, graph="ring")
        assert avg.link is fake and avg.rank == 1 and avg.size == 2
        gossip_link.set_default_link_provider(None)
        with pytest.raises(NotInitializedError, match="link"):
            GossipAverager({"w": np.zeros(3)})
    finally:
        gossip_link.set_default_link_provider(saved)


def test_a_round_that_never_arrives_is_a_comm_timeout():
    network = FakeNetwork(2)
    never = network.link(0).expect("t", 0, [1])
    with pytest.raises(CommTimeoutError, match="'t' round 0"):
        futures.wait(never, 0.01, "gossip 't' round 0")
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(CommTimeoutError("engine gave up"))
    with pytest.raises(CommTimeoutError, match="engine gave up"):
        futures.wait(failed, 1.0, "x")
