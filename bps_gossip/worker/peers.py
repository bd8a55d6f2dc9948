"""The worker-to-worker channel that gossip runs on, owned by the engine thread.

Every worker binds a ROUTER (its address is in the address book) and opens a DEALER
to a peer the first time it sends to it. A message is tagged (tag, round, source):
one that arrives before anybody waits for it is kept for its round, so a fast peer's
round t+1 is never mixed into round t. A wait fails with PeerLostError as soon as any
worker is lost (the job is not elastic), or a peer it needs has left and stayed silent, and with CommTimeoutError,
naming the ranks that did not send, after BPS_GOSSIP_TIMEOUT.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import zmq

from ..errors import CommTimeoutError, PeerLostError, ProtocolError
from ..transport import send_message
from .handle import Handle

LEFT_GRACE = 2.0  # seconds a peer that left gracefully may still have messages on the way

Message = tuple[dict[str, Any], list[np.ndarray]]


@dataclasses.dataclass(eq=False)
class PeerWait:
    """A request for the messages of one (tag, round) from a set of source ranks."""

    tag: str
    rnd: int
    sources: frozenset[int]
    handle: Handle
    deadline: float


class PeerChannel:
    """Sends to and collects from other workers; every method runs on the engine thread."""

    def __init__(self, ctx: zmq.Context, uid: bytes, rank: int, workers: list[dict[str, Any]],
                 timeout: float, log: Any, generation: int = 0) -> None:
        self.ctx = ctx
        self.uid = uid
        self.rank = rank
        self.workers = workers
        self.timeout = timeout
        self.log = log
        self.generation = generation  # stamped on every message: a new generation ignores old rounds
        self.dealers: dict[int, zmq.Socket] = {}
        self.inbox: dict[tuple[str, int], dict[int, Message]] = {}
        self.waits: list[PeerWait] = []
        self.lost: dict[int, str] = {}
        self.left: dict[int, tuple[str, float]] = {}

    # -- sending ------------------------------------------------------------------
    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Send ``arrays`` (zero-copy) with ``header`` to worker ``dst``."""
        if not 0 <= dst < len(self.workers) or dst == self.rank:
            raise ValueError(f"gossip: rank {dst} is not a peer of rank {self.rank} (size {len(self.workers)})")
        sock = self.dealers.get(dst)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.uid)
            sock.setsockopt(zmq.LINGER, 2000)  # let the last round reach its peers after shutdown
            sock.connect(self.workers[dst]["addr"])
            self.dealers[dst] = sock
        header = {**header, "op": "gossip", "src": self.rank, "gen": self.generation,
                  "dtypes": [a.dtype.str for a in arrays], "counts": [int(a.size) for a in arrays]}
        send_message(sock, header, [np.ascontiguousarray(a) for a in arrays])

    # -- receiving ----------------------------------------------------------------
    def on_message(self, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        """File one incoming message under its (tag, round, source)."""
        tag, rnd, src = str(msg["tag"]), int(msg["round"]), int(msg["src"])
        dtypes, counts = msg["dtypes"], msg["counts"]
        if len(dtypes) != len(frames) or len(counts) != len(frames):
            raise ProtocolError(f"gossip message from rank {src} announces {len(dtypes)} arrays, carries {len(frames)}")
        arrays = []
        for frame, dtype, count in zip(frames, dtypes, counts, strict=True):
            dt = np.dtype(dtype)
            if dt.kind not in "fiub" or len(frame) != int(count) * dt.itemsize:
                raise ProtocolError(f"gossip message from rank {src}: {len(frame)} bytes is not {count} x {dt}")
            arrays.append(np.frombuffer(frame.buffer, dtype=dt, count=int(count)))
        box = self.inbox.setdefault((tag, rnd), {})
        if src in box:
            raise ProtocolError(f"rank {src} sent round {rnd} of {tag!r} twice")
        box[src] = (msg, arrays)
        self._complete((tag, rnd))

    def expect(self, tag: str, rnd: int, sources: list[int], handle: Handle) -> None:
        """Complete ``handle`` with {source: (header, arrays)} once every source has sent."""
        wait = PeerWait(tag, rnd, frozenset(sources), handle, time.monotonic() + self.timeout)
        if self.lost:  # a job that is not elastic cannot go on without a lost worker
            handle.set_error(self._lost_error(wait))
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
                wait.handle.set_result({src: box.pop(src) for src in wait.sources})
        if not box:
            del self.inbox[key]

    # -- failures -----------------------------------------------------------------
    def on_worker_gone(self, rank: int, how: str, why: str) -> None:
        """A worker was lost (fail its waits now) or left (give its last messages a grace period)."""
        if how == "lost":
            self.lost[rank] = why
            for wait in list(self.waits):
                self._fail(wait, self._lost_error(wait))
        else:
            self.left[rank] = (why, time.monotonic())

    def _lost_error(self, wait: PeerWait) -> PeerLostError:
        return PeerLostError(f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: "
                             + "; ".join(self.lost.values()) + "; this job is not elastic, so it cannot go on")

    def _has(self, wait: PeerWait, src: int) -> bool:
        return src in self.inbox.get((wait.tag, wait.rnd), {})

    def _fail(self, wait: PeerWait, error: BaseException) -> None:
        self.waits.remove(wait)
        wait.handle.set_error(error)

    def check_deadlines(self, now: float) -> None:
        """Fail waits whose peers are gone or silent for too long."""
        for wait in list(self.waits):
            missing = sorted(r for r in wait.sources if not self._has(wait, r))
            gone = [r for r in missing if r in self.left and now - self.left[r][1] > LEFT_GRACE]
            if gone:
                self._fail(wait, PeerLostError(
                    f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: "
                    + "; ".join(self.left[r][0] for r in gone)))
            elif now > wait.deadline:
                self._fail(wait, CommTimeoutError(
                    f"gossip {wait.tag!r} round {wait.rnd} on rank {self.rank}: ranks {missing} sent nothing "
                    f"within {self.timeout:.1f} s (BPS_GOSSIP_TIMEOUT)"))

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending wait (shutdown, scheduler lost)."""
        for wait in list(self.waits):
            self._fail(wait, error)

    def close(self) -> None:
        """Close the DEALERs (each lingers briefly so its last messages go out)."""
        for sock in self.dealers.values():
            sock.close()
        self.dealers.clear()
