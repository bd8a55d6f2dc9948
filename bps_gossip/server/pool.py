"""The server's summation threads (BYTEPS_SERVER_ENGINE_THREAD) for large partitions.

numpy releases the GIL while it adds, so several partitions are summed at once while the
I/O thread goes on reading (bps_gossip.sum_threads). A push that completes its round hands the
round back to the I/O thread, which polls ``fileno()`` beside its sockets; the others wake nobody.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional, Tuple

import numpy as np

from ..sum_threads import SumThreads
from .aggregation import Aggregation, RoundId

Done = Tuple[RoundId, Optional[str]]  # a completed round, and the error of a summation that failed


class SumPool:
    """Adds payloads into rounds on summation threads; :meth:`finished` hands completed rounds back."""

    def __init__(self, threads: int) -> None:
        self.threads = SumThreads(threads, "sum")
        self._done: list[Done] = []

    def fileno(self) -> int:
        """Readable when rounds completed: poll it beside the sockets."""
        return self.threads.fileno()

    def submit(self, agg: Aggregation, payload: Any) -> None:
        """Add ``payload`` (a frame, or a shared-memory region) into ``agg`` on a summation thread."""
        self.threads.submit(lambda: self._add(agg, payload), lambda future: self._settled(agg, future))

    @staticmethod
    def _add(agg: Aggregation, payload: Any) -> bool:
        """Whether this payload completed the round (then summed and written back)."""
        if agg.add(payload if isinstance(payload, np.ndarray) else payload.buffer):
            agg.write_back()
            return True
        return False

    def _settled(self, agg: Aggregation, future: Future) -> None:
        error = future.exception()
        self._done.append((agg.rid, None if error is None else f"summation failed: {error!r}"))

    def finished(self) -> list[Done]:
        """The rounds completed (or failed) since the last call."""
        self.threads.finished()
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Stop the threads (queued additions are dropped) and close the pipe."""
        self.threads.close()
