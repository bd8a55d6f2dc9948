"""A host leader's summation threads (BYTEPS_SERVER_ENGINE_THREAD, as a server's): large host
rounds are summed and copied out on them, since numpy releases the GIL while it adds and copies,
and each completes on the engine thread, which polls ``fileno()`` beside its sockets."""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional

from ..compat import shutdown_dropping_queued
from ..thread_names import PREFIX, name_this_thread

Then = Callable[[Optional[BaseException]], None]  # run on the engine thread with the work's error, if any


class SumThreads:
    """Runs memory work off the engine thread; :meth:`finished` runs each one's continuation."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first large round
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        self._done: queue.SimpleQueue[tuple[Future, Then]] = queue.SimpleQueue()
        self._running: set[Future] = set()

    def fileno(self) -> int:
        """Readable when work completed: poll it beside the sockets."""
        return self._done_r

    def submit(self, work: Callable[[], None], then: Then) -> None:
        """Run ``work`` on a summation thread, then ``then`` on the engine thread (finished())."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bps-hostsum",
                                            initializer=name_this_thread, initargs=(PREFIX + "hostsum",))
        future = self._pool.submit(work)
        self._running.add(future)
        future.add_done_callback(lambda done: self._report(done, then))

    def _report(self, future: Future, then: Then) -> None:
        self._done.put((future, then))
        try:
            os.write(self._done_w, b".")
        except OSError:  # closed at shutdown: nobody waits any more
            pass

    def finished(self) -> None:
        """Run the continuations of the work completed since the last call (engine thread)."""
        try:
            os.read(self._done_r, 65536)
        except BlockingIOError:
            pass
        while True:
            try:
                future, then = self._done.get_nowait()
            except queue.Empty:
                return
            self._running.discard(future)
            then(future.exception())

    def settle(self) -> None:
        """Wait for the work running now (before the memory it uses is unmapped)."""
        if self._running:
            wait(list(self._running))

    def close(self) -> None:
        """Stop the threads (queued work is dropped) and close the pipe."""
        if self._pool is not None:
            shutdown_dropping_queued(self._pool)
        os.close(self._done_r)
        os.close(self._done_w)
