"""push_pull inside MXNet's engine, so that communication overlaps backward.

``push_pull_in_engine(grads, name)`` returns at once. It queues the push_pull in MXNet's
dependency engine (:mod:`mxnet_plugin.engine_ops`, the C API's asynchronous operation) with the
gradient as the array it writes: MXNet starts it when backward has written that gradient, and
every later reader (the optimizer update) waits until the sum is in. So each gradient's
push_pull starts as soon as that gradient exists, and the core's priorities (first layers
first) order what is queued at the same time. No thread waits on the network.

The operation reads and writes the NDArray's memory directly (arrays a forward left in a oneDNN
layout are reordered before they are queued, see ``mxnet_plugin.layouts``): no ``asnumpy`` and
no copy back; the copies left are the transport's.

Errors: a push_pull that fails completes its operation with the error
(:mod:`mxnet_plugin.engine_errors`): the next wait on its output or anything computed from it
raises ``MXNetError`` with the error's message. It also fills its output with NaN, logs the
exception and keeps it: the next push_pull call of this module, ``bps.shutdown()`` or
:func:`raise_pending_error` raises it, naming the tensor, and if none does, the process exits
with status 1 instead of 0.

``BPS_GOSSIP_OVERLAP_BACKWARD=0`` (or ``overlap_backward=False`` where offered) turns this off:
the caller then waits for each gradient and copies it through host buffers.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import threading
from concurrent.futures import Future
from typing import Callable, Iterator

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.api import wait_timeout

from .engine_ops import Done, push_async
from .layouts import make_default, raw_view

log = logging.getLogger("bps_gossip.mxnet_plugin")


def enabled_by_default() -> bool:
    """``BPS_GOSSIP_OVERLAP_BACKWARD`` (1, the default, or 0), as the job's Config read it."""
    return core.job_config().overlap_backward


class _Rounds:
    """Per tensor name, whether the last round started here has run; the first error seen.

    A new round of a name waits for the previous one (it is done long before in
    training: the next backward needs the updated weights), so that an error of round
    N is raised by the call that starts round N+1 at the latest.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self._unclaimed: dict[str, threading.Event] = {}  # round id -> event, until its operator exists
        self._ids = itertools.count()
        self.used = False  # whether any round was ever started (drain() is free otherwise)
        self._error: BaseException | None = None

    def begin(self, name: str) -> str:
        """Wait for ``name``'s previous round (raising a kept error), then open the next;
        return its id for :meth:`claim`."""
        self.raise_error()
        with self._lock:
            previous = self._done.get(name)
        if previous is not None and not previous.wait(wait_timeout()):
            raise core.CommTimeoutError(
                f"push_pull({name!r}): the previous round never ran in MXNet's engine (did an operation "
                "computing this gradient fail?)")
        self.raise_error()
        event = threading.Event()
        with self._lock:
            if not self.used:
                atexit.register(_exit_if_failed)  # after bps_gossip's own exit hook: runs before it
            self.used = True
            self._done[name] = event
            round_id = str(next(self._ids))
            self._unclaimed[round_id] = event
        return round_id

    def claim(self, round_id: str) -> threading.Event | None:
        """The event of round ``round_id``, for the operator that runs it."""
        with self._lock:
            return self._unclaimed.pop(round_id, None)

    def abandon(self, round_id: str) -> None:
        """Mark a round that MXNet refused to queue as done."""
        event = self.claim(round_id)
        if event is not None:
            event.set()

    def fail(self, name: str, error: BaseException) -> None:
        """Keep ``error`` (the first one) for the next caller."""
        with self._lock:
            if self._error is None:
                self._error = error
        log.error("push_pull(%r) failed inside MXNet's engine: %s: %s; arrays computed from this gradient "
                  "raise MXNetError when waited for, and the next push_pull call raises this error",
                  name, type(error).__name__, error)

    def take_error(self) -> BaseException | None:
        """The kept error, forgotten here and in MXNet's engine (None if there is none)."""
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                self._done.clear()  # rounds downstream of a failure are skipped by MXNet
        if error is not None:
            drain()  # waitall clears the copy MXNet keeps: arrays written later (a restore) read again
        return error

    def raise_error(self) -> None:
        """Raise the kept error once; forget rounds that will never run after it."""
        error = self.take_error()
        if error is not None:
            raise error


# One per process on purpose: MXNet's engine, whose queued operations it tracks, is the process's,
# and a kept error must outlive bps.shutdown() (raised after it, or by the exit hook).
_rounds = _Rounds()


def begin_round(name: str) -> str:
    """Wait for ``name``'s previous round in MXNet's engine (raising a kept error), open the
    next and return its id for :func:`run_push_pull`."""
    return _rounds.begin(name)


def drain() -> None:
    """Wait until every push_pull queued in MXNet's engine has run (call before shutdown).

    A failed one is not raised here: its error is kept for :func:`raise_pending_error`.
    """
    if not _rounds.used:
        return
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


