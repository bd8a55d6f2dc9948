"""A server's replies, bounded for each worker that does not read them.

A worker reads whatever arrives from its servers (its DEALER has no receive mark), so a reply
waits on the server only while the link carries what came before it. A member that stops
reading, though, would have every reply to it queued for good: one per message it sends, and a
result's payload (the round's sum, as large as a partition) for every round it takes part in.

Two bounds hold that: ZeroMQ queues at most MAX_QUEUED_REPLIES messages for one connection (a
send past it is dropped here and counted, never blocks the server), and result payloads that
ZeroMQ has not handed to the kernel yet are counted in bytes per connection (a tracker per
payload of TRACKED_BYTES or more); past ``max_bytes``, a result is replaced by an error that
says why, so the worker's operation fails with a reason instead of timing out.

A connection whose key is in no address book of this server (a stranger that holds the secret,
or a worker removed from the job) is no member anyone waits on: it gets at most STRANGER_REPLIES
replies every STRANGER_SECONDS, the rest dropped. ZeroMQ's own mark let each such connection
queue 131,072 replies (about 18 MiB of errors for one that reads nothing), and nothing bounded
how many such connections a holder of the secret opens.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import zmq

from ..protocol import Error, Message, send
from ..protocol.data import SMALL_PUSH_BYTES
from ..transport.receive import DropLog
from ..transport.sockets import MAX_QUEUED_REPLIES

STRANGER_REPLIES = 16  # replies a connection in no book gets every STRANGER_SECONDS
STRANGER_SECONDS = 10.0
MAX_STRANGERS = 4096  # connections in no book whose replies are counted (the oldest window is forgotten)
MAX_QUEUED_REPLY_BYTES = 4 << 30  # result payloads queued for one connection (as a rank's open rounds)
TRACKED_BYTES = SMALL_PUSH_BYTES  # smaller payloads are bounded by the message count alone


class Outbox:
    """Sends a server's replies without blocking, within the bounds of the module docstring."""

    def __init__(self, sock: zmq.Socket, log: logging.Logger, max_bytes: int = MAX_QUEUED_REPLY_BYTES) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self.pending: dict[bytes, collections.deque[tuple[Any, int]]] = {}  # route -> (tracker, bytes), in order
        self.pending_bytes: collections.Counter[bytes] = collections.Counter()
        self.full = DropLog(log, "reply", verb="dropped a")
        self.dropped = 0  # replies a full queue refused
        self.refused = 0  # results replaced by an error (too many bytes queued)
        self.strangers: dict[bytes, tuple[float, int]] = {}  # route in no book -> (window start, replies in it)
        self.unanswered = 0  # replies to strangers dropped

    def send(self, route: bytes, msg: Message, payloads: tuple = (), who: str = "", member: bool = True) -> bool:
        """Send ``msg`` with ``payloads`` to ``route`` (``who`` names it in log lines; ``member``:
        the route is in this server's address book); False if it was dropped (the peer's queue is
        full, the peer is gone, or a stranger had its share)."""
        if not member and not self._stranger_may_get(route):
            self.unanswered += 1
            return False
        nbytes = sum(memoryview(payload).nbytes for payload in payloads)
        tracked = nbytes >= TRACKED_BYTES
        if tracked and self.held(route) + nbytes > self.max_bytes:
            msg = Error(req=getattr(msg, "req", 0), kind="protocol",
                        why=f"this server dropped a result of {nbytes} bytes: {self.held(route)} bytes of results "
                            f"to this worker are still queued, unsent (at most {self.max_bytes}); the worker does "
                            "not read its replies, or its link is far slower than its pushes")
            payloads, tracked = (), False
            self.refused += 1
        try:
            tracker = send(self.sock, msg, payloads, route=route, flags=zmq.NOBLOCK, track=tracked)
        except zmq.Again:
            self.dropped += 1
            self.full.dropped(f"{who or 'a connection'} has {MAX_QUEUED_REPLIES} replies queued, unread")
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False  # it disconnected: nobody to answer
        if tracked:
            self.pending.setdefault(route, collections.deque()).append((tracker, nbytes))
            self.pending_bytes[route] += nbytes
        return True

    def _stranger_may_get(self, route: bytes) -> bool:
        now = time.monotonic()
        start, count = self.strangers.get(route, (now, 0))
        if now - start > STRANGER_SECONDS:
            start, count = now, 0
        if count >= STRANGER_REPLIES:
            return False
        if route not in self.strangers and len(self.strangers) >= MAX_STRANGERS:
            self.strangers.pop(next(iter(self.strangers)))  # the oldest first seen
        self.strangers[route] = (start, count + 1)
        return True

    def held(self, route: bytes) -> int:
        """Bytes of payloads queued for ``route`` that ZeroMQ has not sent yet."""
        queue = self.pending.get(route)
        while queue and queue[0][0].done:
            self.pending_bytes[route] -= queue.popleft()[1]
        if queue is not None and not queue:
            del self.pending[route], self.pending_bytes[route]
        return self.pending_bytes.get(route, 0)

    def prune(self) -> None:
        """Forget the payloads ZeroMQ has sent (call now and then: routes that get no new reply)."""
        for route in list(self.pending):
            self.held(route)
        now = time.monotonic()
        self.strangers = {route: seen for route, seen in self.strangers.items() if now - seen[0] <= STRANGER_SECONDS}
