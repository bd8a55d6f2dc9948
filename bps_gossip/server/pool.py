"""The server's summation threads (BYTEPS_SERVER_ENGINE_THREAD) for large partitions.

numpy releases the GIL while it adds, so several partitions are summed at once while the
I/O thread goes on reading. A round completed on the pool comes back to the I/O thread
through a queue, and a pipe that the I/O thread polls beside its sockets wakes it.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Tuple

import numpy as np

from ..aggregation import Round, RoundId
from ..compat import shutdown_dropping_queued
from ..thread_names import PREFIX, name_this_thread

Done = Tuple[RoundId, Optional[str]]  # a completed round, and the error of a summation that failed


class SumPool:
    """Adds payloads into rounds on worker threads; :meth:`finished` hands completed rounds back."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bps-sum", initializer=name_this_thread,
                                       initargs=(PREFIX + "sum",))
        self.done_r, self.done_w = os.pipe()
        os.set_blocking(self.done_r, False)
        self.done: queue.SimpleQueue[Done] = queue.SimpleQueue()

    def fileno(self) -> int:
        """Readable when rounds completed: poll it beside the sockets."""
        return self.done_r

    def submit(self, rnd: Round, payload: Any) -> None:
        """Add ``payload`` (a frame, or a shared-memory region) into ``rnd`` on a pool thread."""
        self.pool.submit(self._add, rnd, payload)

    def _add(self, rnd: Round, payload: Any) -> None:
        try:
            if rnd.add(payload if isinstance(payload, np.ndarray) else payload.buffer):
                rnd.write_back()
                self.done.put((rnd.rid, None))
                os.write(self.done_w, b".")
        except Exception as exc:  # reported on the I/O thread instead of dying silently
            self.done.put((rnd.rid, f"summation failed: {exc!r}"))
            os.write(self.done_w, b".")

    def finished(self) -> list[Done]:
        """The rounds completed (or failed) since the last call."""
        try:
            os.read(self.done_r, 65536)
        except BlockingIOError:
            pass
        done = []
        while True:
            try:
                done.append(self.done.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        """Stop the threads (queued additions are dropped) and close the pipe."""
        shutdown_dropping_queued(self.pool)
        os.close(self.done_r)
        os.close(self.done_w)
