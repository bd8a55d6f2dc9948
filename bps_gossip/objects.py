"""Python objects across ranks: every rank's object (``allgather_object``) and the root's
(``broadcast_object``, from :mod:`bps_gossip.elastic.state`), never pickled.

Objects travel as msgpack through :mod:`bps_gossip.elastic.encoding` (plain data: None, bool,
int, float, str, bytes, lists, tuples, dicts, numpy arrays and scalars): bytes that come from
another rank through the servers are data, never code. An object that cannot be encoded
fails the call on every rank, naming the rank and the object's type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .allgather import allgather_parts
from .api import rank
from .elastic import encoding
from .elastic.state import broadcast_object

__all__ = ["allgather_object", "broadcast_object"]

ENCODED, FAILED = 0, 1  # the first byte of what each rank sends
MAX_ERROR_CHARS = 500


def _payload(obj: Any) -> np.ndarray:
    """``obj`` encoded behind the ENCODED byte, or why it cannot be behind the FAILED byte."""
    try:
        data = bytes([ENCODED]) + encoding.encode(obj)
    except TypeError as exc:
        data = bytes([FAILED]) + str(exc)[:MAX_ERROR_CHARS].encode("utf-8")
    return np.frombuffer(data, np.uint8)


def allgather_object(obj: Any, name: str = "allgather_object") -> list[Any]:
    """A list of every rank's ``obj`` in rank order, the same on every rank (Horovod's
    allgather_object, without pickle: see the module docstring).

    A rank whose object cannot be encoded makes every rank raise TypeError naming it;
    a payload that is not what an honest rank sends raises ProtocolError.
    """
    parts = allgather_parts(_payload(obj), name)
    failed = [(r, part[1:].tobytes().decode("utf-8", "replace")) for r, part in enumerate(parts)
              if part.size and part[0] == FAILED]
    if failed:
        told = "; ".join(f"rank {r}: {why}" for r, why in failed)
        raise TypeError(f"allgather_object({name!r}): an object could not be sent ({told}) [on rank {rank()}]")
    return [encoding.decode(part[1:].tobytes()) for part in parts]
