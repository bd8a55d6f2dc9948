"""Which secure handshakes a server completes: connections bounded in total, per key, and for keys
that are in no address book.

Each connection costs a server ZeroMQ's session and CURVE state (about 44 KiB idle: 1,000 idle
connections grew one by 43 MiB on this project's 2-core VM), and every holder of the secret
completes the handshake. So the server's ZAP handler asks a gate (:func:`~.security.set_admission`)
about each new connection's public key:

- a key in no address book (a stranger, or a joiner the server has no book for yet) is admitted
  while the server holds fewer than ``members + STRANGER_CONNECTIONS`` live connections;
- a member's key while it holds fewer than ``MEMBER_CONNECTIONS x members + STRANGER_CONNECTIONS``;
- and no key more than KEY_HANDSHAKES times in KEY_SECONDS (a member connects once to a server,
  and once more after each lost link).

Live: completed handshakes not yet disconnected (the socket's monitor,
:class:`~.security.FailedHandshakes`), plus admissions of the last IN_FLIGHT_SECONDS the monitor
has not reported complete (else a burst would pass before the first is counted). Connections
still in their handshake do not count: a process without the secret cannot get members refused.
libzmq says which descriptor closed, never its key, so "per key" is a rate of handshakes and the
total bounds what it accumulates. A refused client's ZeroMQ retries later.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from .security import key_tag

STRANGER_CONNECTIONS = 64  # live connections beyond one per member that keys in no book may fill
MEMBER_CONNECTIONS = 4  # per member, for everyone: room for reconnects and a next generation's joiners
KEY_HANDSHAKES = 8  # handshakes one key completes in KEY_SECONDS
KEY_SECONDS = 60.0
MAX_KEYS = 4096  # keys whose recent handshakes are remembered (a stranger can make keys at will)
IN_FLIGHT_SECONDS = 1.0  # an admitted handshake counts as live this long before the monitor's count has it


class HandshakeCounts(Protocol):
    """What the bound socket's monitor counts (:class:`~.security.FailedHandshakes`)."""

    authenticated: int  # connections that completed the handshake and are not yet disconnected
    succeeded: int  # handshakes completed, ever


def route_tag(route: bytes) -> str:
    """The key tag a member's routing id ends with (see :func:`~.security.routing_id`)."""
    return route.split(b"/", 1)[0].rsplit(b"-", 1)[-1].decode(errors="replace")


class ConnectionGate:
    """Admits or refuses each new secure connection (the module docstring says how), counting
    from ``watch``, the bound socket's monitor. Called from the ZAP thread; the server's loop
    sets the members and calls :meth:`report`."""

    def __init__(self, watch: HandshakeCounts, log: logging.Logger, every: float = 10.0) -> None:
        self.watch = watch
        self.log = log
        self.every = every
        self._members: frozenset[str] = frozenset()  # key tags; replaced whole, read without the lock
        # admissions in the last IN_FLIGHT_SECONDS: (when, handshakes the monitor had seen complete then)
        self._admitted: collections.deque[tuple[float, int]] = collections.deque()
        self._recent: dict[str, collections.deque[float]] = {}  # key tag -> its handshakes' times
        self._lock = threading.Lock()
        self.refused = 0
        self._reported = 0
        self._next = 0.0

    def set_members(self, routes: Iterable[bytes]) -> None:
        """The routing ids of the members this server serves now (its address book's workers)."""
        self._members = frozenset(route_tag(route) for route in routes)

    def limits(self) -> tuple[int, int]:
        """Live connections below which a stranger, and a member, is admitted."""
        members = len(self._members)
        return members + STRANGER_CONNECTIONS, MEMBER_CONNECTIONS * members + STRANGER_CONNECTIONS

    def admit(self, public: bytes) -> bool:
        """Whether the connection of the client with ``public`` (Z85) may complete its handshake."""
        tag = key_tag(public)
        stranger_limit, member_limit = self.limits()
        now = time.monotonic()
        with self._lock:
            if self.live(now) >= (member_limit if tag in self._members else stranger_limit):
                self.refused += 1
                return False
            times = self._recent.get(tag)
            if times is None:
                if len(self._recent) >= MAX_KEYS:
                    self._forget(now)
                times = self._recent[tag] = collections.deque()
            while times and now - times[0] > KEY_SECONDS:
                times.popleft()
            if len(times) >= KEY_HANDSHAKES:
                self.refused += 1
                return False
            times.append(now)
            self._admitted.append((now, self.watch.succeeded))
            return True

    def live(self, now: float) -> int:
        """Authenticated connections, and admitted ones not reported complete yet (under the lock)."""
        while self._admitted and now - self._admitted[0][0] > IN_FLIGHT_SECONDS:
            self._admitted.popleft()
        in_flight = len(self._admitted) - (self.watch.succeeded - self._admitted[0][1]) if self._admitted else 0
        return self.watch.authenticated + max(0, in_flight)

    def _forget(self, now: float) -> None:
        """Drop the keys with no handshake in KEY_SECONDS, else the oldest seen (under the lock)."""
        self._recent = {tag: times for tag, times in self._recent.items() if times and now - times[-1] <= KEY_SECONDS}
        while len(self._recent) >= MAX_KEYS:
            self._recent.pop(next(iter(self._recent)))

    def report(self) -> None:
        """Log the refusals since the last line, at most once per ``every`` seconds (non-blocking)."""
        now = time.monotonic()
        refused = self.refused
        if refused == self._reported or now < self._next:
            return
        stranger_limit, member_limit = self.limits()
        self.log.warning("refused %d connection(s) in the last %.0f s (%d in all): %d live, at most %d for keys in no "
                         "address book and %d in all; at most %d handshakes a key in %.0f s",
                         refused - self._reported, self.every, refused, self.watch.authenticated, stranger_limit,
                         member_limit,
                         KEY_HANDSHAKES, KEY_SECONDS)
        self._reported, self._next = refused, now + self.every
