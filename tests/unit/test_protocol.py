"""The wire protocol in-process (no sockets): every message round-trips through msgpack, every
field rejects what it must (wrong type, out of range, non-finite, too long), an unknown op is a
ProtocolError, and Op members are their own wire strings."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from bps_gossip import protocol as p
from bps_gossip.errors import ProtocolError

ENTRY = p.BookEntry(rank=0, uid="ab" * 8, addr="tcp://127.0.0.1:5000", host="127.0.0.1", pid=11,
                    local_rank=0, local_size=1, host_reduce="auto")
SAMPLES: list[p.Message] = [  # one of every op, every optional field set
    p.Register(role="worker", addr="tcp://h:1", host="h", pid=12, start_ticks=99, worker_id=0, local_rank=1,
               local_size=2, peer_addr="tcp://h:2", num_worker=1, num_server=1, host_reduce="on"),
    p.Heartbeat(progress=12), p.HbAck(), p.Leave(crashed=True), p.Bye(), p.Refused(why="no"), p.Wait(why="later"),
    p.AddressBook(rank=0, generation=3, servers=["tcp://s:1"], workers=[ENTRY], restore=True),
    p.Barrier(seq=4), p.BarrierDone(seq=4), p.BarrierFailed(seq=4, why="lost"), p.Commit(seq=5),
    p.CommitDone(seq=5, changed=True), p.Rejoin(generation=2, has_state=False),
    p.Changed(generation=2, restore=False, why="left"), p.Finished(),
    p.Stalled(ranks=[1, 2], generation=2, why="stuck"),
    p.NodeLost(role="worker", rank=1, pid=7, host="h", why="killed"),
    p.NodeLeft(role="server", rank=-1, pid=8, host="h", why="done"),
    p.JobFailed(why="too few"), p.JobOver(why="finished"), p.Terminate(why="all gone"),
    p.Push(req=1, gen=1, key=9, part=0, seq=3, name="w", count=4, wire="<f4", dtype="float32", shape=[2, 2],
           kind="sum", ack=False, shm="bpsg-1-2-3", offset=16, hosted=True),
    p.Ack(req=1), p.Result(req=1, shm=True), p.Error(req=1, kind="lost", why="gone"),
    p.Stats(req=2, rank=0, parts={"9": [0, 1]}, rounds_done=3, open_rounds=0, pushes=[4, 0], socket_bytes=64),
    p.Gossip(tag="sgp", round=7, dtypes=["<f4"], counts=[3], gen=1, keys=["w"], weight=0.5, shm="seg",
             offsets=[0], sent=1.7e9),
    p.GossipAck(shm="seg", gen=1),
    p.GossipWaiting(kind="gossip", name="trainer", seq=4, waited=2.5, gen=1, waits_for=[0],
                    behind="trainer.average.weight", behind_seq=0),
]


def wire(header):
    """As it arrives: packed and unpacked by msgpack."""
    return msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False, strict_map_key=False)


def test_every_op_has_one_class_and_a_sample():
    assert set(p.MESSAGES) == set(p.Op)
    assert {m.op for m in SAMPLES} == set(p.Op)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.op.value)
def test_round_trip(msg):
    header = wire(msg.encode())
    assert header["op"] == msg.op.value
    assert p.decode(header) == msg
    assert type(msg).decode(header) == msg


def test_push_without_optional_fields_round_trips():
    push = p.Push(req=1, gen=0, key=1, part=0, seq=0, name="x", count=1, wire="float32", dtype="float32",
                  shape=[1], kind="sum")
    header = wire(push.encode())
    assert "shm" not in header and "codec" not in header and header["wire"] == "<f4"
    assert p.decode(header) == push


def test_op_members_are_their_wire_strings():
    assert msgpack.packb(p.Op.PUSH) == msgpack.packb("push")
    assert wire({"op": p.Op.BOOK}) == {"op": "book"}
    by_string = {"push": 1}
    by_member = {p.Op.PUSH: 2}
    assert by_string[p.Op.PUSH] == 1 and by_member["push"] == 2
    assert str(p.Op.HB_ACK) == "hb_ack" and p.Op("hb_ack") is p.Op.HB_ACK


@pytest.mark.parametrize("header", [{}, {"op": "nope"}, {"op": 7}, {"op": None}, {"op": "PUSH"}])
def test_unknown_op_is_a_protocol_error(header):
    with pytest.raises(ProtocolError):
        p.decode(header)


def bad_values(value):
    """Values a field holding ``value`` must refuse: wrong type, out of range, non-finite, too long."""
    if isinstance(value, bool):
        return [1, "true", 0.0, [value]]
    if isinstance(value, int):
        return ["7", 7.0, True, float("inf"), float("nan"), -(1 << 63), (1 << 64) - 1, [value]]
    if isinstance(value, float):
        return [float("inf"), float("nan"), float("-inf"), "0.5", True, [value]]
    if isinstance(value, str):
        return [7, b"bytes", ["x"], "x" * 100_000]
    if isinstance(value, list):
        return ["x", {"a": 1}, [None], [value[0]] * 200_000]
    if isinstance(value, dict):
        return ["x", [1]]
    raise AssertionError(f"no bad values for {value!r}")


FIELD_CASES = [(msg, key, bad) for msg in SAMPLES if not isinstance(msg, p.AddressBook)
               for key, value in msg.encode().items() if key != "op" for bad in bad_values(value)]


@pytest.mark.parametrize("msg,key,bad", FIELD_CASES,
                         ids=[f"{m.op.value}-{k}-{i}" for i, (m, k, _) in enumerate(FIELD_CASES)])
def test_every_field_rejects_what_it_must(msg, key, bad):
    header = wire({**msg.encode(), key: bad})
    with pytest.raises(ProtocolError) as raised:
        type(msg).decode(header)
    assert msg.op.value in str(raised.value) and key in str(raised.value)  # names the op and the field


@pytest.mark.parametrize("change", [
    {"kind": "sleeping"}, {"waited": -1.0}, {"waited": 1e12}, {"behind_seq": None}, {"behind": None},
    {"kind": "collective", "waits_for": None}, {"kind": "collective", "behind": None, "behind_seq": None},
])
def test_gossip_waiting_rejects_what_no_wait_says(change):
    sample = next(m for m in SAMPLES if isinstance(m, p.GossipWaiting))
    header = {key: value for key, value in {**sample.encode(), **change}.items() if value is not None}
    with pytest.raises(ProtocolError, match="gossip_waiting"):
        p.GossipWaiting.decode(wire(header))


@pytest.mark.parametrize("path,bad", [
    (("rank",), "0"), (("rank",), -1), (("book",), []), (("book", "generation"), 1.5),
    (("book", "servers"), ["x" * 1000]), (("book", "workers"), {}), (("book", "workers", 0), "w"),
    (("book", "workers", 0, "uid"), "not hex"), (("book", "workers", 0, "pid"), float("inf")),
    (("book", "workers", 0, "rank"), 5), (("restore",), 1),
])
def test_address_book_rejects_what_it_must(path, bad):
    header = wire(SAMPLES[7].encode())
    target = header
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = bad
    with pytest.raises(ProtocolError, match="book"):
        p.AddressBook.decode(header)


@pytest.mark.parametrize("header", [
    {"role": "scheduler"}, {"role": "worker", "local_rank": 2, "local_size": 2},
])
def test_register_rules_between_fields(header):
    with pytest.raises(ProtocolError, match="register"):
        p.Register.decode({"op": "register", **header})


@pytest.mark.parametrize("change", [
    {"wire": "object"}, {"wire": "<U4"}, {"wire": "no such dtype"}, {"shm": "seg", "offset": None},
    {"codec": {"name": "onebit"}, "wire": "<f4"}, {"codec": "onebit"},
    # a codec map is bounded before anything holds it: entries, key and text lengths, scalar values
    *({"codec": codec, "wire": "|u1", "hosted": False} for codec in (
        {f"k{i}": 1 for i in range(17)}, {"k" * 65: 1}, {"name": "x" * 65}, {"n": [1] * 1000}, {"n": {"deep": 1}},
        {1: 1})),
])
def test_push_rules_between_fields(change):
    header = {**SAMPLES[22].encode(), "shm": None, "offset": None, **change}
    with pytest.raises(ProtocolError, match="push"):
        p.Push.decode({k: v for k, v in header.items() if v is not None or k in change})


def test_a_bounded_codec_map_decodes():
    header = {**SAMPLES[22].encode(), "shm": None, "offset": None, "hosted": False, "wire": "|u1",
              "codec": {"name": "onebit", "n": 4, "seed": None, "ef": True, "scaling": False}}
    assert p.Push.decode({k: v for k, v in header.items() if v is not None}).codec["name"] == "onebit"


def test_push_payload_must_match_its_count():
    push = dataclasses.replace(SAMPLES[22], shm=None, offset=None)
    push.check_payload([b"\0" * 16])
    with pytest.raises(ProtocolError):
        push.check_payload([b"\0" * 15])
    with pytest.raises(ProtocolError):
        push.check_payload([])


@pytest.mark.parametrize("change", [{"counts": [1, 2]}, {"keys": ["a", "b"]}, {"offsets": None},
                                    {"dtypes": ["|O"]}])
def test_gossip_rules_between_fields(change):
    header = {**SAMPLES[28].encode(), **change}
    with pytest.raises(ProtocolError, match="gossip"):
        p.Gossip.decode({k: v for k, v in header.items() if v is not None})


def test_handler_table_decodes_and_routes():
    seen = []
    malformed = []
    table = p.handlers({p.Push: lambda route, msg, frames: seen.append((route, msg, frames)),
                        p.Ack: lambda route, msg, frames: seen.append(msg)},
                       malformed={p.Push: lambda route, header, error: malformed.append((route, error))})
    assert set(table) == {p.Op.PUSH, p.Op.ACK} and "push" in table and p.Op.ACK in table
    table["push"](b"r", wire(SAMPLES[22].encode()), ["frame"])
    assert seen == [(b"r", SAMPLES[22], ["frame"])]
    table["push"](b"r", {"op": "push", "req": "x"}, [])
    assert malformed and "push" in str(malformed[0][1])
    with pytest.raises(ProtocolError):  # no malformed callback: drain drops it
        table[p.Op.ACK](None, {"op": "ack", "req": -1}, [])


def test_one_class_per_op():
    with pytest.raises(TypeError):
        @p.message(p.Op.ACK)
        class Twice(p.Message):
            pass
