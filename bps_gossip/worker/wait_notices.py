"""Where ranks wait, told between peers: a rank a step ahead fails at once, timeouts say why.

Gossip pairs rounds one to one, so ranks that took different numbers of steps, or a rank that
evaluates alone, leave others waiting. When training has been blocked for ``notice_after``
seconds in a gossip round, the channel tells the ranks it misses (``GossipWaiting``); a rank
that is itself blocked, in a round or in a collective (an exact average through the servers),
answers where. Only ranks that wait that long for each other exchange these small messages.

A rank blocked in a round whose missing peer is blocked in a collective this rank has not
entered can never be released: the peer cannot leave the collective without this rank, which
cannot enter it before the peer's round comes. The engine counts the operations each name had
(a stale notice names a collective this rank has entered since: never a false alarm). The rank
fails at once with RanksOutOfStepError and tells the peer (``behind``), whose collective fails
alike, unless it did send the round. A timeout names where each missing rank waits, or that it
reported no wait (busy outside bps_gossip: evaluating alone?).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

from ..errors import RanksOutOfStepError
from ..futures import Future, fail
from ..protocol import GossipWaiting
from ..protocol.data import MAX_WAITED

if TYPE_CHECKING:  # the channel owns these notices (no import at run time: no cycle)
    from .peers import PeerChannel, PeerWait

NOTICE_AFTER = 2.0  # seconds blocked before the peers are told where (at most a quarter of BPS_GOSSIP_TIMEOUT)
EVALUATING_DOC = "docs/gossip.md#evaluating-on-one-rank"
OUT_OF_STEP_DOC = "docs/gossip.md#ranks-out-of-step"


def notice_after(timeout: float) -> float:
    """Seconds training waits before the peers are told where (BPS_GOSSIP_TIMEOUT ``timeout``)."""
    return min(NOTICE_AFTER, timeout / 4)


def _rounds(count: int) -> str:
    return f"{count} gossip round{'' if count == 1 else 's'} (one a step)"


def _purpose(name: str) -> str:
    """What an averager's collective is for, from its push_pull name (bps_gossip.gossip.averager)."""
    for marker, purpose in ((".average.", "average_parameters() or average_every"),
                            (".consensus.", "consensus_distance()"), (".route", "gossip's routing")):
        if marker in name:
            return f" ({purpose})"
    return ""


@dataclasses.dataclass(eq=False)
class BlockedCollective:
    """Training waits in push_pull ``name``, its ``seq``-th use; ``verdict`` fails if a peer
    that waits for this rank's gossip has not entered it (out of step)."""

    name: str
    seq: int
    since: float
    verdict: Future | None
    told: set[int] = dataclasses.field(default_factory=set)


