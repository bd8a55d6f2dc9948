"""``run(func)``: call the training function again after every membership change."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import JobEndedError, ResumedInterrupt, WorkersChangedError
from .comm import Comm, resolve
from .state import State

log = logging.getLogger("bps_gossip.elastic")
Result = TypeVar("Result")
_inside = threading.local()  # how many training functions of run() this thread is in


def in_training_function() -> bool:
    """True while this thread runs a training function of :func:`run` (resume() asks)."""
    return getattr(_inside, "depth", 0) > 0


def run(func: Callable[..., Result], *, comm: Comm | None = None) -> Callable[..., Result]:
    """Decorate ``func(state, *args, **kwargs)`` so that it survives membership changes.

    Every attempt starts by syncing ``state`` from rank 0. When a collective fails with
    WorkersChangedError (a worker died, left or joins), every rank re-rendezvouses under
    the new generation; if anything crashed the state is rolled back to its last commit
    (the scheduler gives every rank the same answer), the reset callbacks run, and
    ``func`` is called again. Other errors propagate.

    A worker that left with ``suspend()`` inside ``func`` and came back with ``resume()``
    (which raises ResumedInterrupt here) is synced from rank 0 and ``func`` is called again.

    When ``func`` returns, the scheduler is told this worker finished training: the job
    admits no more workers from then on. A worker that joined but has no state yet when the
    job finishes exits with status 0 (the job succeeded without it).

    ``comm``: the job (:class:`~.comm.Comm`); None means the default comm, looked up at
    each call. Give ``state`` the same one.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        job = resolve(comm)
        if not job.is_initialized():
            job.init()
        while True:
            try:
                try:
                    state.sync()
                    job.holds_state()
                    _inside.depth = getattr(_inside, "depth", 0) + 1
                    try:
                        result = func(state, *args, **kwargs)
                    finally:
                        _inside.depth -= 1
                    job.training_finished()
                    return result
                except WorkersChangedError as exc:
                    log.info("rank %d: %s; resetting", job.rank(), exc)
                    if job.reset():
                        state.restore()
                    log.info("generation %d: rank %d of %d", job.generation(), job.rank(), job.size())
                    state.on_reset()
                except ResumedInterrupt as exc:  # suspend() then resume(): back in, with a new rank
                    log.info("%s; syncing from rank 0", exc)
                    state.on_reset()
            except JobEndedError as exc:
                job.exit_job_over(exc)  # exits with status 0
                raise  # a comm whose exit_job_over returned: the job still ended

    return wrapper
