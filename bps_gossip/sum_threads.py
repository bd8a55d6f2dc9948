"""Summation threads (BYTEPS_SERVER_ENGINE_THREAD of them) for a loop that polls sockets: a
server's, and a host leader's engine. Large partitions are summed and copied on them, since numpy
releases the GIL while it adds and copies; what comes of each is handed back to the loop's thread,
which polls ``fileno()`` beside its sockets, and never runs on a summation thread."""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

from .compat import shutdown_dropping_queued
from .thread_names import PREFIX, name_this_thread

Then = Callable[[Future], None]  # run on the loop's thread with the work's completed future


class SumThreads:
    """Runs memory work off the loop's thread; :meth:`finished` runs each one's continuation."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self.name = name  # the threads' name after PREFIX (what top -H shows)
        self._pool: ThreadPoolExecutor | None = None  # started with the first large round
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        self._done: queue.SimpleQueue[tuple[Future, Then]] = queue.SimpleQueue()
        self._running: set[Future] = set()  # submitted and maybe not done (the loop's thread only)

    def fileno(self) -> int:
        """Readable when work completed: poll it beside the sockets."""
        return self._done_r

    def submit(self, work: Callable[[], object], then: Then) -> None:
        """Run ``work`` on a summation thread, then ``then`` on the loop's thread (finished()),
        unless ``work`` returned False: nothing to hand back, and no wake of the loop for it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"bps-{self.name}",
                                            initializer=name_this_thread, initargs=(PREFIX + self.name,))
        self._running = {running for running in self._running if not running.done()}
        future = self._pool.submit(work)
        self._running.add(future)
        future.add_done_callback(lambda done: self._report(done, then))

    def _report(self, future: Future, then: Then) -> None:
        if future.exception() is None and future.result() is False:
            return
        self._done.put((future, then))
        try:
            os.write(self._done_w, b".")
        except OSError:  # closed at shutdown: nobody waits any more
            pass

    def finished(self) -> None:
        """Run the continuations of the work completed since the last call (the loop's thread)."""
        try:
            os.read(self._done_r, 65536)
        except BlockingIOError:
            pass
        while True:
            try:
                future, then = self._done.get_nowait()
            except queue.Empty:
                return
            then(future)

    def settle(self) -> None:
        """Wait for the work running now (before the memory it uses is unmapped)."""
        if self._running:
            wait(self._running)
            self._running = set()

    def close(self) -> None:
        """Stop the threads (queued work is dropped) and close the pipe."""
        if self._pool is not None:
            shutdown_dropping_queued(self._pool)
        os.close(self._done_r)
        os.close(self._done_w)
