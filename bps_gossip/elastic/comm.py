"""What elastic training needs from the job: the ``Comm`` that run, State and the sampler use.

The elastic core never reaches for a global runtime: ``run``, ``State``, ``ObjectState``,
``broadcast_object`` and ``ElasticSampler`` take an optional ``comm=``; without one they
use the default comm, made by a provider that the package registers when it is imported
(``bps_gossip`` registers an adapter over its worker API; this package never imports it).
Tests pass a fake. Rank and size are methods: they change at every reset.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from ..errors import JobEndedError, NotInitializedError


class Comm(Protocol):
    """The worker's view of an elastic job (one per worker)."""

    def is_initialized(self) -> bool:
        """True once this worker joined the job."""

    def init(self) -> None:
        """Join the job (a no-op when already in it)."""

    def rank(self) -> int:
        """This worker's rank in [0, size()) in the current generation."""

    def size(self) -> int:
        """The number of workers in the current generation."""

    def generation(self) -> int:
        """The current membership generation."""

    def is_elastic(self) -> bool:
        """True when the job changes membership instead of failing."""

    def broadcast(self, array: np.ndarray, name: str, root_rank: int = 0) -> np.ndarray:
        """Every rank gets root_rank's ``array`` bit for bit (blocking, collective)."""

    def commit_check(self) -> bool:
        """True when workers wait to join; the same answer on every rank (a barrier)."""

    def reset(self) -> bool:
        """Join the next generation; True when every rank must roll back to its last commit."""

    def holds_state(self) -> None:
        """This worker now holds the job's state (after a sync)."""

    def training_finished(self) -> None:
        """This worker finished training: the job admits no more workers."""

    def exit_job_over(self, exc: JobEndedError) -> None:
        """The job finished before this joiner got its state: exit with status 0 (raises SystemExit)."""


CommProvider = Callable[[], Comm]  # typing's: collections.abc.Callable[...] needs 3.9
_provider: CommProvider | None = None


def set_default_comm_provider(provider: CommProvider | None) -> None:
    """Register the function that makes the comm of elastic objects created without one."""
    global _provider
    _provider = provider


def default_comm() -> Comm:
    """The registered provider's comm; NotInitializedError when none is registered."""
    provider = _provider
    if provider is None:
        raise NotInitializedError("elastic: no comm given and no default comm provider registered "
                                  "(import bps_gossip, or pass comm=)")
    return provider()


def resolve(comm: Comm | None) -> Comm:
    """``comm``, or the default comm when it is None."""
    return default_comm() if comm is None else comm
