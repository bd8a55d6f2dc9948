"""Pushes that came before the address book of their generation, held until it arrives.

A worker that has its new book pushes at once; its server may get the same book a moment later.
Those pushes are held, bounded three ways, so that no sender can crowd out the others (issue
37: any holder of the secret could fill the one list, and honest members' early pushes during an
elastic change were refused): each sender (connection) at most MAX_PER_SENDER pushes and
MAX_BYTES_PER_SENDER bytes; the senders that are in no address book this server has (a joiner,
or a stranger) together at most half of the whole; and everything at most MAX_PUSHES and
MAX_BYTES. Bytes count the headers too: they can be most of what a push holds.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Tuple

from ..protocol import Push

MAX_PUSHES = 16384
MAX_BYTES = 512 << 20
MAX_PER_SENDER = 1024  # one worker's pushes of one step, early: a model's partitions
MAX_BYTES_PER_SENDER = 128 << 20
STRANGERS_SHARE = 2  # the senders of no book hold at most 1/this of the whole

Held = Tuple[float, bytes, Push, list, int]  # (since, route, push, frames, bytes held)


class EarlyPushes:
    """The held pushes, in arrival order, with what each sender holds."""

    def __init__(self) -> None:
        self.held: collections.deque[Held] = collections.deque()
        self.bytes = 0
        self.by_sender: dict[bytes, list[int]] = {}  # route -> [pushes, bytes]
        self.strangers = [0, 0]  # pushes and bytes of senders in no book

    def __len__(self) -> int:
        return len(self.held)

    def refusal(self, route: bytes, nbytes: int, member: bool) -> str | None:
        """Why a push of ``nbytes`` from ``route`` (``member``: in the current book) cannot be
        held, or None."""
        pushes, held = self.by_sender.get(route, (0, 0))
        if pushes >= MAX_PER_SENDER or held + nbytes > MAX_BYTES_PER_SENDER:
            return f"this sender holds {pushes} early pushes ({held} bytes) already"
        if not member and (self.strangers[0] >= MAX_PUSHES // STRANGERS_SHARE
                           or self.strangers[1] + nbytes > MAX_BYTES // STRANGERS_SHARE):
            return (f"senders in no address book hold {self.strangers[0]} early pushes ({self.strangers[1]} "
                    "bytes) already")
        if len(self.held) >= MAX_PUSHES or self.bytes + nbytes > MAX_BYTES:
            return f"{len(self.held)} early pushes ({self.bytes} bytes) are held already"
        return None

    def hold(self, route: bytes, push: Push, frames: list, nbytes: int, member: bool) -> None:
        """Keep one push (after :meth:`refusal` said None)."""
        self.held.append((time.monotonic(), route, push, frames, nbytes))
        self._count(route, 1, nbytes, member)

    def take_all(self) -> list[Held]:
        """Every held push, in order; nothing is held after."""
        held = list(self.held)
        self.held.clear()
        self.bytes, self.by_sender, self.strangers = 0, {}, [0, 0]
        return held

    def expired(self, now: float, timeout: float, members: Any) -> list[Held]:
        """The pushes held longer than ``timeout`` seconds, no longer held (``members``: the routes
        of the current book, as they were counted when held)."""
        out = []
        while self.held and now - self.held[0][0] > timeout:
            item = self.held.popleft()
            self._count(item[1], -1, -item[4], item[1] in members)
            out.append(item)
        return out

    def _count(self, route: bytes, pushes: int, nbytes: int, member: bool) -> None:
        self.bytes += nbytes
        counts = self.by_sender.setdefault(route, [0, 0])
        counts[0] += pushes
        counts[1] += nbytes
        if counts[0] <= 0:
            del self.by_sender[route]
        if not member:
            self.strangers[0] += pushes
            self.strangers[1] += nbytes
