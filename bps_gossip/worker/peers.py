"""The worker-to-worker channel that gossip runs on, owned by the engine thread.

Every worker binds a ROUTER (its address is in the address book) and opens a DEALER
to a peer the first time it sends to it. A message is tagged (tag, round, source),
and its source is the connection it came on (the routing id the address book gives each
worker), never a field of the message. One that arrives before anybody waits for it is kept for its round, so a fast peer's
round t+1 is never mixed into round t. A wait fails with PeerLostError as soon as any
worker is lost (the job is not elastic), or a peer it needs has left and stayed silent, and with CommTimeoutError,
naming the ranks that did not send, after BPS_GOSSIP_TIMEOUT, and where each of them waits.

Where ranks wait (uneven steps, one rank evaluating alone) is told between peers
(:mod:`.wait_notices`): ranks out of step fail at once with RanksOutOfStepError, and a
timeout names where each missing rank waits, or that it reported no wait.

Peers on the same host exchange payloads through shared memory: the sender writes its
share into a segment of its own pool (the one copy of the send) and sends only the
header; the receiver maps the segment and reads it in place (the one read of the
mix), then acknowledges it (``gossip_ack``) so the sender can reuse the segment.
A segment that is never acknowledged (a peer that died, a generation that ended) is
unlinked when the channel closes, never reused.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import zmq

from ..compat import zip_exact
from ..config import Config
from ..errors import CommTimeoutError, PeerLostError, ProtocolError
from ..futures import Future, complete, fail
from ..host_groups import same_host
from ..protocol import BookEntry, Gossip, GossipAck, GossipWaiting
from ..transport.data_path import Route
from ..transport.shm import AttachedSegments, OwnedSegment, SegmentPool
from ..transport.sockets import SocketRole, open_socket
from .wait_notices import WaitNotices

LEFT_GRACE = 2.0  # seconds a peer that left gracefully may still have messages on the way
MAX_ATTACHED = 256  # peers' segments mapped at once; the oldest are unmapped past this
MAX_PENDING = 1024  # messages of one peer that nobody waits for yet (a fast peer is a few rounds ahead)
MAX_PENDING_BYTES = 1 << 30  # and their bytes (payloads that came over TCP)
MAX_AHEAD = 256  # rounds of one tag a peer may be ahead of the last one read from it (routing: thinned edges)
MAX_CLOCK_OFFSET = 86400.0  # seconds: a send stamp further from our clock is dropped
Message = Tuple[Dict[str, Any], List[np.ndarray]]
Filed = Tuple[Dict[str, Any], List[np.ndarray], int]  # a message and the bytes it holds


@dataclasses.dataclass(eq=False)
class PeerWait:
    """A request for the messages of one (tag, round) from a set of source ranks."""

    tag: str
    rnd: int
    sources: frozenset[int]
    future: Future
    deadline: float
    stall_reported: bool = False
    blocked: float | None = None  # when training began to wait on it, once it told the peers
    told: set[int] = dataclasses.field(default_factory=set)  # the ranks told that it waits


class PeerChannel:
    """Sends to and collects from other workers; every method runs on the engine thread."""

    def __init__(self, ctx: zmq.Context, uid: bytes, rank: int, workers: list[BookEntry],
                 config: Config, log: Any, generation: int = 0,
                 connections: dict[str, zmq.Socket] | None = None,
                 entered: Callable[[str], int] | None = None, pool: SegmentPool | None = None) -> None:
        self.ctx = ctx
        self.uid = uid
        self.config = config
        timeout = config.timeout
        self.rank = rank
        self.workers = workers
        self.ranks = {bytes.fromhex(w.uid): index for index, w in enumerate(workers)}
        self.pending: dict[int, list[int]] = {}  # source -> [messages, bytes] nobody waits for yet
        self.timeout = timeout
        self.log = log
        self.generation = generation  # stamped on every message: a new generation ignores old rounds
        self.routes: dict[int, Route] = {}  # by peer rank: its DEALER, and whether it reads our segments
        # The previous generation's DEALERs by peer address, used again for the same peers: a new
        # connection would present this worker's routing id while the peer may still hold the old
        # one, and a ROUTER drops a connection whose id is in use (no handover), with what it carried.
        self.spare: dict[str, zmq.Socket] = dict(connections or {})
        self.inbox: dict[tuple[str, int], dict[int, Filed]] = {}
        self.waits: list[PeerWait] = []
        self.lost: dict[int, str] = {}
        self.left: dict[int, tuple[str, float]] = {}
        self.pool = pool  # this worker's segments; None where shared memory does not work
        self.in_flight: dict[str, tuple[int, str, OwnedSegment]] = {}  # segment name -> (dst, pool key, segment)
        self.attached = AttachedSegments(MAX_ATTACHED)
        self.read: dict[tuple[str, int], int] = {}  # (tag, source) -> the last round read from it
        self.read_at: dict[tuple[str, int], float] = {}  # (tag, source) -> when that round arrived
        self.sent: dict[tuple[str, int], int] = {}  # (tag, destination) -> the last round sent to it
        self.notices = WaitNotices(self, entered)  # where this rank and its peers wait

    def is_local(self, dst: int) -> bool:
        """Whether worker ``dst`` runs on this host, so payloads can go through shared memory."""
        if self.pool is None or not 0 <= dst < len(self.workers):
            return False
        return same_host(self.workers[dst], self.workers[self.rank])

    # -- sending ------------------------------------------------------------------
    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray],
             staged: tuple[str, OwnedSegment, list[int]] | None = None) -> None:
        """Send ``arrays`` (zero-copy) with ``header`` to worker ``dst``; or, with ``staged``
        (pool key, segment, byte offsets), only the header of arrays already in the segment."""
        if not 0 <= dst < len(self.workers) or dst == self.rank:
            raise ValueError(f"gossip: rank {dst} is not a peer of rank {self.rank} (size {len(self.workers)})")
        route = self._route(dst)
        in_segment = None
        if staged is not None:
            key, segment, offsets = staged
            if not route.shared:
                raise ValueError(f"gossip: rank {dst} cannot read this host's shared memory; the arrays were staged")
            in_segment = {"shm": segment.name, "offsets": offsets}
            self.in_flight[segment.name] = (dst, key, segment)
        msg = Gossip(tag=header["tag"], round=header["round"], dtypes=[a.dtype.str for a in arrays],
                     counts=[int(a.size) for a in arrays], gen=self.generation, keys=header.get("keys"),
                     weight=header.get("weight"), sent=time.time())
        frames = [] if route.by_name(in_segment) else [np.ascontiguousarray(a) for a in arrays]
        route.send(msg.encode(), frames, in_segment)
        self.sent[(msg.tag, dst)] = msg.round

    def ack(self, dst: int, segment: str) -> None:
        """Tell worker ``dst`` that its segment ``segment`` was read and may be reused."""
        if 0 <= dst < len(self.workers) and dst != self.rank:
            self._route(dst).send(GossipAck(shm=segment, gen=self.generation).encode(), ())

    def unread(self) -> int:
        """How many of our shared-memory messages peers that are still here have not read."""
        return sum(1 for dst, _, _ in self.in_flight.values() if dst not in self.lost and dst not in self.left)

    def sender(self, route: bytes) -> int:
        """The rank of the worker whose connection ``route`` is; ProtocolError for any other."""
        src = self.ranks.get(route)
        if src is None or src == self.rank:
            raise ProtocolError(f"a message from {route[:64]!r}, which is no peer of generation {self.generation}")
        return src

    def on_ack(self, route: bytes, msg: GossipAck) -> None:
        """A peer read one of our segments: it goes back to the pool."""
        src = self.sender(route)
        entry = self.in_flight.get(msg.shm)
        if entry is None or entry[0] != src:
            raise ProtocolError(f"gossip_ack for a segment rank {src} was not sent: {msg.shm!r}")
        del self.in_flight[msg.shm]
        self.pool.release(entry[1], entry[2])

    def send_notice(self, dst: int, msg: GossipWaiting) -> None:
        """Tell worker ``dst`` where this rank waits (:mod:`.wait_notices`)."""
        self._route(dst).send(msg.encode(), ())

    def _route(self, dst: int) -> Route:
        """The route to worker ``dst``, chosen at its first message: the DEALER (the previous
        generation's to the same address, or a new one) and whether it maps our segments."""
        route = self.routes.get(dst)
        if route is None:
            addr = self.workers[dst].addr
            sock = self.spare.pop(addr, None)
            if sock is None:
                sock = open_socket(self.ctx, SocketRole.TO_PEER, self.config, self.uid)
                sock.connect(addr)
            route = self.routes[dst] = Route(sock, shared=self.is_local(dst))
        return route

    # -- receiving ----------------------------------------------------------------
    def on_message(self, route: bytes, msg: Gossip, frames: list[zmq.Frame]) -> None:
        """File one incoming message from connection ``route`` under its (tag, round, source);
        the gossip core gets its header as a dict (tag, round, keys, weight, shm)."""
        src = self.sender(route)
        tag, rnd = msg.tag, msg.round
        last = self.read.get((tag, src))
        if last is not None and rnd > last + MAX_AHEAD:  # a runaway (a new averager may reuse a tag from 0)
            raise ProtocolError(f"rank {src} sent round {rnd} of {tag!r} while round {last} is the last read "
                                f"(at most {MAX_AHEAD} rounds ahead): dropped")
        if msg.shm is not None:
            arrays = self._shared_arrays(src, msg)
        else:
            arrays = self._frame_arrays(src, frames, msg.dtypes, msg.counts)
        box = self.inbox.get((tag, rnd), {})
        if src in box:
            raise ProtocolError(f"rank {src} sent round {rnd} of {tag!r} twice")
        count, nbytes = self.pending.setdefault(src, [0, 0])
        size = sum(len(frame) for frame in frames)
        if count >= MAX_PENDING or nbytes + size > MAX_PENDING_BYTES:
            raise ProtocolError(f"rank {src} has {count} gossip messages ({nbytes} bytes) nobody waits for: "
                                f"round {rnd} of {tag!r} dropped")
        self.pending[src] = [count + 1, nbytes + size]
        header = msg.encode()
        header["arrived"] = time.monotonic()  # how late each peer's messages come (gossip's routing)
        # Its transit plus our clocks' offset (gossip's routing sums both ways of a pair: the offset
        # cancels); a stamp a day off is no clock's: dropped, so that sums of them stay finite.
        transit = None if msg.sent is None else time.time() - msg.sent
        header["transit"] = transit if transit is not None and abs(transit) <= MAX_CLOCK_OFFSET else None
        self.inbox.setdefault((tag, rnd), box)[src] = (header, arrays, size)
        self._complete((tag, rnd))

    @staticmethod
    def _frame_arrays(src: int, frames: list[zmq.Frame], dtypes: list[Any], counts: list[Any]) -> list[np.ndarray]:
        if len(dtypes) != len(frames) or len(counts) != len(frames):
            raise ProtocolError(f"gossip message from rank {src} announces {len(dtypes)} arrays, carries {len(frames)}")
        arrays = []
        for frame, dtype, count in zip_exact(frames, dtypes, counts):
            dt = np.dtype(dtype)
            if dt.kind not in "fiub" or len(frame) != int(count) * dt.itemsize:
                raise ProtocolError(f"gossip message from rank {src}: {len(frame)} bytes is not {count} x {dt}")
            arrays.append(np.frombuffer(frame.buffer, dtype=dt, count=int(count)))
        return arrays

    def _shared_arrays(self, src: int, msg: Gossip) -> list[np.ndarray]:
        """Views of the arrays a peer on this host left in its segment (the message's decoding
        checked that there is one offset per array)."""
        if self.pool is None or not self.is_local(src):
            raise ProtocolError(f"gossip message from rank {src} names a shared-memory segment it cannot share")
        dtypes, counts, offsets, name = msg.dtypes, msg.counts, msg.offsets, msg.shm
        pid = self.workers[src].pid
        try:
            arrays = []
            for dtype, count, offset in zip_exact(dtypes, counts, offsets):
                dt = np.dtype(dtype)
                if dt.kind not in "fiub":
                    raise ValueError(f"dtype {dt} is not gossiped")
                arrays.append(self.attached.owned_view(f"gossip message from rank {src}", pid, name, dt, int(count),
                                                       int(offset)))
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"gossip message from rank {src}: segment {name!r}: {exc}") from None
        return arrays

    def expect(self, tag: str, rnd: int, sources: list[int], future: Future) -> None:
        """Complete ``future`` with {source: (header, arrays)} once every source has sent."""
        wait = PeerWait(tag, rnd, frozenset(sources), future, time.monotonic() + self.timeout)
        if self.lost:  # a job that is not elastic cannot go on without a lost worker
            fail(future, self._lost_error(wait))
            return
        self.waits.append(wait)
        self._complete((tag, rnd))

    def _complete(self, key: tuple[str, int]) -> None:
        box = self.inbox.get(key)
        if box is None:
            return
        for wait in list(self.waits):
            if (wait.tag, wait.rnd) == key and wait.sources <= box.keys():
                self.waits.remove(wait)
                self.notices.untell(wait)
                complete(wait.future, {src: self._claim(box, src) for src in wait.sources})
        if not box:
            del self.inbox[key]

    def _claim(self, box: dict[int, Filed], src: int) -> Message:
        msg, arrays, size = box.pop(src)
        key = (msg["tag"], src)
        self.read[key] = msg["round"]
        self.read_at[key] = msg["arrived"]
        self.pending[src][0] -= 1
        self.pending[src][1] -= size
        return msg, arrays

    # -- failures -----------------------------------------------------------------
    def on_worker_gone(self, rank: int, how: str, why: str) -> None:
        """A worker was lost (fail its waits now) or left (give its last messages a grace period)."""
        if how == "lost":
            self.lost[rank] = why
            for wait in list(self.waits):
                self.fail_wait(wait, self._lost_error(wait))
        else:
            self.left[rank] = (why, time.monotonic())

    def _lost_error(self, wait: PeerWait) -> PeerLostError:
        return PeerLostError(f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: "
                             + "; ".join(self.lost.values()) + "; this job is not elastic, so it cannot go on")

    def _has(self, wait: PeerWait, src: int) -> bool:
        return src in self.inbox.get((wait.tag, wait.rnd), {})

    def fail_wait(self, wait: PeerWait, error: BaseException) -> None:
        """Fail ``wait`` with ``error`` (the ranks told of it hear that it is over)."""
        self.waits.remove(wait)
        self.notices.untell(wait)
        fail(wait.future, error)

    def check_deadlines(self, now: float) -> None:
        """Fail waits whose peers are gone or silent for too long."""
        for wait in list(self.waits):
            missing = self.missing(wait)
            gone = [r for r in missing if r in self.left and now - self.left[r][1] > LEFT_GRACE]
            if gone:
                self.fail_wait(wait, PeerLostError(
                    f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: "
                    + "; ".join(f"{self.left[r][0]}; {self.notices.left_early(wait, r)}" for r in gone)))
            elif now > wait.deadline:
                self.fail_wait(wait, CommTimeoutError(
                    f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: ranks {missing} sent nothing "
                    f"within {self.timeout:.1f} s (BPS_GOSSIP_TIMEOUT). "
                    + " ".join(self.notices.whereabouts(wait, r, now) for r in missing)))

    def missing(self, wait: PeerWait) -> list[int]:
        """The ranks whose message of ``wait``'s round is not in yet."""
        return sorted(r for r in wait.sources if not self._has(wait, r))

    def last_round(self, tag: str, src: int) -> tuple[int, float] | None:
        """The last round of ``tag`` that came from ``src`` and when it arrived (read or not)."""
        last = self.read.get((tag, src))
        found = None if last is None else (last, self.read_at[(tag, src)])
        for (box_tag, rnd), box in self.inbox.items():
            if box_tag == tag and src in box and (found is None or rnd > found[0]):
                found = (rnd, box[src][0]["arrived"])
        return found

    def overdue(self, now: float, after: float) -> list[tuple[list[int], str]]:
        """Waits this rank has spent ``after`` seconds in: (the ranks it still waits for, what for),
        each wait once (elastic: reported to the scheduler as stuck)."""
        found = []
        for wait in self.waits:
            waited = now - (wait.deadline - self.timeout)
            if not wait.stall_reported and waited > after:
                wait.stall_reported = True
                missing = sorted(r for r in wait.sources if not self._has(wait, r))
                if missing:
                    found.append((missing, f"sent no gossip {wait.tag!r} round {wait.rnd} for {waited:.1f} s "
                                           f"while rank {self.rank} waited"))
        return found

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending wait (shutdown, scheduler lost)."""
        for wait in list(self.waits):
            self.fail_wait(wait, error)

    def connections(self) -> dict[str, zmq.Socket]:
        """Hand over the DEALERs by peer address (for the next generation's channel): close()
        leaves them open."""
        handed = {**self.spare, **{self.workers[dst].addr: route.sock for dst, route in self.routes.items()}}
        self.routes, self.spare = {}, {}
        return handed

    def close(self) -> None:
        """Close the DEALERs (each lingers briefly so its last messages go out); unmap peers'
        segments; unlink ours that were never acknowledged (they are never reused)."""
        for sock in [*(route.sock for route in self.routes.values()), *self.spare.values()]:
            sock.close()
        self.routes.clear()
        self.spare.clear()
        self.attached.close()
        for _, key, segment in self.in_flight.values():
            self.pool.release(key, segment, reusable=False)
        self.in_flight.clear()
