"""Handles are :class:`concurrent.futures.Future`: what every asynchronous call returns.

The engine thread completes them; a result or error that arrives for a future that is
already done (an operation failed, then a late reply came in) is ignored, so these two
helpers never raise ``InvalidStateError``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .errors import CommTimeoutError

Future = concurrent.futures.Future


def complete(future: Future | None, result: Any) -> None:
    """Give ``future`` its result unless it is already done."""
    if future is None or future.done():
        return
    try:
        future.set_result(result)
    except concurrent.futures.InvalidStateError:  # completed by another thread meanwhile
        pass


def fail(future: Future | None, error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless it is already done."""
    if future is None or future.done():
        return
    try:
        future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def done_future(result: Any) -> Future:
    """A future that already holds ``result`` (one-worker jobs answer at once)."""
    future: Future = Future()
    future.set_result(result)
    return future


def wait(future: Future, timeout: float | None, what: str) -> Any:
    """Block until ``future`` is done; return its result or raise its error.

    The engine enforces BPS_GOSSIP_TIMEOUT itself; ``timeout`` here is a backstop that
    turns a wait that never ends into CommTimeoutError naming ``what``.
    """
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():  # on 3.8-3.10 a future's own TimeoutError is the same class
            raise
        raise CommTimeoutError(f"{what}: no result within {timeout:.1f} s") from None
