"""The receive loop every role shares: read what is waiting, dispatch by ``op`` from one table.

A role's table comes from :func:`bps_gossip.protocol.handlers`: keyed by
:class:`~bps_gossip.protocol.Op`, each entry decodes the header into its message class
(checking every field) before its handler runs.

A message that is not ours, names an op the table does not have, or fails a handler's
field checks (ProtocolError, and the KeyError/TypeError/ValueError of a bad field) is
dropped; a flood of them costs one log line per second, not one per message, and never
an exception in a receive loop. Each call reads at most ``limit`` messages, so a sender
that floods one socket cannot starve the others, heartbeats or timeouts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Callable, Dict, List

import zmq
from zmq.backend import Socket as _Backend

from ..errors import ProtocolError
from .framing import recv_message

Handler = Callable[[Any, Dict[str, Any], List[zmq.Frame]], None]  # (routing id or None, header, payload frames)
MALFORMED = (ProtocolError, KeyError, TypeError, ValueError)
_EVENTS, _POLLIN, _CURVE_SERVER = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.CURVE_SERVER)  # plain ints: pyzmq's enum arithmetic costs ~2 us a message
_get = _Backend.get  # pyzmq's compiled getsockopt, without the Python layer's enum conversions


class DropLog:
    """Reports dropped (or refused) messages at most once per ``interval`` seconds, with how
    many more: a flood of them cannot flood the log."""

    def __init__(self, log: logging.Logger, what: str, interval: float = 1.0, verb: str = "dropped a malformed",
                 level: int = logging.WARNING) -> None:
        self.log, self.what, self.interval = log, what, interval
        self.verb, self.level = verb, level
        self.last = -float("inf")
        self.unreported = 0

    def dropped(self, why: object) -> None:
        """Count one dropped message; log it if the last line is old enough."""
        now = time.monotonic()
        if now - self.last < self.interval:
            self.unreported += 1
            return
        more = f" (and {self.unreported} more since the last report)" if self.unreported else ""
        self.log.log(self.level, "%s %s: %s%s", self.verb, self.what, why, more)
        self.last, self.unreported = now, 0


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (ZMQ_EVENTS: also what a poll on its ZMQ_FD needs after a send)."""
    return bool(_get(sock, _EVENTS) & _POLLIN)


def drain(sock: zmq.Socket, routed: bool, handlers: Mapping[str, Handler], drops: DropLog, limit: int,
          curve: bool | None = None) -> bool:
    """Handle up to ``limit`` waiting messages of ``sock`` by their ``op``; on a CURVE ROUTER, only
    those whose routing id is their connection's key's (``curve``: whether ``sock`` serves CURVE,
    if the caller knows; else asked). True if it stopped at ``limit`` (more may wait: a poll on the
    socket's ZMQ_FD would not say so again)."""
    identified = routed and bool(_get(sock, _CURVE_SERVER) if curve is None else curve)
    for _ in range(limit):
        if not _get(sock, _EVENTS) & _POLLIN:
            return False
        try:
            route, msg, frames = recv_message(sock, routed, identified)
            handler = handlers.get(msg["op"])
            if handler is None:
                raise ProtocolError(f"unknown op {msg['op']!r}")
            handler(route, msg, frames)
        except MALFORMED as exc:
            drops.dropped(exc)
    return True
