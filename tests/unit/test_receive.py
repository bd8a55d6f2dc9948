"""The shared receive loop: dispatch by op from a table, bounded reads, one log line per second for junk."""

from __future__ import annotations

import logging

import msgpack
import zmq

from bps_gossip.errors import ProtocolError
from bps_gossip.transport.receive import DropLog, drain


def test_dispatch_bounds_and_rate_limited_drops(caplog):
    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        server.bind("inproc://receive-test")
        client.connect("inproc://receive-test")
        for index in range(300):
            if index % 3 == 0:
                client.send_multipart([msgpack.packb({"op": "echo", "n": index}), b"payload"])
            elif index % 3 == 1:
                client.send(b"\xc1 not msgpack")
            else:
                client.send(msgpack.packb({"op": "echo", "n": "not a number"}))
        seen = []

        def echo(route, msg, frames):
            if not isinstance(msg["n"], int):
                raise ProtocolError("n must be an integer")
            seen.append((route is not None, msg["n"], [bytes(f.buffer) for f in frames]))

        drops = DropLog(logging.getLogger("receive-test"), "message")
        assert server.poll(1000)  # one message in: the 300 were sent before, in order
        with caplog.at_level(logging.WARNING, logger="receive-test"):
            drain(server, True, {"echo": echo}, drops, 100)
            assert len(seen) == 34  # 100 messages read, one in three valid
            drain(server, True, {"echo": echo}, drops, 1000)
        assert len(seen) == 100 and seen[0] == (True, 0, [b"payload"])
        assert len(caplog.records) == 1 and "dropped a malformed message" in caplog.records[0].getMessage()
        assert drops.unreported == 199
        client.send(msgpack.packb({"op": "shutdown"}))
        assert server.poll(1000)
        drops.last -= 2  # a second later: the next drop is reported, with the count of the others
        with caplog.at_level(logging.WARNING, logger="receive-test"):
            drain(server, True, {"echo": echo}, drops, 10)
        assert "unknown op 'shutdown' (and 199 more" in caplog.records[-1].getMessage()
    finally:
        server.close(0)
        client.close(0)
