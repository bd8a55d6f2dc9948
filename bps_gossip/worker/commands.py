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
    """Base of every inbox command; ``future``, where a command has one, is what its caller waits on."""

    # No annotation: a class attribute, not a field (a field here would come first in every
    # command's arguments); the commands that have a future declare it as their own field.
    future = None


@dataclasses.dataclass
class Submit(Command):
    """Send a push_pull's partitions."""

    op: Operation

    @property
    def future(self) -> Future:
        return self.op.future


@dataclasses.dataclass
class Barrier(Command):
    """Wait until every worker reaches the barrier."""

    future: Future = dataclasses.field()


@dataclasses.dataclass
class Stats(Command):
    """Collect every server's counters."""

    future: Future = dataclasses.field()


@dataclasses.dataclass
class Rejoin(Command):
    """Elastic: join the next generation (completes with its address book)."""

    future: Future = dataclasses.field()


@dataclasses.dataclass
class Commit(Command):
    """Elastic: ask the scheduler whether workers wait to join (completes with a bool)."""

    future: Future = dataclasses.field()


@dataclasses.dataclass
class Finished(Command):
    """Elastic: this worker finished training."""


@dataclasses.dataclass
class HoldsState(Command):
    """Elastic: this worker now holds the job's state."""


@dataclasses.dataclass
class Stop(Command):
    """Leave the job and end the engine thread."""

    future: Future = dataclasses.field()
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
    """Complete ``future`` with the messages of (tag, round) from ``sources``."""

    tag: str
    rnd: int
    sources: list[int]
    future: Future = dataclasses.field()


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
