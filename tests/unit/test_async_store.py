"""The servers' stored weights for asynchronous training (bps_gossip.server.async_store), on their own
and behind a server's push handling (bps_gossip.server.rounds), in-process: no sockets."""

from __future__ import annotations

import numpy as np
import pytest
from test_server_rounds import UIDS, Frame, book, rig  # noqa: F401 - rig is a fixture

from bps_gossip.errors import ProtocolError
from bps_gossip.protocol import Error, Push, Result
from bps_gossip.server.async_store import AsyncStore, StoreRefused

SIG = {"dtype": "float32", "shape": [4], "kind": "stored weights"}


def put(store: AsyncStore, op: str, values, rank: int = 0, key: int = 7, part: int = 0, instance: int = 0,
        sig: dict | None = None) -> np.ndarray:
    array = np.asarray(values, dtype=np.float32)
    return store.push(rank, op == "init", key, part, "w", instance, sig or SIG, array.dtype.str, array.tobytes(), array.size)


def test_init_creates_once_and_adds_land_at_once():
    store = AsyncStore()
    assert put(store, "init", [1, 2, 3, 4]).tolist() == [1, 2, 3, 4]
    # a second rank's init gets the stored weights, not its own payload
    assert put(store, "init", [9, 9, 9, 9], rank=1).tolist() == [1, 2, 3, 4]
    first = put(store, "add", [0.5, 0, 0, 0], rank=1)
    assert first.tolist() == [1.5, 2, 3, 4]
    second = put(store, "add", [0.5, 0, 0, 1], rank=2)
    assert second.tolist() == [2, 2, 3, 5]
    assert first.tolist() == [1.5, 2, 3, 4]  # a reply already handed out is never written into
    assert store.bytes == 16 and store.bytes_by_key[7] == 16 and store.pushes == 4


@pytest.mark.parametrize("sig, values, what", [
    ({**SIG, "shape": [2, 2]}, [1, 2, 3, 4], "(2, 2)"),
    (SIG, [1, 2, 3], "3 x"),
])
def test_a_push_that_does_not_match_is_refused(sig, values, what):
    store = AsyncStore()
    put(store, "init", [1, 2, 3, 4])
    for op in ("add", "init"):
        with pytest.raises(StoreRefused, match="does not match") as caught:
            put(store, op, values, rank=2, sig=sig)
        assert caught.value.kind == "mismatch" and what in str(caught.value) and "rank 2" in str(caught.value)
    assert put(store, "add", [0, 0, 0, 0]).tolist() == [1, 2, 3, 4]


def test_a_float64_push_to_float32_weights_is_refused():
    store = AsyncStore()
    put(store, "init", [1, 2, 3, 4])
    array = np.zeros(4, np.float64)
    with pytest.raises(StoreRefused, match="does not match"):
        store.push(1, False, 7, 0, "w", 0, {**SIG, "dtype": "float64"}, array.dtype.str, array.tobytes(), 4)


def test_an_add_before_any_init_is_refused():
    with pytest.raises(StoreRefused, match="no rank initialized"):
        put(AsyncStore(), "add", [1, 2, 3, 4])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_and_change_nothing(bad):
    store = AsyncStore()
    with pytest.raises(StoreRefused, match="non-finite"):
        put(store, "init", [1, bad, 3, 4])
    assert not store.entries
    put(store, "init", [1, 2, 3, 4])
    with pytest.raises(StoreRefused, match="non-finite"):
        put(store, "add", [bad, 0, 0, 0])
    big = np.finfo(np.float32).max
    put(store, "add", [big, 0, 0, 0])
    with pytest.raises(StoreRefused, match="makes the stored weights non-finite"):
        put(store, "add", [big, 0, 0, 0])  # finite itself, but the sum overflows
    assert put(store, "add", [0, 0, 0, 0])[1:].tolist() == [2, 3, 4]


def test_a_new_instance_replaces_every_partition_of_the_name():
    store = AsyncStore()
    for part in range(3):
        put(store, "init", [part] * 4, part=part)
    put(store, "init", [5] * 4, key=8)  # another name stays
    assert store.bytes == 64 and store.bytes_by_key[7] == 48
    assert put(store, "init", [9] * 4, part=0, instance=1).tolist() == [9] * 4
    assert sorted(store.parts[7]) == [0] and store.bytes_by_key[7] == 16 and store.bytes == 32
    with pytest.raises(StoreRefused, match="instance 0 .* holds instance 1") as caught:
        put(store, "add", [1] * 4, part=0, instance=0)
    assert caught.value.kind == "mismatch"
    with pytest.raises(StoreRefused, match="instance 0"):
        put(store, "init", [1] * 4, part=0, instance=0)


