"""Elastic: workers reported as stuck, removed only on good evidence.

Servers (a round some ranks pushed and others did not, for BPS_GOSSIP_STALL_TIMEOUT) and
workers (a gossip peer, or a host's leader waiting for its local workers, or for its own training
while all of them wait) report ranks that others wait on. A server's report is taken alone. A
worker's must be confirmed by the reported rank itself: its heartbeats carry the count of
operations its training has started, and it is removed only once that count has stood still for
BPS_GOSSIP_STALL_TIMEOUT as well, so that one member cannot have a rank that is working removed.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..config import Config
from ..protocol import Stalled
from .membership import Membership, Node


def heard_progress(node: Node, progress: int | None, now: float) -> None:
    """A heartbeat of ``node`` said how many operations its training has started so far."""
    if progress is not None and progress != node.progress:
        node.progress, node.progress_at = progress, now


class StallReports:
    """Reports of stuck workers, acted on (``remove(worker, why)``) once they are confirmed."""

    def __init__(self, config: Config, members: Membership, log: logging.Logger,
                 remove: Callable[[Node, str], None]) -> None:
        self.config = config
        self.members = members
        self.log = log
        self.remove = remove
        self.waiting: dict[bytes, tuple[int, str]] = {}  # uid -> (generation, why): a worker's word only

    def report(self, msg: Stalled, reporter: Node, now: float) -> None:
        """``reporter`` says ``msg.ranks`` pushed nothing while it waited."""
        if msg.generation != self.members.generation:
            return  # of an old generation
        for worker in self.members.workers("alive"):
            if worker.rank not in msg.ranks:  # a host leader may report itself (its training stalled)
                continue
            why = (f"stuck: {msg.why} (BPS_GOSSIP_STALL_TIMEOUT={self.config.stall_timeout:g}, "
                   f"seen by {reporter.describe()})")
            if reporter.role == "server" or self._idle(worker, now):
                self.remove(worker, why)
            elif worker.uid not in self.waiting:
                self.log.warning("%s reported as stuck by %s; its heartbeats say it is still working: "
                                 "removed only if they stop saying so", worker.describe(), reporter.describe())
                self.waiting[worker.uid] = (msg.generation, why)

    def check(self, now: float) -> None:
        """Remove the reported workers whose own heartbeats now agree; forget stale reports."""
        for uid, (generation, why) in list(self.waiting.items()):
            worker = self.members.nodes.get(uid)
            if worker is None or worker.state != "alive" or generation != self.members.generation:
                del self.waiting[uid]
            elif self._idle(worker, now):
                del self.waiting[uid]
                self.remove(worker, why)

    def _idle(self, worker: Node, now: float) -> bool:
        return now - worker.progress_at >= self.config.stall_timeout
