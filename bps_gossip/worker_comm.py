"""The worker API seen through the interfaces of the gossip and elastic cores.

bps_gossip.gossip and bps_gossip.elastic never import the worker API (bps_gossip.api):
they are handed a :class:`~bps_gossip.gossip.link.Link` or an
:class:`~bps_gossip.elastic.comm.Comm`. This module makes the default ones over the
initialized worker, and :func:`register` (called when bps_gossip is imported) installs
them as the default providers.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np

from . import api
from .elastic.comm import set_default_comm_provider
from .errors import JobEndedError
from .gossip.link import Received, set_default_link_provider


class _HandleFuture:
    """A worker Handle seen as a Future (``done``, ``result``) while handles are not Futures yet."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def done(self) -> bool:
        """True once the operation finished."""
        return self._handle.done()

    def result(self, timeout: float | None = None) -> Any:
        """Wait; the result or the operation's error (CommTimeoutError after ``timeout``)."""
        return self._handle.wait(timeout)


class WorkerLink:
    """The worker's peer link (api.PeerLink) as a gossip Link whose expect() returns a future."""

    def __init__(self, peer: api.PeerLink) -> None:
        self._peer = peer
        self.rank = peer.rank
        self.size = peer.size

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """See Link.send."""
        self._peer.send(dst, header, arrays)

    def is_local(self, dst: int) -> bool:
        """See Link.is_local."""
        return self._peer.is_local(dst)

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        """See Link.send_scaled."""
        self._peer.send_scaled(dst, header, arrays, scale)

    def consumed(self, received: Received) -> None:
        """See Link.consumed."""
        self._peer.consumed(received)

    def expect(self, tag: str, rnd: int, sources: list[int]) -> Any:
        """See Link.expect."""
        handle = self._peer.expect(tag, rnd, sources)
        return handle if isinstance(handle, concurrent.futures.Future) else _HandleFuture(handle)

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """See Link.push_pull."""
        return self._peer.push_pull(array, name, average=average, out=out)

    def timeout(self) -> float:
        """See Link.timeout."""
        return self._peer.timeout()


def worker_link() -> WorkerLink:
    """The initialized worker's link (NotInitializedError before init())."""
    return WorkerLink(api.peer_link())


class WorkerComm:
    """The worker API as an elastic Comm (every call goes to the current runtime)."""

    def is_initialized(self) -> bool:
        """See Comm.is_initialized."""
        return api.is_initialized()

    def init(self) -> None:
        """See Comm.init."""
        api.init()

    def rank(self) -> int:
        """See Comm.rank."""
        return api.rank()

    def size(self) -> int:
        """See Comm.size."""
        return api.size()

    def generation(self) -> int:
        """See Comm.generation."""
        return api.generation()

    def is_elastic(self) -> bool:
        """See Comm.is_elastic."""
        return api.is_elastic()

    def broadcast(self, array: np.ndarray, name: str, root_rank: int = 0) -> np.ndarray:
        """See Comm.broadcast."""
        return api.broadcast(array, name, root_rank)

    def commit_check(self) -> bool:
        """See Comm.commit_check."""
        return api.commit_check()

    def reset(self) -> bool:
        """See Comm.reset."""
        return api.reset()

    def holds_state(self) -> None:
        """See Comm.holds_state."""
        api.holds_state()

    def training_finished(self) -> None:
        """See Comm.training_finished."""
        api.training_finished()

    def exit_job_over(self, exc: JobEndedError) -> None:
        """See Comm.exit_job_over."""
        api.exit_job_over(exc)


_WORKER_COMM = WorkerComm()


def register() -> None:
    """Make the worker's link and comm the defaults of bps_gossip.gossip and bps_gossip.elastic."""
    set_default_link_provider(worker_link)
    set_default_comm_provider(lambda: _WORKER_COMM)