def test_memory_is_bounded_in_bytes_and_entries():
    store = AsyncStore(max_bytes=40, max_entries=100)
    put(store, "init", [1] * 4, key=1)
    put(store, "init", [1] * 4, key=2)
    with pytest.raises(StoreRefused, match="stores 32 bytes") as caught:
        put(store, "init", [1] * 4, key=3)
    assert caught.value.kind == "protocol" and store.bytes == 32
    store = AsyncStore(max_entries=2)
    put(store, "init", [1] * 4, key=1)
    put(store, "init", [1] * 4, key=2)
    with pytest.raises(StoreRefused, match="2 partitions"):
        put(store, "init", [1] * 4, key=3)


def stored_push(rank: int, values, op: str = "add", gen: int = 1, route: bytes | None = None, **extra) -> tuple:
    array = np.asarray(values, dtype=np.float32)
    msg = Push(req=10 + rank, gen=gen, key=1, part=0, seq=0, name="w", count=array.size, wire=array.dtype.str,
               dtype="float32", shape=list(array.shape), kind="stored weights", ack=False, store=op, **extra)
    return (UIDS[rank] if route is None else route), msg, [Frame(array.tobytes())]


def test_the_server_answers_each_push_at_once(rig):  # noqa: F811 - the fixture
    rounds, _, replies = rig
    rounds.take_book(book(3))
    rounds.on_push(*stored_push(2, [1, 2], op="init"))
    rounds.on_push(*stored_push(0, [0.5, 0.5]))  # no round: nobody else needs to push
    assert [type(msg) for _, msg, _ in replies] == [Result, Result]
    assert [(who.rank, msg.req) for who, msg, _ in replies] == [(2, 12), (0, 10)]
    assert np.frombuffer(replies[1][2][0], np.float32).tolist() == [1.5, 2.5]
    assert not rounds.rounds


def test_the_server_refuses_strangers_mismatches_and_old_generations(rig):  # noqa: F811 - the fixture
    rounds, _, replies = rig
    rounds.take_book(book(2))
    rounds.on_push(*stored_push(0, [1, 2], op="init", route=b"stranger"))
    rounds.on_push(*stored_push(0, [1, 2], op="init"))
    rounds.on_push(*stored_push(1, [1, 2, 3]))
    rounds.take_book(book(2, generation=2))
    rounds.on_push(*stored_push(0, [1, 2], gen=1))
    errors = [msg for _, msg, _ in replies if isinstance(msg, Error)]
    assert [e.kind for e in errors] == ["protocol", "mismatch", "changed"], errors
    assert "no worker" in errors[0].why and "(3,)" in errors[1].why and "generation 1" in errors[2].why
    assert rounds.stored.entries[(1, 0)].value.tolist() == [1, 2]  # the stranger created nothing


def test_a_worker_that_left_does_not_stop_the_others(rig):  # noqa: F811 - the fixture
    rounds, _, replies = rig
    rounds.take_book(book(2))
    rounds.on_push(*stored_push(0, [1, 2], op="init"))
    rounds.worker_gone("rank 1 left", 1)
    rounds.on_push(*stored_push(0, [1, 1]))
    assert isinstance(replies[-1][1], Result)
    assert np.frombuffer(replies[-1][2][0], np.float32).tolist() == [2, 3]


@pytest.mark.parametrize("extra, why", [
    ({"store": "bogus"}, "none of"),
    ({"store": "add", "root": 0}, "no broadcast"),
    ({"store": "add", "hosted": True}, "not a host's sum"),
    ({"store": "add", "wire": "<i4"}, "floats"),
])
def test_the_protocol_refuses_bad_store_pushes(extra, why):
    fields = {"op": "push", "req": 1, "gen": 1, "key": 1, "part": 0, "seq": 0, "name": "w", "count": 2,
              "wire": "<f4", "dtype": "float32", "shape": [2], "kind": "stored weights", **extra}
    with pytest.raises(ProtocolError, match=why):
        Push.decode(fields)
