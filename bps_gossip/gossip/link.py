"""What gossip needs from the job: the ``Link`` a gossiper or averager is given.

Gossip never reaches for a global runtime: an averager is handed a link (the worker's
peer channel and its servers, or a fake one in tests). Code that passes none gets the
default link, made by a provider that the package registers when it is imported
(``bps_gossip`` registers the worker's peer link; this package never imports it).

``expect`` returns a :class:`concurrent.futures.Future`; gossip uses only ``done()``
and ``result(timeout)`` on it (see :func:`bps_gossip.futures.wait`), and
``add_done_callback`` where a link wraps another (:class:`.hosts.HostsLink`).

A link may also have ``host_groups()``: the ranks of each host when the job reduces by
host, leader first (the worker's link does); gossip then goes by host where it fits
(:mod:`.by_host`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, List, Protocol, Tuple

import numpy as np

from ..errors import NotInitializedError

# {source rank: (header, arrays)}: what an expect() future completes with
Received = Dict[int, Tuple[Dict[str, Any], List[np.ndarray]]]


class Link(Protocol):
    """Worker-to-worker messages and the exact collective gossip needs (one per worker)."""

    rank: int  # this worker's rank, fixed for the link's life
    size: int  # the number of workers, fixed for the link's life

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Send ``arrays`` to worker ``dst``; the caller does not modify them afterwards."""

    def is_local(self, dst: int) -> bool:
        """True when worker ``dst`` shares this host's memory (then use :meth:`send_scaled`)."""

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        """Send ``scale * array`` for each array to the local worker ``dst``."""

    def consumed(self, received: Received) -> None:
        """The arrays of an expect() result were read: the senders may reuse their memory."""

    def expect(self, tag: str, rnd: int, sources: list[int]) -> concurrent.futures.Future:
        """A future completing with {source: (header, arrays)} once every source sent (tag, rnd)."""

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The exact sum (or mean) of ``array`` over all workers, through the servers (blocking)."""

    def gather_rows(self, row: np.ndarray, name: str) -> np.ndarray:
        """Every worker's ``row`` by rank, each as its own rank gave it, the same on every rank
        (bps_gossip.gather_rows: what the ranks decide together; blocking)."""

    def timeout(self) -> float:
        """Seconds to wait for an expect() future before giving up (a backstop)."""


LinkProvider = Callable[[], Link]  # typing's: collections.abc.Callable[...] needs 3.9
_provider: LinkProvider | None = None


def set_default_link_provider(provider: LinkProvider | None) -> None:
    """Register the function that makes the link of averagers created without one."""
    global _provider
    _provider = provider


def default_link() -> Link:
    """The registered provider's link; NotInitializedError when none is registered."""
    provider = _provider
    if provider is None:
        raise NotInitializedError("gossip: no link given and no default link provider registered "
                                  "(import bps_gossip and call bps_gossip.init(), or pass link=)")
    return provider()
