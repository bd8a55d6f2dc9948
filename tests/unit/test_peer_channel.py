"""The worker's peer endpoint and channel in one process: two ranks' endpoints on 127.0.0.1
exchange real gossip messages; rounds are filed by (tag, round, source), early rounds wait for
their reader, a duplicate or a stranger is refused, lost and silent peers fail the wait, and the
next generation's messages wait for its book. No subprocess."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest
import zmq

from bps_gossip.config import Config
from bps_gossip.errors import CommTimeoutError, PeerLostError, ProtocolError
from bps_gossip.futures import Future
from bps_gossip.protocol import BookEntry
from bps_gossip.worker.commands import PeerExpect, PeerSend
from bps_gossip.worker.peer_endpoint import PeerEndpoint
from bps_gossip.worker.scheduler_link import Book

pytestmark = pytest.mark.timeout(60)
UIDS = [b"worker-a-0123456789abcdef", b"worker-b-0123456789abcdef"]


@pytest.fixture
def pair():
    """Two endpoints (ranks 0 and 1) in generation 1; closed afterwards."""
    config = dataclasses.replace(Config(), timeout=0.5, shm=False)
    ctx = zmq.Context.instance()
    ends = [PeerEndpoint(ctx, config, uid, logging.getLogger(f"peer{i}"), None) for i, uid in enumerate(UIDS)]
    for rank, end in enumerate(ends):
        end.new_generation(book(rank, ends, 1))
    yield ends
    for end in ends:
        end.close()


def book(rank, ends, generation):
    workers = [BookEntry(rank=i, uid=uid.hex(), addr=end.address, host="127.0.0.1", pid=1, local_rank=i, local_size=2)
               for i, (uid, end) in enumerate(zip(UIDS, ends))]
    return Book(rank=rank, size=2, local_rank=rank, local_size=2, generation=generation, servers=[], workers=workers)


def pump(end, until, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        if end.sock.poll(50):
            end.drain()
    return until()


def send(end, dst, rnd, value, tag="g"):
    end.send(PeerSend(dst, {"tag": tag, "round": rnd, "keys": ["w"], "weight": 0.5}, [np.full(3, value)]))


def test_rounds_are_filed_until_someone_waits(pair):
    a, b = pair
    send(a, 1, 1, 2.0)  # round 1 before round 0: kept apart, never mixed
    send(a, 1, 0, 1.0)
    pump(b, lambda: len(b.channel.inbox) == 2)
    for rnd, value in ((0, 1.0), (1, 2.0)):
        future = Future()
        b.expect(PeerExpect("g", rnd, [0], future))
        header, arrays = future.result(0)[0]
        assert header["keys"] == ["w"] and header["weight"] == 0.5 and header["round"] == rnd
        np.testing.assert_array_equal(arrays[0], np.full(3, value))
    assert not b.channel.inbox


def test_a_wait_completes_when_the_round_arrives(pair):
    a, b = pair
    future = Future()
    b.expect(PeerExpect("g", 0, [0], future))
    assert not future.done()
    send(a, 1, 0, 5.0)
    assert pump(b, future.done)
    np.testing.assert_array_equal(future.result(0)[0][1][0], np.full(3, 5.0))


def test_a_round_sent_twice_is_refused(pair):
    a, b = pair
    send(a, 1, 0, 1.0)
    pump(b, lambda: b.channel.inbox)
    send(a, 1, 0, 9.0)
    assert b.sock.poll(2000)
    with pytest.raises(ProtocolError, match="twice"):
        b.channel.on_message(*_receive_gossip(b))


def _receive_gossip(end):
    from bps_gossip.protocol import Gossip
    from bps_gossip.transport import recv_message
    route, header, frames = recv_message(end.sock, routed=True)
    return route, Gossip.decode(header), frames


def test_a_stranger_is_refused(pair):
    _, b = pair
    with pytest.raises(ProtocolError, match="no peer"):
        b.channel.sender(b"somebody-else")
    with pytest.raises(ProtocolError, match="no peer"):
        b.channel.sender(UIDS[1])  # itself


def test_lost_and_silent_peers_fail_the_wait(pair):
    _, b = pair
    lost = Future()
    b.expect(PeerExpect("g", 0, [0], lost))
    b.channel.on_worker_gone(0, "lost", "worker rank 0 was lost: killed")
    with pytest.raises(PeerLostError, match="killed"):
        lost.result(0)
    later = Future()
    b.expect(PeerExpect("g", 1, [0], later))  # a job that is not elastic cannot go on
    with pytest.raises(PeerLostError):
        later.result(0)


def test_a_silent_peer_times_out(pair):
    _, b = pair
    silent = Future()
    b.expect(PeerExpect("g", 0, [0], silent))
    b.check_deadlines(time.monotonic() + 1.0)  # past BPS_GOSSIP_TIMEOUT (0.5 s here)
    with pytest.raises(CommTimeoutError, match=r"ranks \[0\] sent nothing"):
        silent.result(0)


def test_next_generation_waits_for_its_book(pair):
    a, b = pair
    a.new_generation(book(0, pair, 2))  # rank 0 has the next book, rank 1 not yet
    b.next_generation = 2
    send(a, 1, 0, 7.0)
    pump(b, lambda: b._early)
    assert not b.channel.inbox  # held, not filed in generation 1
    b.new_generation(book(1, pair, 2))
    future = Future()
    b.expect(PeerExpect("g", 0, [0], future))
    np.testing.assert_array_equal(future.result(0)[0][1][0], np.full(3, 7.0))


def test_rounds_far_ahead_are_not_kept(pair):
    """Issue 22, item 4: a peer could park rounds nobody will claim for the whole job."""
    from bps_gossip.worker.peers import MAX_AHEAD

    a, b = pair
    send(a, 1, 0, 1.0)
    got = Future()
    b.expect(PeerExpect("g", 0, [0], got))
    assert pump(b, got.done)
    send(a, 1, 1 + MAX_AHEAD, 9.0)  # a runaway
    assert b.sock.poll(2000)
    with pytest.raises(ProtocolError, match="dropped"):
        b.channel.on_message(*_receive_gossip(b))
    send(a, 1, 1, 2.0)  # the next round is kept as before, and so is round 0 of a new averager
    send(a, 1, 0, 3.0)
    assert pump(b, lambda: ("g", 1) in b.channel.inbox and ("g", 0) in b.channel.inbox)


def test_a_message_is_stamped_with_its_transit_and_a_bogus_send_stamp_is_dropped(pair):
    """Gossip's routing sums receive-minus-send stamps: a sender's clock a day off (a liar's)
    must not reach the sums, which would stop being finite."""
    a, b = pair
    for rnd, shift in ((0, 0.0), (1, -1e300), (2, 2e5)):
        send(a, 1, rnd, 1.0)
        assert b.sock.poll(2000)
        route, msg, frames = _receive_gossip(b)
        assert msg.sent is not None and abs(msg.sent - time.time()) < 60
        b.channel.on_message(route, dataclasses.replace(msg, sent=msg.sent + shift), frames)
        future = Future()
        b.expect(PeerExpect("g", rnd, [0], future))
        transit = future.result(0)[0][0]["transit"]
        assert (transit is not None and 0 <= transit < 5) if shift == 0 else transit is None, (shift, transit)
