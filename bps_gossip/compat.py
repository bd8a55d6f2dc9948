"""What the oldest supported Python (3.8) lacks, written once."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any


def zip_exact(*sequences: Sized) -> Iterator[tuple[Any, ...]]:
    """``zip(*sequences, strict=True)`` for Pythons before 3.10: ValueError when the
    sequences differ in length, checked before the first item."""
    lengths = [len(sequence) for sequence in sequences]
    if len(set(lengths)) > 1:
        raise ValueError(f"zip_exact: sequences of different lengths {lengths}")
    return zip(*sequences)  # type: ignore[call-overload]
