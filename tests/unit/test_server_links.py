"""The worker's server links in one process: priority order, credit, small pushes without
credit, results into place, errors and lost servers failing futures. Real ZeroMQ sockets on
127.0.0.1 stand in for servers; no subprocess."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import zmq

from bps_gossip.config import Config
from bps_gossip.errors import PeerLostError, TensorMismatchError
from bps_gossip.futures import Future
from bps_gossip.protocol.data import SMALL_PUSH_BYTES, partitions
from bps_gossip.transport import bind_random_port, recv_message, send_message
from bps_gossip.worker.operation import Operation
from bps_gossip.worker.scheduler_link import Book
from bps_gossip.worker.server_links import ServerLinks

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def servers():
    """Two ROUTERs on loopback, standing in for servers; closed afterwards."""
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    addrs = [bind_random_port(sock, "127.0.0.1") for sock in socks]
    yield socks, addrs
    for sock in socks:
        sock.close(linger=0)


def make_links(addrs, credit=2, nservers=1):
    config = dataclasses.replace(Config(), scheduling_credit=credit, shm=False)
    links = ServerLinks(zmq.Context.instance(), config, b"worker-test", logging.getLogger("test"), None, None)
    book = Book(rank=0, size=1, local_rank=0, local_size=1, generation=1, servers=addrs[:nservers], workers=[])
    assert links.connect(book)
    return links


def make_op(name, array, priority=0, part_bytes=1 << 20):
    flat = array.reshape(-1)
    out = np.empty_like(flat)
    return Operation(future=Future(), name=name, key=0, seq=0, sig={"dtype": str(flat.dtype), "shape": [flat.size],
                     "kind": "sum"}, send=flat, out=out, result=out,
                     parts=partitions(flat.size, flat.dtype.itemsize, part_bytes), priority=priority)


def receive_all(sock, expected):
    got = []
    while len(got) < expected and sock.poll(2000):
        got.append(recv_message(sock, routed=True))
    return got


def pump(links, sock):
    """Let the links read what the fake server sent."""
    sock_events = {}
    for link_sock in links.sockets:
        if link_sock.poll(2000):
            sock_events[link_sock] = zmq.POLLIN
    links.drain(sock_events)


def test_priority_order_and_credit(servers):
    socks, addrs = servers
    links = make_links(addrs, credit=2)
    big = SMALL_PUSH_BYTES // 4 + 1  # float32 elements: one partition just above the small limit
    low = make_op("low", np.ones(big, np.float32), priority=-5)
    high = make_op("high", np.ones(big * 3, np.float32), priority=5, part_bytes=big * 4)
    links.enqueue(low)
    links.enqueue(high)
    assert not links.dispatch()  # credit 2: two large partitions out, the rest waits
    sent = receive_all(socks[0], 2)
    assert [(m["name"], m["part"], m["ack"]) for _, m, _ in sent] == [("high", 0, True), ("high", 1, True)]
    assert not socks[0].poll(200)  # nothing more until an acknowledgement
    route = sent[0][0]
    send_message(socks[0], {"op": "ack", "req": sent[0][1]["req"]}, route=route)
    pump(links, socks[0])
    links.dispatch()
    (_, third, _), = receive_all(socks[0], 1)
    assert (third["name"], third["part"]) == ("high", 2)  # high priority first, whatever the order queued


def test_small_pushes_use_no_credit_and_results_land(servers):
    socks, addrs = servers
    links = make_links(addrs, credit=1)
    ops = [make_op(f"t{i}", np.full(4, float(i), np.float32)) for i in range(5)]
    for op in ops:
        links.enqueue(op)
    links.dispatch()
    sent = receive_all(socks[0], 5)
    assert len(sent) == 5 and not any(m["ack"] for _, m, _ in sent)  # all out at once, credit 1 or not
    for route, msg, frames in sent:
        total = np.frombuffer(frames[0].buffer, np.float32) * 2
        send_message(socks[0], {"op": "result", "req": msg["req"]}, (total,), route=route)
    while not all(op.future.done() for op in ops):
        pump(links, socks[0])
    for i, op in enumerate(ops):
        np.testing.assert_array_equal(op.future.result(0), np.full(4, 2.0 * i, np.float32))
    assert not links.pending


def test_error_reply_fails_the_operation(servers):
    socks, addrs = servers
    links = make_links(addrs)
    op = make_op("w", np.zeros(8, np.float32))
    links.enqueue(op)
    links.dispatch()
    (route, msg, _), = receive_all(socks[0], 1)
    send_message(socks[0], {"op": "error", "req": msg["req"], "kind": "mismatch", "why": "shapes differ"}, route=route)
    pump(links, socks[0])
    with pytest.raises(TensorMismatchError, match="shapes differ"):
        op.future.result(0)
    assert not links.pending


def test_lost_server_fails_what_needs_it(servers):
    socks, addrs = servers
    links = make_links(addrs, nservers=2)
    op = make_op("x", np.zeros(4, np.float32))  # key 0, one partition: server 0
    links.enqueue(op)
    links.server_gone(0, "server rank 0 was lost")
    with pytest.raises(PeerLostError, match="was lost"):
        op.future.result(0)
    later = make_op("y", np.zeros(4, np.float32))
    links.enqueue(later)
    links.dispatch()  # not sent to the lost server: failed at once
    with pytest.raises(PeerLostError):
        later.future.result(0)
    assert not socks[0].poll(100)


def test_a_server_that_stays_keeps_its_connection(servers):
    """A new generation without one of the servers: the worker keeps its connection to the other
    (a new one would present the same routing id while the server may still hold the old one, and a
    ROUTER without handover drops it with what was sent on it: a push was lost in an elastic job),
    closes the one to the server that left, and a push of the new generation arrives."""
    socks, addrs = servers
    links = make_links(addrs, nservers=2)
    first, second = links.sockets
    book = Book(rank=0, size=1, local_rank=0, local_size=1, generation=2, servers=[addrs[1]], workers=[])
    assert links.connect(book)
    assert links.sockets == [second] and first.closed and not second.closed
    links.enqueue(make_op("after", np.ones(4, np.float32)))
    links.dispatch()
    [(route, header, _)] = receive_all(socks[1], 1)
    assert route == b"worker-test" and header["name"] == "after" and header["gen"] == 2
    links.close()
