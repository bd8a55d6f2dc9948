"""Checked reads of message fields: everything that arrives on a socket is untrusted.

Every reader returns a value of the promised type inside the promised range, or raises
:class:`~bps_gossip.errors.ProtocolError` naming the field; receive loops drop such a
message with a log line (and an error reply where one is due). msgpack gives us ints,
floats, bools, strings, bytes, lists and maps of any size: ``int(float('inf'))`` raises
OverflowError, ``int(True)`` is 1 and ``int('7')`` is 7, which is why nothing here
converts: a field is accepted only as the exact type it must be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ProtocolError

MAX_INT = (1 << 63) - 1
_MISSING = object()


def _get(msg: Mapping[str, Any], key: str, default: Any) -> Any:
    value = msg.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ProtocolError(f"field {key!r} is missing")
        return default
    return value


def integer(msg: Mapping[str, Any], key: str, low: int = 0, high: int = MAX_INT, default: Any = _MISSING) -> int:
    """An int (not a bool, float or string) in [low, high]."""
    value = _get(msg, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"field {key!r} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ProtocolError(f"field {key!r}={value} is outside [{low}, {high}]")
    return value


def number(msg: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    """A finite float (an int, not a bool, is taken as one): never inf or nan."""
    value = _get(msg, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"field {key!r} must be a number, got {type(value).__name__}")
    if isinstance(value, int) and abs(value) > MAX_INT or not math.isfinite(value):
        raise ProtocolError(f"field {key!r}={value} is not a finite number")
    return float(value)


def optional_integer(msg: Mapping[str, Any], key: str, low: int = 0, high: int = MAX_INT) -> int | None:
    """None (absent or nil), or an int in [low, high]."""
    if msg.get(key) is None:
        return None
    return integer(msg, key, low, high)


def text(msg: Mapping[str, Any], key: str, max_chars: int = 256, default: Any = _MISSING) -> str:
    """A str of at most ``max_chars`` characters."""
    value = _get(msg, key, default)
    if not isinstance(value, str):
        raise ProtocolError(f"field {key!r} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ProtocolError(f"field {key!r} has {len(value)} characters, more than {max_chars}")
    return value


def integers(msg: Mapping[str, Any], key: str, max_items: int, low: int = 0, high: int = MAX_INT) -> list[int]:
    """A list of at most ``max_items`` ints, each in [low, high]."""
    value = _get(msg, key, _MISSING)
    if not isinstance(value, list) or len(value) > max_items:
        raise ProtocolError(f"field {key!r} must be a list of at most {max_items} integers")
    return [integer({key: item}, key, low, high) for item in value]


def strings(msg: Mapping[str, Any], key: str, max_items: int, max_chars: int = 256) -> list[str]:
    """A list of at most ``max_items`` strings of at most ``max_chars`` characters."""
    value = _get(msg, key, _MISSING)
    if not isinstance(value, list) or len(value) > max_items:
        raise ProtocolError(f"field {key!r} must be a list of at most {max_items} strings")
    return [text({key: item}, key, max_chars) for item in value]


def flag(msg: Mapping[str, Any], key: str, default: Any = _MISSING) -> bool:
    """A bool."""
    value = _get(msg, key, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be true or false, got {type(value).__name__}")
    return value