def _exit_if_failed() -> None:
    """At the interpreter's exit: let queued push_pulls finish; if one failed and its error
    never reached the script (no later push_pull, no ``bps.shutdown()``), say so and exit with
    status 1, so that a rank whose weights are not trained never exits 0 and bpslaunch fails
    the job with it. A script that is already dying of an exception keeps its own status."""
    drain()
    error = _rounds.take_error()
    if error is None or hasattr(sys, "last_value"):
        return
    log.error("exiting with status 1: this rank's parameters are not trained: a push_pull failed inside "
              "MXNet's engine (%s, logged above) and nothing raised it since (no later push_pull, no "
              "bps.shutdown())", type(error).__name__)
    with contextlib.suppress(Exception):
        core.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(1)  # an exit hook cannot change the exit status otherwise


def raise_pending_error() -> None:
    """Raise the error of a push_pull that failed inside MXNet's engine, if any (once)."""
    _rounds.raise_error()


@contextlib.contextmanager
def own_errors() -> Iterator[None]:
    """Inside the block, an ``MXNetError`` that carries a failed push_pull's error (a wait on an
    array computed from it) is raised as that error itself, with its own type (a
    TensorMismatchError, a WorkersChangedError that elastic.run resets on)."""
    try:
        yield
    except mx.base.MXNetError:
        error = _rounds.take_error()
        if error is None:
            raise
        raise error from None  # the MXNetError says the same, less precisely


def wait_to_read(array: mx.nd.NDArray) -> None:
    """``array.wait_to_read()``, raising a failed push_pull's own error (see :func:`own_errors`)."""
    with own_errors():
        array.wait_to_read()


def wait_all() -> None:
    """``mx.nd.waitall()``, raising a failed push_pull's own error (see :func:`own_errors`)."""
    with own_errors():
        mx.nd.waitall()


def poison(array: np.ndarray) -> None:
    """Fill a result that failed with NaN (floating point), so that nothing trained on it can
    pass for a model, also where MXNet's engine cannot carry the error (another build)."""
    if array.dtype.kind in "fc":
        array.fill(np.nan)


def run_push_pull(name: str, round_id: str, reads: list[mx.nd.NDArray], writes: list[mx.nd.NDArray],
                  priority: int, start: Callable[[], Future], finish: Callable[[bool], None]) -> None:
    """Queue a push_pull in MXNet's engine after the pending writes to ``reads`` and ``writes``.

    On one of the engine's threads ``start()`` begins it (returning the core's future);
    ``finish(ok)`` runs when it is done, before the readers of ``writes`` are let go. An
    error is logged at once, kept for the next call (:func:`raise_pending_error`), and
    ``finish(False)`` must poison the outputs.
    """
    event = _rounds.claim(round_id)

    def settle(future: Future | None, error: BaseException | None, done: Done) -> None:
        try:
            error = error if future is None else future.exception()
            if error is not None:
                _rounds.fail(name, error)
            finish(error is None)
        except BaseException as exc:  # noqa: BLE001 - a failure here must still release the engine
            _rounds.fail(name, exc)
            error = error or exc
        finally:
            done(error)
            if event is not None:
                event.set()

    def work(done: Done) -> None:
        try:
            future = start()
        except BaseException as exc:  # noqa: BLE001 - refused at once (layout, shape, shutdown)
            settle(None, exc, done)
            return
        future.add_done_callback(lambda f: settle(f, None, done))

    try:
        written = {id(w) for w in writes}  # a fused bucket reads and writes its ~80 gradients: no pairwise test
        push_async(work, [a for a in reads if id(a) not in written], writes, name, priority)
    except BaseException:
        _rounds.abandon(round_id)  # refused before it was queued: no round to wait for
        raise


def push_pull_in_engine(sources: list[mx.nd.NDArray], name: str, average: bool = False, priority: int = 0,
                        outs: list[mx.nd.NDArray] | None = None) -> None:
    """Sum ``sources`` (one worker's copies on several devices, summed locally first) over
    workers into every array of ``outs`` (default: into ``sources``), inside MXNet's engine.

    Returns at once; readers of ``outs`` wait for the result as for any MXNet operation.
    Every array must have its memory already (not be the fresh output of an operation that has
    not run: MXNet allocates such memory when the operation runs, and looking up its address
    from here would allocate it a second time); gradients and parameters always have it.
    """
    targets = sources if outs is None else outs
    for array in sources if outs is None else (*sources, *outs):
        make_default(array)  # free unless an inference forward left a oneDNN layout (waits then)
    round_id = _rounds.begin(name)
    if len(sources) == 1:
        total = sources[0]
    else:  # local sum on the first device (MXNet operations, asynchronous like the rest)
        total = mx.nd.add_n(*[s.as_in_context(sources[0].context) for s in sources])
    first = targets[0]
    if first.context == total.context and (outs is not None or len(sources) == 1):
        result = first  # in place when first is the source itself
    else:
        result = total  # total is a temporary here (or lives on another device)
    where = f"push_pull({name!r})"
    views: list[np.ndarray] = []

    def start() -> Future:
        source, target = raw_view(total, where), raw_view(result, where)
        views.append(target)
        return core.push_pull_async(source, name, average=average, priority=priority, out=target)

    def finish(ok: bool) -> None:
        if not ok and views:
            poison(views[0])

    run_push_pull(name, round_id, [total], [result], priority, start, finish)
    for target in targets:
        if target is not result:
            result.copyto(target)
