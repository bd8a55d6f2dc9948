"""The server's rounds in-process (no sockets): a fake reply collects what workers would get."""

from __future__ import annotations

import dataclasses
import select

import numpy as np
import pytest

from bps_gossip.config import Config
from bps_gossip.protocol import AddressBook, BookEntry, Error, Push, Result
from bps_gossip.server.pool import SumPool
from bps_gossip.server.rounds import INLINE_BYTES, Aggregations

UIDS = [bytes([65 + rank]) * 8 for rank in range(3)]


class Frame(bytes):
    """What a zmq.Frame offers the server: len() and a buffer."""

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)


@pytest.fixture
def rig():
    replies = []
    pool = SumPool(2)
    rounds = Aggregations(Config(), "tcp://test:1", lambda who, msg, payloads: replies.append((who, msg, payloads)), pool)
    yield rounds, pool, replies
    pool.close()
    rounds.close()


def book(size: int, generation: int = 1) -> AddressBook:
    workers = [BookEntry(rank, uid.hex(), "", "h", 100 + rank, rank, size) for rank, uid in enumerate(UIDS[:size])]
    return AddressBook(rank=0, generation=generation, servers=["tcp://test:1"], workers=workers)


def push(rank: int, array: np.ndarray, seq: int = 0, gen: int = 1, name: str = "t", **extra) -> tuple:
    msg = Push(req=10 + rank, gen=gen, key=1, part=0, seq=seq, name=name, count=array.size, wire=array.dtype.str,
               dtype=str(array.dtype), shape=list(array.shape), kind="sum", ack=array.nbytes > 65536, **extra)
    return UIDS[rank], msg, [Frame(array.tobytes())]


def wait_pool(rounds: Aggregations, pool: SumPool) -> None:
    while rounds.rounds:
        select.select([pool.fileno()], [], [], 5)
        for rid, error in pool.finished():
            rounds.pool_done(rid, error)