class WaitNotices:
    """One channel's notices: where its peers said they wait, and where this rank waits."""

    def __init__(self, channel: PeerChannel, entered: Callable[[str], int] | None = None) -> None:
        self.channel = channel
        self.entered = entered or (lambda _name: 0)  # operations this rank started on a name
        self.waiting: dict[int, tuple[GossipWaiting, float]] = {}  # rank -> where it said it waits, when
        self.collective: BlockedCollective | None = None

    # -- words for the channel's errors -------------------------------------------
    def rounds_text(self, tag: str, src: int, now: float) -> str:
        """'sent ...': what ``src``'s last round of ``tag`` was, and when it came."""
        last = self.channel.last_round(tag, src)
        if last is None:
            return f"sent no {tag!r} round in this generation"
        return f"sent its last {tag!r} round, {last[0]}, {now - last[1]:.1f} s ago"

    def left_early(self, wait: PeerWait, src: int) -> str:
        """What rank ``src``, which left, sent last of the round ``wait`` misses."""
        last = self.channel.last_round(wait.tag, src)
        sent = -1 if last is None else last[0]
        return (f"it {self.rounds_text(wait.tag, src, time.monotonic())}, and this rank waits for its round "
                f"{wait.rnd}: it took {_rounds(wait.rnd - sent)} fewer than this rank. Every rank must take as "
                f"many steps ({OUT_OF_STEP_DOC})")

    def whereabouts(self, wait: PeerWait, src: int, now: float) -> str:
        """Where rank ``src``, which has not sent round ``wait.rnd``, said it waits (for a timeout)."""
        rounds = self.rounds_text(wait.tag, src, now)
        said = self.waiting.get(src)
        if said is None:
            return (f"Rank {src} {rounds} and reported no wait in bps_gossip since: it is busy outside it "
                    f"(evaluating or saving on one rank alone? see {EVALUATING_DOC}), or it took fewer steps "
                    f"than this rank ({OUT_OF_STEP_DOC}).")
        msg, at = said
        waited = msg.waited + now - at
        if msg.kind == "gossip":
            return (f"Rank {src} {rounds} and has waited {waited:.1f} s in gossip {msg.name!r} round {msg.seq} "
                    f"for ranks {msg.waits_for}.")
        passed = self.entered(msg.name) > msg.seq
        return (f"Rank {src} {rounds} and has waited {waited:.1f} s in push_pull {msg.name!r}{_purpose(msg.name)}, "
                + ("which this rank passed: it waits for another rank." if passed else
                   f"which this rank has not entered ({OUT_OF_STEP_DOC})."))

    # -- this rank's waits -----------------------------------------------------------
    def blocked(self, kind: str, name: str, seq: int, since: float, verdict: Future | None = None) -> None:
        """Training has been blocked since ``since`` in gossip round ``seq`` of ``name`` (kind
        'gossip'), or in push_pull ``name``, its ``seq``-th use ('collective'), or no longer is
        in that collective ('none'): tell the ranks it misses and those that wait for this one."""
        if kind == "collective":
            self.collective = BlockedCollective(name, seq, since, verdict)
            for dst in self._waiting_for_me():
                self._tell_collective(dst)
        elif kind == "none":
            block = self.collective
            if block is not None and (block.name, block.seq) == (name, seq):
                self.collective = None
                for dst in sorted(block.told):
                    self._tell(dst, GossipWaiting(kind="none", name=name, seq=seq, gen=self.channel.generation))
        else:
            wait = next((w for w in self.channel.waits if (w.tag, w.rnd) == (name, seq)), None)
            if wait is None:  # it completed meanwhile
                return
            wait.blocked = since
            for dst in sorted({*self.channel.missing(wait), *self._waiting_for_me()}):
                self._tell_wait(wait, dst)
            self._check_out_of_step(wait)

    def untell(self, wait: PeerWait) -> None:
        """The wait is over: the ranks told of it hear so."""
        for dst in sorted(wait.told):
            self._tell(dst, GossipWaiting(kind="none", name=wait.tag, seq=wait.rnd, gen=self.channel.generation))
        wait.told.clear()

    # -- the peers' waits --------------------------------------------------------------
    def on_waiting(self, src: int, msg: GossipWaiting) -> None:
        """Rank ``src`` says where it waits (or no longer waits): kept for timeouts' messages; a
        rank out of step fails at once (see the module docstring)."""
        if msg.kind == "none":
            said = self.waiting.get(src)
            if said is not None and (said[0].name, said[0].seq) == (msg.name, msg.seq):
                del self.waiting[src]
            return
        self.waiting[src] = (msg, time.monotonic())
        blocked = [w for w in self.channel.waits if w.blocked is not None]
        if msg.kind == "collective":
            for wait in [w for w in blocked if src in self.channel.missing(w)]:
                self._check_out_of_step(wait)
            return
        if self.channel.rank not in (msg.waits_for or ()):
            return
        if msg.behind is not None:
            self._check_verdict(src, msg)
        self._tell_collective(src)  # it waits for this rank: say where this rank waits
        for wait in blocked:
            self._tell_wait(wait, src)

    def _waiting_for_me(self) -> list[int]:
        rank = self.channel.rank
        return [src for src, (msg, _) in self.waiting.items() if msg.kind == "gossip" and rank in (msg.waits_for or ())]

    def _tell(self, dst: int, msg: GossipWaiting) -> None:
        if dst not in self.channel.lost and dst not in self.channel.left:
            self.channel.send_notice(dst, msg)

    def _tell_wait(self, wait: PeerWait, dst: int, behind: GossipWaiting | None = None) -> None:
        """Tell ``dst`` that training waits in ``wait`` (once; again with ``behind``: its collective)."""
        if dst in wait.told and behind is None:
            return
        wait.told.add(dst)
        self._tell(dst, GossipWaiting(
            kind="gossip", name=wait.tag, seq=wait.rnd, waited=min(MAX_WAITED, time.monotonic() - wait.blocked),
            gen=self.channel.generation, waits_for=self.channel.missing(wait),
            behind=None if behind is None else behind.name, behind_seq=None if behind is None else behind.seq))

    def _tell_collective(self, dst: int) -> None:
        block = self.collective
        if block is None or dst in block.told:
            return
        block.told.add(dst)
        self._tell(dst, GossipWaiting(kind="collective", name=block.name, seq=block.seq,
                                      waited=min(MAX_WAITED, time.monotonic() - block.since),
                                      gen=self.channel.generation))

    def _check_out_of_step(self, wait: PeerWait) -> None:
        """Training waits in ``wait`` for a rank that waits in a collective this rank has not
        entered (and cannot, while it waits): fail now, and tell that rank (its collective fails)."""
        for src in self.channel.missing(wait):
            said = self.waiting.get(src)
            if said is None or said[0].kind != "collective" or self.entered(said[0].name) > said[0].seq:
                continue
            msg = said[0]
            last = self.channel.last_round(wait.tag, src)
            sent = -1 if last is None else last[0]
            self._tell_wait(wait, src, behind=msg)
            self.channel.fail_wait(wait, RanksOutOfStepError(
                f"gossip {wait.tag!r} round {wait.rnd} on rank {self.channel.rank}: the ranks took different "
                f"numbers of steps. Rank {src} {self.rounds_text(wait.tag, src, time.monotonic())} and waits in "
                f"push_pull {msg.name!r}{_purpose(msg.name)}, which this rank has not entered and cannot while it "
                f"waits for rank {src}'s round {wait.rnd}: this rank took {_rounds(wait.rnd - sent)} more than "
                f"rank {src}. Every rank must call trainer.step() as often as the others before a collective "
                f"({OUT_OF_STEP_DOC})"))
            return

    def _check_verdict(self, src: int, msg: GossipWaiting) -> None:
        """Rank ``src`` waits for this rank's round ``msg.seq`` and says it has not entered the
        collective this rank waits in: fail the collective unless that round was sent."""
        block = self.collective
        if block is None or (msg.behind, msg.behind_seq) != (block.name, block.seq):
            return
        sent = self.channel.sent.get((msg.name, src), -1)
        if sent >= msg.seq:  # it is on its way
            return
        said = f"sent it round {sent} last" if sent >= 0 else f"sent it no {msg.name!r} round"
        fail(block.verdict, RanksOutOfStepError(
            f"push_pull {block.name!r}{_purpose(block.name)} on rank {self.channel.rank}: the ranks took different "
            f"numbers of steps. Rank {src} waits in gossip {msg.name!r} round {msg.seq} for this rank's message "
            f"and has not entered this collective; this rank {said} and then entered it: rank {src} took "
            f"{_rounds(msg.seq - sent)} more than this rank. Every rank must call trainer.step() as often as the "
            f"others before a collective ({OUT_OF_STEP_DOC})"))
