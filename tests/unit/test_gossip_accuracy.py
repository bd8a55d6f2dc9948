"""Gossip trains as well as allreduce on every rank: 16 ranks in one process (tests/fakes.py's
network), a numpy MLP on scikit-learn's digits, disjoint shards, SGD with momentum; one rank
whose every message takes 60 ms, so that the ranks route around it (nobody waits for its edges,
which carry a message every few rounds). Each rank's test accuracy is compared with the
same training by allreduce (the gradients averaged exactly every step).

The failures this guards against, seen at 16 workers on one 2-core host
(docs/performance-gossip.md): a rank whose in-peers' messages were deferred held a push-sum weight
of 1/64, its whole local step moved z = x / w 64x too far and it diverged; and the rank
routed around lagged the others by 2-5 points of accuracy.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeNetwork, run_ranks

from bps_gossip.gossip.averager import GossipAverager

pytest.importorskip("sklearn")

RANKS, HIDDEN, BATCH, LR, MOMENTUM = 16, 32, 16, 0.1, 0.9
STEPS = 150
# Rank 0's in-peers in npdde's four phases (15, 14, 12, 8): once all are routed around, rank 0
# receives only deferred messages, and its push-sum weight halves every round until they arrive.
MANY_SLOW, DELAY = (8, 12, 14, 15), 0.05


def digits():
    """Digits in [0, 1]: 1,500 training and 297 test images (the example's split)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float64), data.target.astype(np.int64)
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def unpack(w):
    """The MLP's four arrays, as views of the flat model."""
    sizes = [64 * HIDDEN, HIDDEN, HIDDEN * 10, 10]
    parts = np.split(w, np.cumsum(sizes)[:-1])
    return parts[0].reshape(64, HIDDEN), parts[1], parts[2].reshape(HIDDEN, 10), parts[3]


def initial():
    rng = np.random.RandomState(1)
    w1 = rng.uniform(-1, 1, (64, HIDDEN)) * np.sqrt(6 / (64 + HIDDEN))
    w2 = rng.uniform(-1, 1, (HIDDEN, 10)) * np.sqrt(6 / (HIDDEN + 10))
    return np.concatenate([w1.ravel(), np.zeros(HIDDEN), w2.ravel(), np.zeros(10)])


def gradient(w, x, y):
    """The mean softmax cross-entropy's gradient of a batch."""
    w1, b1, w2, b2 = unpack(w)
    hidden = np.maximum(x @ w1 + b1, 0)
    logits = hidden @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    dhidden = (p @ w2.T) * (hidden > 0)
    return np.concatenate([(x.T @ dhidden).ravel(), dhidden.sum(0), (hidden.T @ p).ravel(), p.sum(0)])


def accuracy(w, x, y):
    w1, b1, w2, b2 = unpack(w)
    return float(((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(axis=1) == y).mean())


def train(mode, slow_ranks=(RANKS - 1,)):
    """Every rank's final test accuracy, and the ranks gossip routed around (none in allreduce)."""
    x_train, y_train, x_test, y_test = digits()
    network = FakeNetwork(RANKS, slow=dict.fromkeys(slow_ranks, DELAY))
    link_of = network.links()

    def body(rank):
        link = link_of[rank]
        x, y = x_train[rank::RANKS], y_train[rank::RANKS]
        rng = np.random.RandomState(rank)
        w, velocity = initial(), np.zeros_like(initial())
        avg = GossipAverager({"w": w}, graph="npdde", tag="acc", link=link) if mode == "gossip" else None
        slow = set()
        for _ in range(STEPS):
            batch = rng.choice(len(x), BATCH, replace=False)
            z = avg.model()["w"].copy() if avg else w
            grad = gradient(z, x[batch], y[batch])
            if avg is None:  # allreduce: the exact mean gradient
                grad = link.push_pull(grad, "grad", average=True)
            velocity = MOMENTUM * velocity + grad
            if avg is None:
                w = w - LR * velocity
                continue
            avg.apply_update({"w": z}, {"w": z - LR * velocity})
            avg.step()
            slow |= set(avg.routing.slow)
        if avg is not None:
            avg.flush()
            w = avg.model()["w"]
        return accuracy(w, x_train, y_train), slow

    results = run_ranks(RANKS, body, timeout=120)
    for timer in network.timers:
        timer.join(5)
    return [acc for acc, _ in results], set().union(*(slow for _, slow in results))


@pytest.mark.timeout(180)
def test_sixteen_ranks_around_a_slow_rank_train_as_well_as_allreduce():
    """Training-set accuracy after 150 steps (allreduce 0.978): measured over 6 runs the mean
    over ranks 0.967-0.970, the worst rank 0.939-0.960."""
    exact, _ = train("allreduce")
    assert len(set(exact)) == 1 and exact[0] > 0.95  # one model, trained
    gossip, routed = train("gossip")
    assert routed == {RANKS - 1}, routed  # the slow rank was routed around
    assert np.mean(gossip) >= exact[0] - 0.02, (exact[0], sorted(gossip))
    assert min(gossip) >= exact[0] - 0.06, (exact[0], sorted(gossip))


@pytest.mark.timeout(180)
def test_no_rank_diverges_when_all_its_in_peers_are_routed_around():
    """Rank 0's in-peers are all slow: its weight halves every round until their messages come.
    With the whole step in x at any weight one of two runs diverged (a rank at 0.10). The worst rank
    depends on the machine's load (the slow links are timers): 0.78-0.95 in 12 runs six at a time,
    0.74 once in a full test run; 0.5 still tells divergence from that."""
    gossip, routed = train("gossip", MANY_SLOW)
    assert routed, "no rank was routed around"
    assert min(gossip) >= 0.5, sorted(gossip)


def test_a_local_step_moves_z_by_at_most_twice_the_step():
    network = FakeNetwork(2)
    for weight, moved in ((1 / 64, 1.0), (0.5, 1.0), (0.8, 0.5 / 0.8), (2.0, 0.25)):
        avg = GossipAverager({"w": np.ones(3)}, graph="npdde", tag=f"s{weight}", link=network.link(0))
        avg.weight = weight
        avg.x["w"] *= weight  # the same z, another weight (messages on their way, or mass kept)
        z = avg.debiased()["w"]
        avg.apply_update({"w": z}, {"w": z + 0.5})
        # w < 1/2: 2w of the step in x (z moves 2 x 0.5); above, the whole step (z moves 0.5 / w)
        np.testing.assert_allclose(avg.debiased()["w"] - z, moved)


def test_a_slow_ranks_edge_carries_three_quarters_of_the_senders_mass():
    network = FakeNetwork(3, hold=True)
    avg = GossipAverager({"w": np.ones(4)}, graph="npdde", tag="h", link=network.link(0))
    avg.routing.slow = {1: 2}
    avg.gossiper.track_weight = True  # as routing sets it when it finds a slow rank
    sends = [peer for peer in (1, 2) if avg.routing.carries(0, peer, 0)]
    assert avg.routing.heavy(sends) == {1: 3.0} and avg.routing.heavy([2]) == {}
    pending, kept = avg.gossiper.begin(0, avg.x, 1.0, out_peers=[1], sources=[], heavy={1: 3.0})
    assert kept == pytest.approx(0.25) and network.in_flight_weight() == pytest.approx(0.75)
    np.testing.assert_allclose(avg.x["w"], 0.25)
