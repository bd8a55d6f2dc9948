"""Gossip invariants on real processes: mass conservation, exact averaging, de-biasing,
and a dead peer failing the round (GossipAverager over the workers' peer channel). The workers
run tests/jobs/gossip_job.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cluster import assert_all_ok

pytestmark = pytest.mark.paths  # the newest Python of .ci/pythons runs these too

GRAPHS = ["npdde", "dde", "bipartite-exp", "linear", "bipartite-linear", "ring"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,shm", [(3, "1"), (4, "1"), (3, "0")], ids=["3-shm", "4-shm", "3-tcp"])
def test_mass_conservation_every_graph_with_and_without_overlap(cluster, workers, shm):
    """Payloads between peers on one host go through shared memory, or over TCP with BPS_GOSSIP_SHM=0."""
    job = cluster(workers, env={"BPS_GOSSIP_SHM": shm})
    done = job.run_job("gossip_job", "mass_conservation", *GRAPHS)
    assert_all_ok(done, job)
    results = [f.result for f in done]
    w0 = np.linspace(-1, 1, 7)
    mean_grad = np.mean([np.arange(7) * 0.1 + r for r in range(workers)], axis=0)
    exact = w0 - 0.05 * 6 * mean_grad
    assert all(r.pop("shared_memory") == (shm == "1") for r in results)
    for tag in results[0]:
        if isinstance(results[0][tag], str):
            continue
        xs = np.array([r[tag][0] for r in results])
        ws = np.array([r[tag][1] for r in results])
        zs = np.array([r[tag][2] for r in results])
        assert np.allclose(xs.sum(axis=0) / ws.sum(), exact, atol=1e-12), tag
        assert math.isclose(ws.sum(), workers, rel_tol=1e-12), tag
        assert np.allclose(zs.mean(axis=0), exact, atol=1e-12), tag  # regular graphs: w back to 1 after flush
    job.wait_servers_exit()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,peers,rounds", [(2, 1, 1), (4, 1, 2), (8, 1, 3), (9, 2, 2)])
def test_exact_average_after_log_rounds(cluster, workers, peers, rounds):
    job = cluster(workers)
    done = job.run_job("gossip_job", "exact_average", peers, rounds)
    assert_all_ok(done, job)
    expected = np.mean([r * 3 + 1 for r in range(workers)])
    for f in done:
        assert np.allclose(f.result, expected, rtol=0, atol=1e-12), (f.rank_hint, f.result, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [3, 5, 6])
def test_geometric_convergence_other_sizes(cluster, workers):
    job = cluster(workers)
    done = job.run_job("gossip_job", "geometric_convergence")
    assert_all_ok(done, job)
    for f in done:
        d = f.result
        # geometric: the worst distance of each window of 6 rounds (a multiple of every period
        # here) is at most half that of the window before
        windows = [max(d[t:t + 6]) for t in range(0, 18, 6)]
        assert all(later < 0.5 * earlier for earlier, later in zip(windows, windows[1:])), d


@pytest.mark.timeout(120)
def test_push_sum_debiasing_on_irregular_schedule(cluster):
    job = cluster(3)
    done = job.run_job("gossip_job", "push_sum_irregular")
    assert_all_ok(done, job)
    true_average = (0 + 6 + 12) / 3
    numerators = [f.result[0] for f in done]
    for f in done:
        assert f.result[2] == pytest.approx(true_average, abs=1e-9)
    assert not all(n == pytest.approx(true_average, abs=1e-3) for n in numerators), numerators
    assert sum(f.result[1] for f in done) == pytest.approx(3.0)


@pytest.mark.timeout(120)
def test_dead_peer_fails_the_round_with_its_rank(cluster):
    job = cluster(3)
    done = job.run_job("gossip_job", "dead_peer")
    survivors = [f for f in done if f.rank_hint != 1]
    for f in survivors:
        assert f.returncode == 0, job.dump()
        kind, message, seconds = f.result
        assert kind in ("PeerLostError", "CommTimeoutError"), message
        assert "rank 1" in message
        assert seconds < 8
