"""What the oldest supported Python (3.8) lacks, written once."""

from __future__ import annotations

import queue
import sys
from collections.abc import Iterator, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def zip_exact(*sequences: Sized) -> Iterator[tuple[Any, ...]]:
    """``zip(*sequences, strict=True)`` for Pythons before 3.10: ValueError when the
    sequences differ in length, checked before the first item."""
    lengths = [len(sequence) for sequence in sequences]
    if len(set(lengths)) > 1:
        raise ValueError(f"zip_exact: sequences of different lengths {lengths}")
    return zip(*sequences)  # type: ignore[call-overload]


def shutdown_dropping_queued(pool: ThreadPoolExecutor) -> None:
    """``pool.shutdown(wait=True, cancel_futures=True)``; before 3.9, whose shutdown has no
    cancel_futures, cancel the queued futures first (the running ones finish)."""
    if sys.version_info >= (3, 9):
        pool.shutdown(wait=True, cancel_futures=True)
        return
    while True:
        try:
            item = pool._work_queue.get_nowait()  # noqa: SLF001 - what 3.9's cancel_futures does
        except queue.Empty:
            break
        if item is not None:
            item.future.cancel()
    pool.shutdown(wait=True)
