"""One exception hierarchy for every failure bps_gossip reports.

Every error a user can see derives from :class:`BpsGossipError`, so a training
loop can catch the whole family in one place; the elastic layer later decides
which of these are recoverable.
"""

from __future__ import annotations


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


class PeerLostError(BpsGossipError):
    """A worker, server or the scheduler died or left while an operation needed it."""


class ProtocolError(BpsGossipError):
    """A malformed or unexpected message (also: a key collision between two names)."""
