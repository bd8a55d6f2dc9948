"""One exception hierarchy for every failure bps_gossip reports.

Every error a user can see derives from :class:`BpsGossipError`, so a training
loop can catch the whole family in one place; the elastic layer later decides
which of these are recoverable.
"""

from __future__ import annotations

# Why a round fails when a worker shut down before pushing to it: usually a loop that ends early on
# one rank (an off-by-one in a data split), which users should hear about, not only "left".
UNEVEN_STEPS = "if it finished its training loop, the ranks took different numbers of steps"
LEFT_BEFORE_ROUND = f"left the job before pushing to this round ({UNEVEN_STEPS})"


class BpsGossipError(RuntimeError):
    """Base class of every error raised by bps_gossip."""


class ConfigError(BpsGossipError, ValueError):
    """An environment variable or argument has a bad value (the message names it)."""


class NotInitializedError(BpsGossipError):
    """A collective was called before ``init()`` or after ``shutdown()``."""


class TensorMismatchError(BpsGossipError, ValueError):
    """Ranks pushed the same tensor name with different shape, dtype or operation."""


class CommTimeoutError(BpsGossipError, TimeoutError):
    """A blocking wait ran past BPS_GOSSIP_TIMEOUT; the message says who did not answer."""


class RanksOutOfStepError(CommTimeoutError):
    """Ranks wait for each other in different places (one in a gossip round, another in a
    collective it entered with fewer steps): a wait that could only end in a timeout, ended at
    once. The message says which rank waits where."""


class PeerLostError(BpsGossipError):
    """A worker, server or the scheduler died or left while an operation needed it."""


class ProtocolError(BpsGossipError):
    """A malformed or unexpected message (also: a key collision between two names)."""


class WorkersChangedError(PeerLostError):
    """An elastic job's membership changed under a pending operation (recoverable).

    ``restore`` says whether the job must roll back to its last commit (a worker or
    server crashed: its part of the current step is lost) or may go on from where it
    is (workers joined, or one left gracefully). The same value reaches every rank.
    """

    def __init__(self, message: str, restore: bool = True) -> None:
        super().__init__(message)
        self.restore = restore


class HostsUpdatedInterrupt(WorkersChangedError):
    """Raised at a commit when workers joined or asked to leave: reset without rollback."""

    def __init__(self, message: str) -> None:
        super().__init__(message, restore=False)


class ResumedInterrupt(BpsGossipError):
    """Raised by ``resume()`` inside ``elastic.run``: this worker is back in the job (admitted at
    the others' commit, with a new rank), so ``run`` syncs its state from rank 0 and calls the
    training function again, as for any joiner. Outside ``run``, resume() returns instead."""


class JobEndedError(BpsGossipError):
    """An elastic job finished training before this worker was admitted or got its state:
    there is nothing left for it to do (init() and elastic.run turn it into exit status 0)."""


class JobFailedError(PeerLostError):
    """An elastic job cannot go on (fewer workers than BPS_GOSSIP_MIN_WORKERS for too long)."""


# The error of each kind a server (or a host leader) sends with a failed push, and back.
_BY_KIND: dict[str, type[BpsGossipError]] = {
    "mismatch": TensorMismatchError,
    "lost": PeerLostError,
    "timeout": CommTimeoutError,
    "protocol": ProtocolError,
    "changed": WorkersChangedError,
}


def error_for(kind: str, why: str) -> BpsGossipError:
    """The exception a worker raises for a failed push of ``kind`` (protocol.ERROR_KINDS)."""
    return _BY_KIND.get(kind, BpsGossipError)(why)


def kind_of(error: BaseException) -> str:
    """The ERROR_KINDS name that carries ``error`` to another worker (the most specific one)."""
    for kind, cls in reversed(_BY_KIND.items()):
        if isinstance(error, cls):
            return kind
    return "lost"
