"""Handles: the futures that asynchronous calls return."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CommTimeoutError


class Handle:
    """The pending result of an asynchronous operation (``push_pull_async`` and friends)."""

    __slots__ = ("what", "_event", "_result", "_error")

    def __init__(self, what: str) -> None:
        self.what = what
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._event.is_set()

    def set_result(self, result: Any) -> None:
        """Complete the operation (called by the engine thread)."""
        if not self._event.is_set():
            self._result = result
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        """Fail the operation (called by the engine thread)."""
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def wait(self, timeout: float | None) -> Any:
        """Block until done; return the result or raise the operation's error.

        The engine enforces BPS_GOSSIP_TIMEOUT itself; ``timeout`` here is a backstop.
        """
        if not self._event.wait(timeout):
            raise CommTimeoutError(f"{self.what}: no result within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Handle {self.what} {state}>"
