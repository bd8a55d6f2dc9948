"""Gossip by host (bps_gossip.gossip.by_host) in one process over the fake link: exact within a
host, one message per host pair between hosts, the average over workers kept."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeNetwork, run_ranks

from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.gossip.by_host import HostAverager, fits


def hosts_of(n, local):
    return [tuple(range(first, first + local)) for first in range(0, n, local)]


def starts(n, length=6):
    return [np.arange(length, dtype=np.float64) * (rank + 1) + 3 * rank for rank in range(n)]


def cross_host_sends(network):
    """Count the messages each FakeLink sends to another host."""
    counts = [0]
    send = network.send

    def counting(src, dst, header, arrays):
        counts[0] += network.host(src) != network.host(dst)
        return send(src, dst, header, arrays)

    network.send = counting
    return counts


def test_it_fits_hosts_of_equal_size_with_a_graph_name_and_no_open_rounds():
    assert fits([(0, 1), (2, 3)], "npdde")
    assert fits([(0, 1, 2)], "ring")  # one host: the exact average every step
    assert not fits([(0,), (1,)], "npdde")  # nobody shares a host
    assert not fits([(0, 1), (2,)], "npdde")  # a host's mean would not stand for its workers
    assert not fits([(0, 1), (2, 3)], "npdde", overlap=True)
    assert not fits(None, "npdde")
    assert not fits([], "npdde")
    with pytest.raises(ValueError, match="equal size"):
        HostAverager({"w": np.zeros(2)}, [(0, 1), (2,)], link=FakeNetwork(3).link(0))
    with pytest.raises(ValueError, match="peers_per_itr"):  # on a local too, not only where the graph is built
        HostAverager({"w": np.zeros(2)}, [(0, 1), (2, 3)], graph="dde", peers_per_itr=2, link=FakeNetwork(4).link(1))


@pytest.mark.parametrize("n,local", [(4, 2), (8, 2), (6, 3), (8, 4)])
def test_hosts_hold_one_model_and_reach_the_exact_average(n, local):
    network = FakeNetwork(n, local=local)
    crossing = cross_host_sends(network)
    x0 = starts(n)
    mean = np.mean(x0, axis=0)
    groups = hosts_of(n, local)
    hosts = len(groups)

    def body(rank):
        avg = HostAverager({"w": x0[rank]}, groups, graph="npdde", tag="h", link=network.link(rank))
        seen = []
        for _ in range(max(1, int(np.log2(hosts)))):
            avg.step()
            seen.append(avg.model()["w"].copy())
        return avg.weight, seen

    results = run_ranks(n, body)
    for group in groups:  # every worker of a host holds its leader's model after every round
        for rank in group[1:]:
            for mine, leaders in zip(results[rank][1], results[group[0]][1]):
                np.testing.assert_array_equal(mine, leaders)
    for weight, seen in results:  # the exponential graph over hosts: exact in log2(hosts) rounds
        assert weight == 1.0
        np.testing.assert_allclose(seen[-1], mean, rtol=1e-12)
    rounds = max(1, int(np.log2(hosts)))
    assert crossing[0] == (hosts if hosts > 1 else 0) * rounds  # one message per host a round


def test_flat_gossip_sends_a_message_per_worker_across_hosts():
    """What gossip by host saves: on 2 hosts of 2, flat npdde sends 3 of its 4 messages a round across."""
    n = 4
    network = FakeNetwork(n, local=2)
    crossing = cross_host_sends(network)
    x0 = starts(n)

    def body(rank):
        avg = GossipAverager({"w": x0[rank]}, graph="npdde", tag="f", link=network.link(rank))
        for _ in range(4):
            avg.step()

    run_ranks(n, body)
    assert crossing[0] == 12  # 3 messages a round cross between hosts; by host, 2 (one per leader)


def test_training_steps_keep_the_sum_over_workers():
    """Local updates between rounds (apply_update), as the trainer does: the sum over workers
    of x moves only by the updates."""
    n, local = 4, 2
    network = FakeNetwork(n, local=local)
    x0 = starts(n)
    groups = hosts_of(n, local)
    rng = np.random.default_rng(3)
    updates = rng.normal(size=(5, n, 6))

    def body(rank):
        avg = HostAverager({"w": x0[rank]}, groups, graph="npdde", tag="t", link=network.link(rank))
        sums = []
        for step in range(5):
            before = avg.model()
            after = {"w": before["w"] + updates[step, rank]}
            avg.apply_update({"w": before["w"].copy()}, after)
            avg.step()
            sums.append(avg.x["w"].copy())
        return sums

    results = run_ranks(n, body)
    for step in range(5):
        total = sum(results[rank][step] for rank in range(n))
        expected = sum(x0) + updates[:step + 1].sum(axis=(0, 1))
        np.testing.assert_allclose(total, expected, rtol=1e-10)


@pytest.mark.parametrize("bad", ["nan", "shape", "keys"])
def test_a_leader_refuses_a_bad_message_from_a_local(bad):
    network = FakeNetwork(2, local=2)
    leader = HostAverager({"w": np.zeros(4)}, [(0, 1)], tag="b", link=network.link(0))
    arrays = {"nan": [np.array([0, np.nan, 0, 0])], "shape": [np.zeros(3)], "keys": [np.zeros(4)]}[bad]
    keys = ["v"] if bad == "keys" else ["w"]
    network.link(1).send(0, {"tag": "b.up", "round": 0, "keys": keys}, arrays)
    with pytest.raises(ValueError, match="rank 1 sent"):
        leader.step()


def test_average_exactly_and_consensus_distance_go_through_every_worker():
    n, local = 4, 2
    network = FakeNetwork(n, local=local)
    x0 = starts(n)
    mean = np.mean(x0, axis=0)

    def body(rank):
        avg = HostAverager({"w": x0[rank]}, hosts_of(n, local), graph="npdde", tag="e", link=network.link(rank))
        before = avg.consensus_distance()
        avg.average_exactly()
        return before, avg.x["w"], avg.consensus_distance()

    for before, x, after in run_ranks(n, body):
        assert before > 1 and after == pytest.approx(0.0, abs=1e-12)
        np.testing.assert_allclose(x, mean, rtol=1e-12)


@pytest.mark.parametrize("weight", [float("inf"), -1.0, 0.0, "1", None], ids=["inf", "negative", "zero", "text", "missing"])
def test_a_local_refuses_a_bad_weight_from_its_leader(weight):
    network = FakeNetwork(2, local=2)
    local = HostAverager({"w": np.zeros(4)}, [(0, 1)], tag="b", link=network.link(1))
    header = {"tag": "b.down", "round": 0, "keys": ["w"], **({} if weight is None else {"weight": weight})}
    network.link(0).send(1, header, [np.zeros(4)])
    with pytest.raises(ValueError, match="rank 0.*bad weight"):
        local.step()
