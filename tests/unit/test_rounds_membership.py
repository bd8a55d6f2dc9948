"""The server's aggregation Aggregation and the scheduler's Membership in one process, through their
public methods: sums, signature mismatches, rank assignment, elastic joins and leaves."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bps_gossip.errors import ConfigError
from bps_gossip.protocol.data import describe_signature
from bps_gossip.scheduler.membership import Membership, Node
from bps_gossip.server.aggregation import Aggregation, Contribution

SIG = {"dtype": "float32", "shape": [2, 3], "kind": "sum"}


# -- Aggregation ------------------------------------------------------------------------------
def make_round(expected=3, sig=SIG, wire="float32", count=6):
    return Aggregation((1, 42, 0, 0), "w", dict(sig), wire, count, expected)


def test_round_sums_every_push_and_says_when_the_last_came():
    rnd = make_round()
    assert rnd.nbytes == 24
    payloads = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(3)]
    assert [rnd.add(payloads[0].tobytes()), rnd.add(memoryview(payloads[1].tobytes())), rnd.add(payloads[2])] == \
        [False, False, True]
    np.testing.assert_array_equal(rnd.acc, np.arange(6, dtype=np.float32) * 6)


def test_round_writes_the_sum_back_to_every_shared_memory_region():
    rnd = make_round(expected=2)
    regions = [np.zeros(6, np.float32), None]
    for rank, region in enumerate(regions):
        rnd.pushes[rank] = Contribution(rank, b"route%d" % rank, rank, region)
        rnd.add(np.full(6, rank + 1, np.float32))
    rnd.write_back()
    np.testing.assert_array_equal(regions[0], np.full(6, 3, np.float32))


def test_round_sums_integers_exactly():
    rnd = make_round(expected=2, sig={"dtype": "int64", "shape": [4], "kind": "sum"}, wire="int64", count=4)
    big = np.array([2 ** 62, -(2 ** 62), 1, 0], dtype=np.int64)
    rnd.add(big)
    assert rnd.add(np.array([1, 1, 1, 1], dtype=np.int64))
    assert rnd.acc.tolist() == [2 ** 62 + 1, -(2 ** 62) + 1, 2, 1]


def test_round_added_from_many_threads_finishes_once():
    expected = 16
    rnd = make_round(expected=expected)
    finished = []
    start = threading.Barrier(expected)

    def push(rank):
        start.wait()
        if rnd.add(np.full(6, 1.0, np.float32)):
            finished.append(rank)

    threads = [threading.Thread(target=push, args=(r,)) for r in range(expected)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(finished) == 1
    np.testing.assert_array_equal(rnd.acc, np.full(6, float(expected), np.float32))


def test_round_mismatch_names_the_tensor_the_ranks_and_both_signatures():
    rnd = make_round()
    rnd.pushes[0] = Contribution(0, b"r0", 0)
    assert rnd.mismatch(1, dict(SIG), "float32", 6) is None
    text = rnd.mismatch(2, {"dtype": "float32", "shape": [3, 2], "kind": "sum"}, "float32", 6)
    assert "'w'" in text and "rank 0" in text and "rank 2" in text
    assert describe_signature(SIG) in text and "float32 (3, 2) sum" in text
    assert rnd.mismatch(1, dict(SIG), "float64", 6) is not None
    assert rnd.mismatch(1, dict(SIG), "float32", 5) is not None
    assert rnd.mismatch(1, {**SIG, "kind": "mean"}, "float32", 6) is not None


# -- Membership ---------------------------------------------------------------------------
def worker(uid, host="h", worker_id=None, local_rank=0, local_size=1):
    return Node(uid.encode(), "worker", f"tcp://{host}:{len(uid)}", host, 100, worker_id, local_rank, local_size,
                peer_addr=f"tcp://{host}:9{local_rank}")


def server(uid, addr):
    return Node(uid.encode(), "server", addr, "s", 200)


def started(groups=2, local=2, servers=1, elastic=False, max_workers=0):
    members = Membership(groups, servers, elastic=elastic, max_workers=max_workers)
    for s in range(servers):
        members.add(server(f"s{s}", f"tcp://s:{s}"))
    for group in range(groups):
        for local_rank in range(local):
            members.add(worker(f"w{group}{local_rank}", f"host{group}", group, local_rank, local))
    assert members.complete()
    members.assign_ranks()
    return members


def test_ranks_follow_machines_then_local_rank():
    members = Membership(3, 2)
    members.add(worker("c0", host="zeta", local_rank=0, local_size=1))  # no DMLC_WORKER_ID: by host, last
    members.add(worker("b1", worker_id=1, local_rank=1, local_size=2))
    members.add(server("s1", "tcp://s:2"))
    members.add(worker("a0", worker_id=0, local_rank=0, local_size=1))
    assert not members.complete()
    members.add(worker("b0", worker_id=1, local_rank=0, local_size=2))
    assert not members.complete()
    members.add(server("s0", "tcp://s:1"))
    assert members.complete()
    members.assign_ranks()
    assert [(w.uid, w.rank) for w in members.workers()] == [(b"a0", 0), (b"b0", 1), (b"b1", 2), (b"c0", 3)]
    assert [s.addr for s in members.servers()] == ["tcp://s:1", "tcp://s:2"]
    assert members.generation == 1 and members.started


def test_registration_errors():
    members = Membership(1, 1)
    members.add(worker("a", worker_id=0, local_rank=0, local_size=2))
    with pytest.raises(ConfigError, match="BYTEPS_LOCAL_RANK=0"):
        members.add(worker("b", worker_id=0, local_rank=0, local_size=2))
    with pytest.raises(ConfigError, match="disagree on BYTEPS_LOCAL_SIZE"):
        members.add(worker("c", worker_id=0, local_rank=1, local_size=3))
    with pytest.raises(ConfigError, match="DMLC_NUM_WORKER=1"):
        members.add(worker("d", worker_id=1))
    members.add(server("s", "tcp://s:1"))
    with pytest.raises(ConfigError, match="DMLC_NUM_SERVER=1"):
        members.add(server("t", "tcp://s:2"))


def test_a_late_worker_cannot_join_a_job_that_is_not_elastic():
    members = started()
    with pytest.raises(ConfigError, match="not elastic"):
        members.add(worker("late"))


def test_a_node_that_died_before_the_rendezvous_frees_its_place():
    members = Membership(1, 0)
    members.add(worker("a", worker_id=0))
    members.forget(b"a")
    members.add(worker("b", worker_id=0))
    assert members.complete()
    members.assign_ranks()
    with pytest.raises(RuntimeError):
        members.forget(b"b")


def test_elastic_join_and_leave_renumber_by_seniority():
    members = started(groups=2, local=2, elastic=True, max_workers=5)
    members.add(worker("j1", host="new"))
    assert [w.uid for w in members.workers("joining")] == [b"j1"]
    with pytest.raises(ConfigError, match="BPS_GOSSIP_MAX_WORKERS=5"):
        members.add(worker("j2", host="new"))
    assert members.mark(b"w00", "lost").uid == b"w00"
    assert members.mark(b"w00", "lost") is None  # not alive any more
    assert members.next_generation() == 2
    joined = members.reassign()
    assert [w.uid for w in joined] == [b"j1"]
    assert [(w.uid, w.rank) for w in members.workers("alive")] == [(b"w01", 0), (b"w10", 1), (b"w11", 2), (b"j1", 3)]
    book = members.book()
    assert book["generation"] == 2 and book["servers"] == ["tcp://s:0"]
    assert [(w["rank"], w["uid"]) for w in book["workers"]] == [(0, b"w01".hex()), (1, b"w10".hex()),
                                                                (2, b"w11".hex()), (3, b"j1".hex())]
    assert book["workers"][3]["addr"] == "tcp://new:90"


def test_all_workers_gone():
    members = started(groups=1, local=2, elastic=True)
    assert not members.all_workers_gone()
    members.mark(b"w00", "left")
    members.mark(b"w01", "lost")
    assert members.all_workers_gone()
