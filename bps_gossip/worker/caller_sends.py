"""Small push_pulls sent from their caller's thread: a part of
:class:`~bps_gossip.worker.server_links.ServerLinks` (its state, its thread and lock).

A small push_pull of one partition with nothing queued ahead of it is sent by its caller at once
(``push_now``): handing it to the engine thread cost a wake of that thread and a pass of its loop,
about a third of the engine's CPU per small push_pull. ZeroMQ sockets are not thread-safe, so
the engine never polls the server sockets (nor a local's socket to its host leader) themselves
while the caller may send on them: it polls their notification descriptors (ZMQ_FD, which only
say "look at ZMQ_EVENTS") and uses the sockets only while it holds ``lock``. A send can consume
the notification of a reply that arrived meanwhile; whoever sent checks ZMQ_EVENTS afterwards
(``readable``) so that no reply waits unseen.
"""

from __future__ import annotations

from typing import Any

from ..protocol.data import SMALL_PUSH_BYTES
from ..transport.receive import readable
from .host_reduce import Way
from .operation import Operation
from .server_choice import server_of


class CallerSends:
    """push_now and what the engine checks after it; ServerLinks provides every attribute used here."""

    sockets: list[Any]
    hosts: Any
    config: Any
    _heap: list[Any]
    _unacked: dict[int, int]
    _look: bool
    _sent: bool
    _track: Any
    _push: Any

    def push_now(self, op: Operation) -> bool:
        """On the caller's thread, holding ``lock``: send ``op`` at once if it is one small
        partition pushed straight to a server or to this host's leader and nothing waits to go
        before it (what dispatch would send first); False: queue it as any other. (A host leader's
        own partition goes through the engine: entered in its round from here, while no local's
        push was in, a 4 KiB push_pull of 2 workers took 420 us instead of 368.)"""
        if len(op.parts) != 1 or op.codecs is not None or op.traced or self._heap or not self.sockets \
                or len(self._unacked) >= self.config.scheduling_credit \
                or op.parts[0][1] * op.send.dtype.itemsize > SMALL_PUSH_BYTES:
            return False
        way = self.hosts.way(op)
        if way is Way.DIRECT:
            sock = self.sockets[server_of(op.key, 0, len(self.sockets))]
        elif way is Way.TO_LEADER and op.segment is not None and self.hosts.refusal(op) is None:
            sock = self.hosts.sock
        else:
            return False
        self._track(op)
        self._push(op, 0, way)
        self._sent = False  # the engine looked before it let go of the lock: only this socket is new
        self._look |= readable(sock)
        return True

    @property
    def unseen(self) -> bool:
        """Whether replies may wait that the engine must read (see push_now)."""
        return self._look

    def readable(self) -> bool:
        """After the engine's sends: whether a reply waits that the server sockets' descriptors
        may not announce (then the engine reads before it sleeps)."""
        if self._sent:
            self._sent = False
            self._look |= any(readable(sock) for sock in self.sockets) \
                or (self.hosts.sock is not None and readable(self.hosts.sock))
        return self._look
