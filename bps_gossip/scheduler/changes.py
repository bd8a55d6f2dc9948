"""Elastic membership changes: a lost worker or server, a graceful leave, or (at the next commit
check) workers waiting to join open a new generation.

Every member is told ``changed`` at once (pending work of the old generation fails,
recoverably); the workers answer ``rejoin``; once all have, the new address book goes out with
one ``restore`` flag for everybody (true if anything crashed since the last book). A job below
BPS_GOSSIP_MIN_WORKERS for longer than BPS_GOSSIP_ELASTIC_TIMEOUT fails with a message to every
worker. Once a worker finished training, the job admits nobody more and ends when the rest have.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from ..config import Config
from ..protocol import AddressBook, BookEntry, Changed, JobOver, Message, Rejoin, Wait
from .membership import Membership, Node

Send = Callable[[bytes, Message], None]


@dataclasses.dataclass
class Change:
    """An elastic membership change in progress: who has rejoined, and why it began."""

    generation: int
    restore: bool
    why: list[str]
    since: float = dataclasses.field(default_factory=time.monotonic)
    ready: set[bytes] = dataclasses.field(default_factory=set)


def address_book(members: Membership, rank: int, restore: bool = False) -> AddressBook:
    """The current address book as node ``rank`` receives it."""
    book = members.book()
    return AddressBook(rank=rank, generation=book["generation"], servers=book["servers"],
                       workers=[BookEntry(**entry) for entry in book["workers"]], restore=restore)


class Changes:
    """The scheduler's elastic generations (see the module docstring). ``send`` reaches a member;
    ``end(why, failed)`` ends the job; ``opened()`` runs when a generation opens (barriers and
    commit checks of the old one are void); ``formed(generation, workers)`` when its book went out."""

    def __init__(self, config: Config, members: Membership, log: logging.Logger, send: Send,
                 end: Callable[[str, bool], None], opened: Callable[[], None],
                 formed: Callable[[int, int], None] = lambda _generation, _workers: None) -> None:
        self.config = config
        self.members = members
        self.log = log
        self.send = send
        self.end = end
        self.opened = opened
        self.formed = formed
        self.change: Change | None = None  # a change waiting for rejoins
        self.closing: str | None = None  # why the job admits nobody more (a worker finished)

    def gone(self, node: Node, how: str, reason: str) -> None:
        """A member left or was lost while the job runs."""
        if node.state == "joining" or (node.role == "worker" and node.rank < 0):
            return  # never admitted: nobody depended on it
        if node.role == "server":
            if not self.members.servers("alive"):
                self.end(f"the last server ({node.describe()}) {how}: {reason}", True)
                return
        elif not self.members.workers("alive") and not self.members.workers("joining") \
                and (how == "left" or self.closing is not None):
            self.end("every worker has shut down" if how == "left" else
                     f"the last worker was lost after the job finished training ({self.closing})", False)
            return
        self.begin(restore=how == "lost", why=f"{node.describe()} {how}: {reason}")

    def begin(self, restore: bool, why: str) -> None:
        """Open a new generation: every member drops the old one and the workers rejoin."""
        generation = self.members.next_generation()
        if self.change is not None:  # a change during a change: one more reason, same rendezvous
            restore = restore or self.change.restore
            reasons = [*self.change.why, why]
            since = self.change.since
        else:
            reasons, since = [why], time.monotonic()
        self.change = Change(generation, restore, reasons, since)
        self.opened()  # their members fail them locally on 'changed'
        self.log.info("generation %d begins (%s): %s", generation, "restore" if restore else "no restore", why)
        notice = Changed(generation=generation, restore=restore, why=why)
        for member in self.members.nodes.values():
            if member.state == "alive":
                self.send(member.uid, notice)
        self.maybe_finish()

    def rejoin(self, uid: bytes, msg: Rejoin, node: Node) -> None:
        """A worker is ready for the new generation."""
        if self.change is None or msg.generation != self.change.generation:
            return  # an old generation's rejoin: a newer 'changed' is on its way to it
        if self.closing is not None and not msg.has_state:
            self.job_over(node)  # admitted, but the job finished before its state sync did
        else:
            self.change.ready.add(uid)
        self.maybe_finish()

    def joiner(self, node: Node) -> None:
        """A worker registered while the job runs: it waits for the next commit check (or the
        change under way), unless the job is over."""
        if self.closing is not None:
            self.job_over(node)
            return
        self.send(node.uid, Wait(why="the job is running; joining at its next commit"))
        if self.change is not None or not self.members.workers("alive"):
            self.maybe_finish()  # nobody will commit: admit it with this change

    def finished(self, node: Node) -> None:
        """A worker finished training: the job succeeds from here on. Nobody more is admitted,
        joiners without the job's state are told it is over (they exit 0), and the job no
        longer fails for having fewer than BPS_GOSSIP_MIN_WORKERS (the rest are finishing)."""
        if not self.config.elastic or self.closing is not None:
            return
        self.closing = f"{node.describe()} finished training"
        self.log.info("%s: the job admits no more workers", self.closing)
        for joiner in self.members.workers("joining"):
            self.job_over(joiner)

    def job_over(self, node: Node) -> None:
        """Tell ``node`` it is not needed: the job finished."""
        self.members.mark(node.uid, "left")
        self.send(node.uid, JobOver(why=self.closing or ""))
        self.log.info("%s is not needed: %s", node.describe(), self.closing)

    def maybe_finish(self) -> None:
        """Send the new book once every surviving worker rejoined and there are enough."""
        if self.change is None:
            if self.members.workers("joining"):
                self.begin(restore=False, why="workers joined a job without workers")
            return
        alive = {w.uid for w in self.members.workers("alive")}
        count = len(alive) + len(self.members.workers("joining"))
        if not alive and self.closing is not None:
            self.end(f"every worker has finished ({self.closing})", False)
            return
        needed = 1 if self.closing is not None else max(1, self.config.min_workers)
        if not alive <= self.change.ready or count < needed:
            return
        change, self.change = self.change, None
        joined = self.members.reassign()
        for member in self.members.nodes.values():
            if member.state == "alive":
                self.send(member.uid, address_book(self.members, member.rank, change.restore))
        book = self.members.book()
        self.log.info("generation %d: %d workers (%d joined), %d servers, restore=%s",
                      book["generation"], len(book["workers"]), len(joined), len(book["servers"]), change.restore)
        self.formed(book["generation"], len(book["workers"]))

    def check(self, now: float) -> None:
        """Fail a job whose change has waited past BPS_GOSSIP_ELASTIC_TIMEOUT."""
        change, cfg = self.change, self.config
        if change is None or now - change.since <= cfg.elastic_timeout:
            return
        busy = [w for w in self.members.workers("alive") if w.uid not in change.ready]
        if busy and not change.restore:
            # Only graceful leaves so far: workers that have not rejoined are finishing their own
            # work (a last evaluation, a checkpoint) and will leave or rejoin; nothing is stuck.
            return
        count = len(self.members.workers("alive")) + len(self.members.workers("joining"))
        if count < cfg.min_workers and self.closing is None:
            self.end(f"only {count} worker(s) for {now - change.since:.0f} s, fewer than "
                     f"BPS_GOSSIP_MIN_WORKERS={cfg.min_workers} (BPS_GOSSIP_ELASTIC_TIMEOUT="
                     f"{cfg.elastic_timeout:g}); last change: " + "; ".join(change.why), True)
        else:
            missing = [w.describe() for w in busy]
            self.end(f"{', '.join(missing)} did not rejoin generation {change.generation} within "
                     f"BPS_GOSSIP_ELASTIC_TIMEOUT={cfg.elastic_timeout:g} s", True)
