"""PeerLink: what the gossip core uses to talk to other workers (not a user API).

It lives on the training thread and never touches the engine thread's objects: it sends
commands (worker.commands) and reads only the address book, which the engine replaces
whole at a new generation and never changes in place.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ..compat import zip_exact
from ..futures import Future
from ..host_groups import host_groups
from . import commands as cmd
from .engine import Engine

Received = Dict[int, Tuple[Dict[str, Any], List[np.ndarray]]]


class PeerLink:
    """Worker-to-worker messages for gossip, and the exact collectives through the servers."""

    def __init__(self, engine: Engine | None, rank: int, size: int, max_bytes: int,
                 push_pull: Callable[..., np.ndarray], timeout: float) -> None:
        self._engine = engine
        self.rank = rank
        self.size = size
        self.max_bytes = max_bytes
        self._push_pull = push_pull
        self._timeout = timeout
        self._local: frozenset[int] = frozenset()
        self._groups: list[tuple[int, ...]] = []
        self.tracer = engine.tracer if engine is not None else None  # BYTEPS_TRACE_ON: gossip rounds too
        book = engine.book if engine is not None else None
        if book is not None and engine.segments is not None:
            self._local = frozenset(i for i in range(book.size) if i != book.rank and book.same_host(i))
            self._groups = host_groups([w["addr"] for w in book.workers],
                                       [w.get("host_reduce", "off") for w in book.workers], book.servers)

    def host_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each host when the job reduces by host (bps_gossip.host_groups), the
        leader first; every rank alone when it does not."""
        return list(self._groups) or [(rank,) for rank in range(self.size)]

    def timeout(self) -> float:
        """The backstop for waiting on a round (the engine fails it after BPS_GOSSIP_TIMEOUT)."""
        return self._timeout

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The sum (or mean) of ``array`` over all workers, through the servers."""
        return self._push_pull(array, name, average=average, out=out)

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
        future: Future = Future()
        self._engine.submit(cmd.PeerExpect(tag, rnd, list(sources), future))
        return future
