"""bps_gossip.worker.server_choice: a planned set of tensors spreads its bytes evenly over the
servers, every rank computes the same assignment whatever order it lists the tensors in, and
unplanned tensors keep the stateless hash placement (issue 34, item 3)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from bps_gossip.worker import server_choice
from bps_gossip.worker.server_choice import assign, plan_of, plan_servers, server_of
from bps_gossip.worker.tensors import key_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_scale  # noqa: E402

PARTITION = 4096000
RESNET = [(name, count, 4) for name, count, _ in bench_scale.pushed_tensors(bench_scale.PRESETS["resnet18_v1"])]


@pytest.fixture(autouse=True)
def fresh():
    server_choice.reset()
    yield
    server_choice.reset()


def loads_of(tensors, nservers):
    loads = [0] * nservers
    for key, sizes in plan_of(tensors, PARTITION):
        for index, size in enumerate(sizes):
            loads[server_of(key, index, nservers)] += size
    return loads


@pytest.mark.parametrize("nservers,share", [(2, 0.51), (3, 0.34), (4, 0.26)])
def test_resnet18_bytes_are_balanced(nservers, share):
    """20 partitions of 0.3-4.1 MB: the hash put 55% on one of 2 servers and 51% on one of 4."""
    plan_servers(RESNET, PARTITION)
    loads = loads_of(RESNET, nservers)
    total = sum(loads)
    assert total == 4 * sum(count for _, count, _ in RESNET)
    largest = max(size for _, sizes in plan_of(RESNET, PARTITION) for size in sizes)
    assert max(loads) <= total / nservers + largest  # greedy, largest first: never worse than this
    assert max(loads) / total <= share


@pytest.mark.parametrize("nservers", [2, 3, 4, 5])
def test_equal_tensors_are_spread_evenly(nservers):
    tensors = [(f"grad{i}", 131072, 4) for i in range(8)]  # 4mib8: the hash put 5 of 8 on one of 2
    plan_servers(tensors, PARTITION)
    loads = loads_of(tensors, nservers)
    assert max(loads) - min(loads) <= 4 * 131072


def test_every_order_gives_the_same_assignment():
    """Ranks declare tensors in different orders: each rank's answer for every partition agrees."""
    answers = set()
    for seed in range(6):
        server_choice.reset()
        tensors = RESNET[:]
        random.Random(seed).shuffle(tensors)
        plan_servers(tensors, PARTITION)
        answers.add(tuple(server_of(key, index, n) for n in (2, 3, 4)
                          for key, sizes in sorted(plan_of(RESNET, PARTITION)) for index in range(len(sizes))))
    assert len(answers) == 1
    assert assign(plan_of(RESNET[::-1], PARTITION), 4) == assign(plan_of(RESNET, PARTITION), 4)


def test_unplanned_tensors_keep_the_hash_and_one_server_takes_all():
    key = key_of("not planned")
    assert [server_of(key, index, 4) for index in range(5)] == [(key + index) % 4 for index in range(5)]
    plan_servers(RESNET, PARTITION)
    assert all(server_of(key_of(name), 0, 1) == 0 for name, _, _ in RESNET)
    assert server_of(key, 7, 3) == (key + 7) % 3


def test_each_plan_is_assigned_on_its_own():
    """A rank's earlier plans do not shift a later one: a worker that joins later and makes only
    the later plan agrees with those that made both; a tensor in both keeps the first plan's servers."""
    fusion, other = RESNET[:7], [(f"extra{i}", 131072, 4) for i in range(6)]
    plan_servers(other, PARTITION)
    plan_servers(fusion + other[:2], PARTITION)
    both = {name: server_of(key_of(name), 0, 4) for name, _, _ in fusion + other}
    server_choice.reset()
    plan_servers(other, PARTITION)
    alone_other = {name: server_of(key_of(name), 0, 4) for name, _, _ in other}
    server_choice.reset()
    plan_servers(fusion + other[:2], PARTITION)
    alone_fusion = {name: server_of(key_of(name), 0, 4) for name, _, _ in fusion}
    assert both == {**alone_fusion, **alone_other}


def test_a_tensor_already_pushed_cannot_be_planned():
    assert not server_choice.routed("grad57")
    server_of(key_of("grad57"), 0, 2)  # routed by the hash: a plan now would move it
    assert server_choice.routed("grad57") and not server_choice.routed("grad54")
    with pytest.raises(ValueError, match="pushed already"):
        plan_servers(RESNET, PARTITION)


@pytest.mark.parametrize("tensors,partition,error", [
    ([("", 4, 4)], PARTITION, "non-empty string name"),
    ([("a", -1, 4)], PARTITION, "-1 elements"),
    ([("a", 4, 0)], PARTITION, "of 0 bytes"),
    ([("a", 4, 4)], 0, "partition_bytes must be at least 1"),
])
def test_bad_plans_are_refused(tensors, partition, error):
    with pytest.raises(ValueError, match=error):
        plan_servers(tensors, partition)


def test_zero_size_tensors_have_one_partition():
    plan_servers([("empty", 0, 4), ("one", 1, 4)], PARTITION)
    assert server_of(key_of("empty"), 0, 2) in (0, 1)
    assert {server_of(key_of(n), 0, 2) for n in ("empty", "one")} == {0, 1}
