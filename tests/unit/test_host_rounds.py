"""A host leader's rounds (worker.host_reduce) against what its locals may send, on real
sockets: a ROUTER for the leader, DEALERs with routing ids from the address book for the
locals, shared-memory segments owned by this process."""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future

import numpy as np
import pytest
import zmq

from bps_gossip.config import Config
from bps_gossip.errors import ProtocolError, TensorMismatchError
from bps_gossip.protocol import MESSAGES, BookEntry, Push
from bps_gossip.transport import recv_message, send_message
from bps_gossip.transport.shm import OwnedSegment, owner_pid
from bps_gossip.worker.host_reduce import MAX_HOST_ROUNDS, HostAggregations, host_route
from bps_gossip.worker.host_reduce import aggregations as host_reduce
from bps_gossip.worker.operation import Operation

pytestmark = pytest.mark.timeout(30)
JOB = f"hrtest{os.getpid()}"
SIG = {"dtype": "float32", "shape": [6], "kind": "sum"}


@dataclasses.dataclass
class Setup:
    rounds: HostAggregations
    router: zmq.Socket
    locals: dict[int, zmq.Socket]
    pushed: list
    poisoned: list
    failed: list
    segments: list


@pytest.fixture
def host():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    uids = {rank: f"worker-{rank}-{os.urandom(4).hex()}".encode() for rank in range(4)}
    # Ranks 0-2 share this host (0 leads); rank 3 is elsewhere. Rank 2 claims another pid, so
    # the segments this process owns are not its own.
    workers = [BookEntry(rank=r, uid=uids[r].hex(), addr="tcp://127.0.0.1:1", host="127.0.0.1",
                         pid=os.getpid() if r != 2 else os.getpid() + 1, local_rank=r, local_size=4) for r in range(4)]
    pushed, poisoned, failed = [], [], []

    def fail(op, error):
        op.failed = True
        failed.append((op, error))

    rounds = HostAggregations(Config(timeout=0.5), 0, 3, (0, 1, 2), workers, lambda op, part: pushed.append((op, part)),
                        fail, lambda *args: poisoned.append(args))
    rounds.sock = router
    dealers = {}
    for rank in (1, 2, 3):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, host_route(uids[rank], 3))
        sock.connect(f"tcp://127.0.0.1:{port}")
        dealers[rank] = sock
    setup = Setup(rounds, router, dealers, pushed, poisoned, failed, [])
    yield setup
    rounds.close("lost", "test over")
    for sock in [router, *dealers.values()]:
        sock.close(linger=0)
    for segment in setup.segments:
        segment.unlink()


def segment(setup: Setup, values: np.ndarray) -> OwnedSegment:
    seg = OwnedSegment(JOB, values.nbytes)
    seg.view(values.dtype, values.size)[:] = values
    setup.segments.append(seg)
    return seg


def local_push(setup: Setup, rank: int, seg: OwnedSegment, count: int = 6, seq: int = 0, gen: int = 3,
               sig: dict | None = None, req: int = 7) -> None:
    sig = sig or SIG
    header = Push.header(req=req, key=11, name="w", part=0, seq=seq, count=count, wire="<f4", dtype=sig["dtype"],
                         shape=sig["shape"], kind=sig["kind"], ack=True, gen=gen, shm=seg.name, offset=0)
    send_message(setup.locals[rank], header)
    route, header, frames = _recv(setup.router)
    setup.rounds.on_local_push(route, Push.decode(header))


