"""What API threads hand the engine thread: one small typed command per kind of work.

Each command names the future that waits for it (None where nothing waits), so a command
that will never run (the engine stopped, the generation ended) can be failed without
knowing what it is. The engine keeps one handler per command class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..futures import Future
from ..transport.shm import OwnedSegment
from .operation import Operation


@dataclasses.dataclass
class Command:
    """Base of every inbox command."""

    @property
    def future(self) -> Future | None:
        """The future waiting for this command, if any."""
        return getattr(self, "waiter", None)


@dataclasses.dataclass
class Submit(Command):
    """Send a push_pull's partitions."""

    op: Operation

    @property
    def future(self) -> Future:
        return self.op.handle


@dataclasses.dataclass
class Barrier(Command):
    """Wait until every worker reaches the barrier."""

    waiter: Future


@dataclasses.dataclass
class Stats(Command):
    """Collect every server's counters."""

    waiter: Future


@dataclasses.dataclass
class Rejoin(Command):
    """Elastic: join the next generation (completes with its address book)."""

    waiter: Future


@dataclasses.dataclass
class Commit(Command):
    """Elastic: ask the scheduler whether workers wait to join (completes with a bool)."""

    waiter: Future


@dataclasses.dataclass
class Finished(Command):
    """Elastic: this worker finished training."""


@dataclasses.dataclass
class HoldsState(Command):
    """Elastic: this worker now holds the job's state."""


@dataclasses.dataclass
class Stop(Command):
    """Leave the job and end the engine thread."""

    waiter: Future
    crashed: bool = False


@dataclasses.dataclass
class PeerSend(Command):
    """Send a gossip message (arrays as frames, or only the header of staged arrays)."""

    dst: int
    header: dict[str, Any]
    arrays: list[np.ndarray]
    staged: tuple[str, OwnedSegment, list[int]] | None = None


@dataclasses.dataclass
class PeerAck(Command):
    """Tell a peer its shared-memory message was read."""

    dst: int
    segment: str


@dataclasses.dataclass
class PeerExpect(Command):
    """Complete ``waiter`` with the messages of (tag, round) from ``sources``."""

    tag: str
    rnd: int
    sources: list[int]
    waiter: Future


@dataclasses.dataclass
class PeerBlocked(Command):
    """Training has been blocked for a while in gossip round ``seq`` of tag ``name`` (kind
    'gossip'), or in push_pull ``name``, this rank's ``seq``-th use of it (kind 'collective'),
    or is no longer blocked in that collective (kind 'none'). The peers are told (they can then
    tell a wait that would only time out); ``verdict`` (collective) fails if one finds the ranks
    out of step."""

    kind: str
    name: str
    seq: int
    since: float  # time.monotonic() when the wait began
    verdict: Future | None = None
