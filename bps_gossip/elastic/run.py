"""``run(func)``: call the training function again after every membership change."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .. import api
from ..errors import JobEndedError, WorkersChangedError
from .state import State

log = logging.getLogger("bps_gossip.elastic")
Result = TypeVar("Result")


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate ``func(state, *args, **kwargs)`` so that it survives membership changes.

    Every attempt starts by syncing ``state`` from rank 0. When a collective fails with
    WorkersChangedError (a worker died, left or joins), every rank re-rendezvouses under
    the new generation; if anything crashed the state is rolled back to its last commit
    (the scheduler gives every rank the same answer), the reset callbacks run, and
    ``func`` is called again. Other errors propagate.

    When ``func`` returns, the scheduler is told this worker finished training: the job
    admits no more workers from then on. A worker that joined but has no state yet when the
    job finishes exits with status 0 (the job succeeded without it).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        if not api.is_initialized():
            api.init()
        while True:
            try:
                try:
                    state.sync()
                    api.holds_state()
                    result = func(state, *args, **kwargs)
                    api.training_finished()
                    return result
                except WorkersChangedError as exc:
                    log.info("rank %d: %s; resetting", api.rank(), exc)
                    if api.reset():
                        state.restore()
                    log.info("generation %d: rank %d of %d", api.generation(), api.rank(), api.size())
                    state.on_reset()
            except JobEndedError as exc:
                api.exit_job_over(exc)

    return wrapper