def _recv(sock: zmq.Socket, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return recv_message(sock, routed=sock.type == zmq.ROUTER)


def replies(sock: zmq.Socket) -> list:
    out = []
    while sock.poll(200):
        _, header, _ = recv_message(sock, routed=False)
        out.append(MESSAGES[header["op"]].decode(header))
    return out


def own_op(setup: Setup, values: np.ndarray, seq: int = 0, shape=(6,)) -> Operation:
    seg = segment(setup, values)
    return Operation(future=Future(), name="w", key=11, seq=seq, sig={**SIG, "shape": list(shape)}, send=values,
                     out=np.zeros_like(values), result=None, parts=[(0, values.size)], priority=0, segment=seg)


def test_the_host_sum_is_pushed_once_and_its_result_handed_back(host):
    ones = np.ones(6, np.float32)
    seg1 = segment(host, ones * 2)
    local_push(host, 1, seg1)
    op = own_op(host, ones)
    host.rounds.own(op, 0)
    assert host.pushed == []  # rank 2 is not in yet
    host.rounds.locals = frozenset({1})  # (as if the host had two workers) the round completes
    host.rounds._advance(next(iter(host.rounds.rounds.values())))
    assert host.pushed == [(op, 0)]
    np.testing.assert_array_equal(op.segment.view(np.float32, 6), ones * 3)  # own + rank 1's, in place
    op.out[:] = 42.0  # the servers' result
    host.rounds.result(op, 0)
    kinds = [type(m).__name__ for m in replies(host.locals[1])]
    assert kinds == ["Ack", "Result"]
    np.testing.assert_array_equal(seg1.view(np.float32, 6), np.full(6, 42.0))
    assert host.rounds.rounds == {}


def test_a_stranger_gets_nothing_and_a_borrowed_segment_is_refused(host):
    seg = segment(host, np.ones(6, np.float32))
    with pytest.raises(ProtocolError, match="no other worker"):
        local_push(host, 3, seg)  # another host's worker: dropped, never answered
    assert replies(host.locals[3]) == []
    local_push(host, 2, seg)  # rank 2's pid is not this segment's owner
    (error,) = replies(host.locals[2])
    assert error.kind == "protocol" and "not its own" in error.why and owner_pid(seg.name) == os.getpid()
    assert host.rounds.rounds == {}


def test_a_mismatch_fails_the_local_the_leader_and_the_other_hosts(host):
    op = own_op(host, np.ones(6, np.float32))
    host.rounds.own(op, 0)
    seg = segment(host, np.ones(7, np.float32))
    local_push(host, 1, seg, count=7, sig={**SIG, "shape": [7]})
    error = [m for m in replies(host.locals[1]) if type(m).__name__ == "Error"]
    assert error and error[0].kind == "mismatch" and "(6,)" in error[0].why and "(7,)" in error[0].why
    assert host.failed and isinstance(host.failed[0][1], TensorMismatchError)
    (poison,) = host.poisoned  # the servers hear it too: nobody waits for this host's sum
    assert poison[0] == (3, 11, 0, 0)
    assert host.pushed == []


def test_a_round_missing_a_local_times_out_naming_it(host):
    op = own_op(host, np.ones(6, np.float32))
    host.rounds.own(op, 0)
    local_push(host, 1, segment(host, np.ones(6, np.float32)))
    host.rounds.expire(time.monotonic() + 1.0)  # past BPS_GOSSIP_TIMEOUT (0.5 s here)
    (_, error), = host.failed
    assert "ranks [2]" in str(error) and "BPS_GOSSIP_TIMEOUT" in str(error)
    assert [m.kind for m in replies(host.locals[1]) if type(m).__name__ == "Error"] == ["timeout"]
    assert host.rounds.rounds == {}


def test_old_generations_and_twice_pushed_partitions_are_refused(host):
    seg = segment(host, np.ones(6, np.float32))
    local_push(host, 1, seg, gen=2)
    assert [m.kind for m in replies(host.locals[1])] == ["changed"]
    local_push(host, 1, seg, req=8)
    local_push(host, 1, seg, req=9)
    errors = [m for m in replies(host.locals[1]) if type(m).__name__ == "Error"]
    assert len(errors) == 1 and errors[0].req == 9 and "twice" in errors[0].why


def test_open_rounds_are_bounded(host):
    seg = segment(host, np.ones(6, np.float32))
    for seq in range(MAX_HOST_ROUNDS):  # fill the table directly: sending 16k messages is slow
        host.rounds._round((3, 11, 0, seq), "w", (SIG, "<f4", 6), 1)
    local_push(host, 1, seg, seq=MAX_HOST_ROUNDS)
    (error,) = [m for m in replies(host.locals[1]) if type(m).__name__ == "Error"]
    assert "rounds open" in error.why


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
@pytest.mark.parametrize("nbytes", [0, 8, host_reduce.IN_CACHE, host_reduce.IN_CACHE + 8, 5 * host_reduce.BLOCK_BYTES + 24])
def test_the_blocked_sum_and_copy_match_adding_each_local_in_turn(dtype, nbytes):
    """The leader adds its locals block by block (each read once): the same bits, in the same order."""
    rng = np.random.default_rng(nbytes)
    count = nbytes // np.dtype(dtype).itemsize
    mine = (rng.standard_normal(count) * 100).astype(dtype)
    regions = [(rng.standard_normal(count) * 100).astype(dtype) for _ in range(3)]
    want = mine.copy()
    for region in regions:
        np.add(want, region, out=want)
    host_reduce.add_into(mine, regions)
    assert np.array_equal(mine, want)
    outs = [np.zeros(count, dtype) for _ in range(3)]
    host_reduce.copy_to(mine, outs)
    assert all(np.array_equal(out, want) for out in outs)