@pytest.mark.parametrize("elements", [1024, 16384, INLINE_BYTES // 4 + 1024])  # 4 KiB, 64 KiB inline; just over INLINE_BYTES: pool
def test_sums_are_exact_inline_and_on_the_pool(rig, elements):
    rounds, pool, replies = rig
    rounds.take_book(book(3))
    rng = np.random.default_rng(elements)
    # Whole numbers: the pool's two threads may add the three pushes in any order, and these
    # sums are exact in every order (the inline path adds them in arrival order).
    arrays = [rng.integers(-1000, 1000, elements).astype(np.float32) for _ in range(3)]
    for rank in (2, 0, 1):
        rounds.on_push(*push(rank, arrays[rank]))
    wait_pool(rounds, pool)
    results = [(who.rank, msg, payloads) for who, msg, payloads in replies if isinstance(msg, Result)]
    assert sorted(rank for rank, _, _ in results) == [0, 1, 2]
    expected = arrays[2].copy()
    np.add(expected, arrays[0], out=expected)
    np.add(expected, arrays[1], out=expected)
    for rank, msg, payloads in results:
        assert msg.req == 10 + rank
        assert np.array_equal(payloads[0], expected)
    acks = [msg for _, msg, _ in replies if not isinstance(msg, Result)]
    # small pushes get no acknowledgement; large ones one each (the last too: its sum is on the pool)
    assert len(acks) == (3 if elements * 4 > INLINE_BYTES else 0)
    assert rounds.rounds_done == 1 and not rounds.rounds


def test_mismatch_names_both_ranks_and_fails_everyone(rig):
    rounds, _, replies = rig
    rounds.take_book(book(2))
    rounds.on_push(*push(0, np.ones(4, np.float32)))
    rounds.on_push(*push(1, np.ones(5, np.float32)))
    errors = [(who.rank, msg) for who, msg, _ in replies if isinstance(msg, Error)]
    assert [rank for rank, _ in errors] == [0, 1]
    assert all(msg.kind == "mismatch" and "rank 0 pushed" in msg.why and "rank 1 pushed" in msg.why
               for _, msg in errors)


def test_strangers_twice_and_early_pushes(rig):
    rounds, _, replies = rig
    rounds.on_push(*push(0, np.ones(4, np.float32)))  # generation 1 before its book: held
    assert not replies and len(rounds.early) == 1
    rounds.take_book(book(2))
    assert not rounds.early and len(rounds.rounds) == 1
    rounds.on_push(*push(0, np.ones(4, np.float32)))
    rounds.on_push(UIDS[2], push(1, np.ones(4, np.float32))[1], [Frame(b"\0" * 16)])
    rounds.on_push(*push(1, np.ones(4, np.float32), gen=0))
    kinds = [(msg.kind, msg.why) for _, msg, _ in replies]
    assert "twice" in kinds[0][1] and "no worker" in kinds[1][1] and kinds[2][0] == "changed"


def test_early_pushes_count_their_headers(rig, monkeypatch):
    """Header-only pushes for a generation this server has no book of yet: what holding them
    costs is bounded by their headers too, not only their payloads (a stranger with the secret
    held 16,384 of them with 2 KiB of text each)."""
    import bps_gossip.server.early_pushes as module

    monkeypatch.setattr(module, "MAX_BYTES_PER_SENDER", 64 * 1024)
    rounds, _, replies = rig
    empty = np.ones(0, np.float32)
    for seq in range(100):
        route, msg, frames = push(0, empty, seq=seq, gen=2, name="n" * 1024)
        rounds.on_push(route, dataclasses.replace(msg, kind="k" * 1024), frames)
    held = len(rounds.early)
    assert 0 < held < 20 and rounds.early.bytes <= 64 * 1024, (held, rounds.early.bytes)
    assert len(replies) == 100 - held and all("holds" in msg.why for _, msg, _ in replies)
    rounds.expire(rounds.early.held[0][0] + rounds.config.timeout + 1)  # what expires gives its bytes back
    assert not rounds.early and rounds.early.bytes == 0 and not rounds.early.by_sender


def test_no_sender_crowds_out_the_early_pushes_of_members(rig, monkeypatch):
    """Issue 37: any holder of the secret could fill the one list of early pushes, and members'
    early pushes during an elastic change were refused. Now a stranger (in no book) holds at most
    its own share, strangers together at most half; a member's early push is still held."""
    import bps_gossip.server.early_pushes as module

    monkeypatch.setattr(module, "MAX_PUSHES", 64)
    monkeypatch.setattr(module, "MAX_PER_SENDER", 16)
    rounds, _, replies = rig
    rounds.take_book(book(2))
    one = np.ones(1, np.float32)
    for stranger in range(6):  # six connections of one secret holder, each with a key of its own
        for seq in range(20):
            _, msg, frames = push(0, one, seq=seq, gen=2)
            rounds.on_push(bytes([100 + stranger]) * 8, msg, frames)
    assert len(rounds.early) == 32 and rounds.early.strangers[0] == 32  # half of 64; 16 each at most
    refused = [msg.why for _, msg, _ in replies]
    assert len(refused) == 120 - 32 and any("this sender holds 16" in why for why in refused) \
        and any("senders in no address book hold 32" in why for why in refused)
    replies.clear()
    for rank in (0, 1):  # the members' pushes of the next generation: held
        rounds.on_push(*push(rank, one, gen=2))
    assert not replies and len(rounds.early) == 34
    rounds.take_book(book(2, generation=2))
    results = [msg for _, msg, _ in replies if isinstance(msg, Result)]
    assert len(results) == 2  # the members' round completed; the strangers are no workers of it
    assert not rounds.early and rounds.early.bytes == 0 and rounds.early.strangers == [0, 0]


def test_a_rows_round_keeps_of_each_push_only_its_senders_row(rig):
    """gather_rows on the server: a rank that fills every row reaches only its own."""
    rounds, _, replies = rig
    rounds.take_book(book(3))
    for rank in range(3):
        matrix = np.full((3, 2), 1e9) if rank == 2 else np.zeros((3, 2))
        matrix[rank] = [rank, rank + 0.5]
        route, msg, frames = push(rank, matrix, rows=True)
        rounds.on_push(route, dataclasses.replace(msg, kind="rows"), frames)
    results = [payloads[0] for _, msg, payloads in replies if isinstance(msg, Result)]
    assert len(results) == 3
    for payload in results:
        got = np.frombuffer(payload, np.float64).reshape(3, 2)
        assert got.tolist() == [[0, 0.5], [1, 1.5], [2, 2.5]]


def test_a_push_that_is_no_rows_push_fails_a_rows_round(rig):
    """Else a sum could write into every row: the round fails, for every rank, with why."""
    rounds, _, replies = rig
    rounds.take_book(book(2))
    route, msg, frames = push(0, np.zeros((2, 2)), rows=True)
    rounds.on_push(route, msg, frames)
    rounds.on_push(*push(1, np.full((2, 2), 7.0)))
    errors = [msg for _, msg, _ in replies if isinstance(msg, Error)]
    assert len(errors) == 2 and all("disagree on gather_rows" in msg.why for msg in errors)


def test_rounds_one_rank_opens_are_bounded_and_given_back(rig, monkeypatch):
    """A member that opens rounds no other rank joins (names nobody else pushes) is refused past
    its rank's bounds, by count and by the bytes the server holds; what completes, fails or
    expires is given back; the other rank is not charged for it."""
    import bps_gossip.server.holdings as holdings

    monkeypatch.setattr(holdings, "MAX_OPEN_ROUNDS_PER_RANK", 8)
    monkeypatch.setattr(holdings, "MAX_OPEN_BYTES_PER_RANK", 64 * 1024)
    rounds, pool, replies = rig
    rounds.take_book(book(2))
    for seq in range(10):  # small: the count bound
        rounds.on_push(*push(0, np.ones(4, np.float32), seq=seq, name="lonely"))
    refused = [msg.why for _, msg, _ in replies if isinstance(msg, Error)]
    assert len(rounds.rounds) == 8 and len(refused) == 2 and "opened 8 rounds" in refused[0], refused
    assert rounds.rounds.count == {0: 8}
    for seq in range(8):  # rank 1 completes them: rank 0's charge comes back, rank 1 was never charged
        rounds.on_push(*push(1, np.ones(4, np.float32), seq=seq, name="lonely"))
    wait_pool(rounds, pool)
    assert not rounds.rounds and not rounds.rounds.count and not rounds.rounds.bytes
    replies.clear()
    big = np.ones(6000, np.float32)  # 24 KB a round: the byte bound refuses the third
    for seq in range(20, 23):
        rounds.on_push(*push(0, big, seq=seq, name="lonely"))
    refused = [msg.why for _, msg, _ in replies if isinstance(msg, Error)]
    assert len(rounds.rounds) == 2 and len(refused) == 1 and "hold" in refused[0], refused
    rounds.expire(max(r.created for r in rounds.rounds.values()) + rounds.config.timeout + 1)
    assert not rounds.rounds and not rounds.rounds.bytes


def test_tensor_names_are_bounded(rig, monkeypatch):
    """The names a server remembers (to refuse two names on one key) are the newest ones: a job
    that pushes under ever new names does not grow it, and the partitions recorded per key are
    bounded too."""
    import bps_gossip.server.holdings as holdings

    monkeypatch.setattr(holdings, "MAX_TENSOR_NAMES", 4)
    monkeypatch.setattr(holdings, "MAX_PARTS_SEEN", 2)
    rounds, pool, _ = rig
    rounds.take_book(book(1))
    for key in range(10):
        for part in range(3):
            route, msg, frames = push(0, np.ones(2, np.float32), name=f"t{key}")
            rounds.on_push(route, dataclasses.replace(msg, key=key, part=part), frames)
    wait_pool(rounds, pool)
    assert len(rounds.names) == 4 and sorted(rounds.names.parts) == [6, 7, 8, 9]
    assert all(len(parts) == 2 for parts in rounds.names.parts.values())


def test_malformed_push_is_answered_with_its_req(rig):
    rounds, _, replies = rig
    rounds.malformed(b"r", {"op": "push", "req": 5}, ValueError("bad"))
    rounds.malformed(b"r", {"op": "push", "req": "5"}, ValueError("bad"))
    assert [(msg.req, msg.kind) for _, msg, _ in replies] == [(5, "protocol"), (0, "protocol")]


def test_every_small_push_is_summed_inline():
    from bps_gossip.protocol.data import SMALL_PUSH_BYTES
    assert INLINE_BYTES >= SMALL_PUSH_BYTES  # no hop to the pool and back for what workers send unacknowledged


def test_shared_memory_pushes_have_the_frame_limit(rig):
    """Issue 22, item 4: four header-only shared-memory pushes naming huge regions grew a server
    by 640 MiB: shared memory bypassed the frame limit. Refused now, before anything is mapped."""
    rounds, _, replies = rig
    rounds.take_book(book(2))
    huge = Push(req=7, gen=1, key=1, part=0, seq=0, name="t", count=1 << 28, wire="<f4", dtype="float32",
                shape=[1 << 28], kind="sum", ack=True, shm="bpsg_1_100_abcdef", offset=0)
    rounds.on_push(UIDS[0], huge, [])
    (_, error, _), = replies
    assert isinstance(error, Error) and "more than the servers take" in error.why
    assert rounds.rounds == {} and not rounds.segments._segments
