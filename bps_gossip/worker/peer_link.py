"""PeerLink: what the gossip core uses to talk to other workers (not a user API).

It lives on the training thread and never touches the engine thread's objects: it sends
commands (worker.commands) and reads only the address book, which the engine replaces
whole at a new generation and never changes in place.

Where training blocks, in a gossip round (a wait on an ``expect()`` future) or in an exact
collective (``push_pull``), for longer than ``wait_notices.notice_after`` seconds, it tells the engine,
which tells the peers concerned (:mod:`.wait_notices`): ranks out of step then fail at once instead
of at BPS_GOSSIP_TIMEOUT, and a timeout says where each missing rank waits.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ..compat import zip_exact
from ..errors import NotInitializedError, PeerLostError
from ..futures import Future, done_future, wait
from ..host_groups import host_groups
from . import commands as cmd
from .engine import Engine
from .wait_notices import notice_after

Received = Dict[int, Tuple[Dict[str, Any], List[np.ndarray]]]
VERDICT_GRACE = 0.5  # seconds a failed collective waits for a peer's word that the ranks are out of step


class RoundFuture(Future):
    """An ``expect()`` future: a wait on it that lasts ``after`` seconds calls ``on_block`` once
    (the peers hear where this rank waits) and goes on waiting."""

    def __init__(self, after: float, on_block: Callable[[float], None]) -> None:
        super().__init__()
        self._after = after
        self._on_block: Callable[[float], None] | None = on_block

    def result(self, timeout: float | None = None) -> Any:
        """As Future.result; the wait is told to the peers once it has lasted a while."""
        on_block = self._on_block
        if on_block is None or self.done():
            return super().result(timeout)
        began = time.monotonic()
        first = self._after if timeout is None else min(self._after, timeout)
        try:
            return super().result(first)
        except concurrent.futures.TimeoutError:
            if self.done():  # its own error (on 3.8-3.10 a CommTimeoutError is that class too)
                raise
        self._on_block = None
        on_block(began)
        return super().result(None if timeout is None else max(0.0, timeout - first))


class PeerLink:
    """Worker-to-worker messages for gossip, and the exact collectives through the servers."""

    def __init__(self, engine: Engine | None, rank: int, size: int, max_bytes: int,
                 push_pull_async: Callable[..., Future], timeout: float,
                 gather_rows_async: Callable[..., Future] | None = None) -> None:
        self._engine = engine
        self.rank = rank
        self.size = size
        self.max_bytes = max_bytes
        self._push_pull = push_pull_async
        self._gather_rows = gather_rows_async or (lambda row, name: done_future(np.array(row).reshape(1, -1)))
        self._timeout = timeout
        # when a blocked wait is told to the peers: a quarter of BPS_GOSSIP_TIMEOUT at most
        self._notice_after = notice_after(engine.config.timeout) if engine is not None else timeout
        self._local: frozenset[int] = frozenset()
        self._groups: list[tuple[int, ...]] = []
        self.tracer = engine.tracer if engine is not None else None  # BYTEPS_TRACE_ON: gossip rounds too
        book = engine.book if engine is not None else None
        if book is not None and engine.segments is not None:
            self._local = frozenset(i for i in range(book.size) if i != book.rank and book.same_host(i))
            self._groups = host_groups(book.workers, book.servers)

    def host_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each host when the job reduces by host (bps_gossip.host_groups), the
        leader first; every rank alone when it does not."""
        return list(self._groups) or [(rank,) for rank in range(self.size)]

    def timeout(self) -> float:
        """The backstop for waiting on a round (the engine fails it after BPS_GOSSIP_TIMEOUT)."""
        return self._timeout

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The sum (or mean) of ``array`` over all workers, through the servers (blocking; a wait
        past ``notice_after`` is told to the peers, and fails at once if one is out of step)."""
        seq = self._engine.entered(name) if self._engine is not None else 0
        return self._wait(self._push_pull(array, name, average=average, out=out), name, seq)

    def gather_rows(self, row: np.ndarray, name: str) -> np.ndarray:
        """Every worker's ``row``, by rank, each as its own rank gave it (bps_gossip.gather_rows;
        blocking, with push_pull's notices)."""
        seq = self._engine.entered(name) if self._engine is not None else 0
        return self._wait(self._gather_rows(row, name), name, seq)

    def _wait(self, handle: Future, name: str, seq: int) -> np.ndarray:
        began = time.monotonic()
        try:
            return handle.result(self._notice_after)
        except concurrent.futures.TimeoutError:
            if handle.done():
                raise
        verdict: Future = Future()
        self._engine.submit(cmd.PeerBlocked("collective", name, seq, began, verdict))
        try:
            concurrent.futures.wait([handle, verdict], self._timeout, concurrent.futures.FIRST_COMPLETED)
            error = handle.exception(0) if handle.done() else None
            if handle.done() and error is None:
                return handle.result()
            if isinstance(error, PeerLostError):  # a peer out of step says so before it exits: its word explains
                concurrent.futures.wait([verdict], VERDICT_GRACE)
            if verdict.done():
                verdict.result()  # raises RanksOutOfStepError
            return wait(handle, self._timeout, f"push_pull {name!r}")
        finally:
            try:
                self._engine.submit(cmd.PeerBlocked("none", name, seq, began))
            except NotInitializedError:  # shut down meanwhile: nobody is told anything any more
                pass

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Send ``arrays`` to worker ``dst``; do not modify them afterwards."""
        assert self._engine is not None, "no peers in a one-worker job"
        for index, array in enumerate(arrays):  # a peer's socket drops larger frames
            if array.nbytes > self.max_bytes:
                raise ValueError(f"gossip {header.get('tag')!r}: array {index} has {array.nbytes} bytes, more than "
                                 f"BPS_GOSSIP_MAX_MESSAGE_BYTES={self.max_bytes} that peers accept")
        self._engine.submit(cmd.PeerSend(dst, header, arrays))

    def is_local(self, dst: int) -> bool:
        """Whether worker ``dst`` shares this host's memory (send_scaled then copies once)."""
        return dst in self._local

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        """Send ``scale * array`` for each array to worker ``dst``, which must be local
        (:meth:`is_local`): written straight into a shared-memory segment, one pass each."""
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += -(-array.nbytes // 64) * 64
        key = f"peer.{header.get('tag')}.{dst}"
        segment = self._engine.segments.acquire(key, total)  # the pool is thread-safe
        views = []
        for array, offset in zip_exact(arrays, offsets):
            view = segment.view(array.dtype, array.size, offset)
            np.multiply(array.reshape(-1), array.dtype.type(scale), out=view)
            views.append(view)
        self._engine.submit(cmd.PeerSend(dst, header, views, (key, segment, offsets)))

    def consumed(self, received: Received) -> None:
        """The arrays of ``received`` (an expect() result) were read: let senders reuse their memory."""
        for src, (header, _) in received.items():
            if "shm" in header:
                self._engine.submit(cmd.PeerAck(src, header["shm"]))

    def expect(self, tag: str, rnd: int, sources: list[int]) -> Future:
        """A future that completes with {source: (header, arrays)} once every source sent (tag, rnd)."""
        assert self._engine is not None, "no peers in a one-worker job"
        future = RoundFuture(self._notice_after, lambda began: self._engine.submit(
            cmd.PeerBlocked("gossip", tag, rnd, began)))
        self._engine.submit(cmd.PeerExpect(tag, rnd, list(sources), future))
        return future
