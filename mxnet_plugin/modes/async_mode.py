"""DistributedTrainer's async mode: BytePS's asynchronous training (BYTEPS_ENABLE_ASYNC=1).

The servers hold the weights. Each step the local optimizer updates this worker's weights from
its own gradients; the change it made (new - old) is pushed and added to the servers' stored
weights at once, and the stored weights as they are then come back into the parameters. No
worker waits for another: a straggler only makes its own steps slower, and its changes land
late (stale), as in BytePS and MXNet's dist_async.

The first step broadcasts root's parameters as in every mode; the first update then starts the
servers' stored weights from them (:func:`bps_gossip.collectives.store_push_pull`, ``init``:
whichever rank comes first creates them, the others get them back). The servers keep them for
the job's life: a trainer created later on the same parameter names, a worker that joins an
elastic job, or one that resume()s, starts from the stored weights as they are then.

Only learned parameters (``grad_req != 'null'``) are stored; the others (BatchNorm's running
statistics) stay each worker's own, as in BytePS. Changes are added as they are: with N workers
each stored step is one worker's optimizer step (BytePS's semantics; lower the learning rate
where N workers' steps together are too much).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.collectives import store_push_pull_async
from bps_gossip.runtime import peek

from ..ops import to_device, to_host
from .base import ModeSetup, TrainerMode

NAME_PREFIX = "async_"


def _stored_name(param: mx.gluon.Parameter) -> str:
    return NAME_PREFIX + param.name


class AsyncMode(TrainerMode):
    """Local updates whose changes are added to the servers' weights, which come back (no barrier)."""

    name = "async"

    @staticmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The caller's optimizer parameters: the optimizer runs locally, momentum included."""
        return setup.optimizer_params

    def __init__(self, trainer: mx.gluon.Trainer, setup: ModeSetup) -> None:
        super().__init__(trainer, setup)
        if setup.compression is not None or setup.fp16:
            raise ValueError("DistributedTrainer: mode='async' pushes weight changes uncompressed: it takes no "
                             "compression_params (compression: mode='allreduce' or mode='gossip')")
        if setup.overlap_backward:
            raise ValueError("DistributedTrainer: overlap_backward applies to mode='allreduce'; mode='async' "
                             "pushes weight changes after the update")
        self.started: tuple[Any, int] | None = None  # the runtime (weakly) and generation the parameters follow
        self.updates = 0

    def _learned(self) -> list[tuple[int, mx.gluon.Parameter]]:
        return [(index, param) for index, param in enumerate(self.trainer._params) if param.grad_req != "null"]

    def before_step(self, batch_size: int) -> None:
        """Nothing: the optimizer rescales by 1 / batch_size, this worker's batch, as gluon does."""

    def reduce_gradients(self) -> None:
        """Nothing: gradients stay local."""

    def update(self, apply: Callable[[], None]) -> None:
        """Follow the stored weights (the first update of a job, generation or process), run the local
        update, push its change and take the stored weights back."""
        if not self._distributed():
            apply()
            return
        self._start()
        learned = self._learned()
        before = [to_host(param.list_data()[0]) for _, param in learned]
        apply()
        pending = []
        for (index, param), old in zip(learned, before):
            copies = param.list_data()
            delta = to_host(copies[0]) - old
            for copy in copies[1:]:  # several devices: every copy's change counts (as summed gradients would)
                delta += to_host(copy) - old
            pending.append((store_push_pull_async(delta, _stored_name(param), out=delta, priority=-index), delta,
                            copies))
        self._finish(pending)
        self.updates += 1

    @staticmethod
    def _distributed() -> bool:
        runtime = peek()
        return runtime is not None and runtime.engine is not None

    def _start(self) -> None:
        """Init the stored weights of every learned parameter, or take them where they exist: once per
        runtime (a resume() makes a new one) and generation (an elastic change)."""
        runtime = peek()
        if self.started is not None and self.started[0]() is runtime and self.started[1] == core.generation():
            return
        self.pull()

    def _remember_start(self) -> None:
        self.started = (weakref.ref(peek()), core.generation())

    def pull(self) -> None:
        """Make the parameters the servers' stored weights (starting them from these parameters
        where no rank has yet): every learned parameter, at once."""
        pending = []
        for index, param in self._learned():
            copies = param.list_data()
            host = to_host(copies[0])
            pending.append((store_push_pull_async(host, _stored_name(param), init=True, out=host, priority=-index),
                            host, copies))
        self._finish(pending)
        self._remember_start()

    @staticmethod
    def _finish(pending: list[tuple[Any, np.ndarray, list[mx.nd.NDArray]]]) -> None:
        for handle, host, copies in pending:
            core.synchronize(handle)
            for copy in copies:
                to_device(host, copy)

    def reset_world(self) -> None:
        """Elastic: the next update takes the stored weights again (the servers kept them)."""
        self.started = None

    def flush(self) -> None:
        """Take the servers' current weights (every worker's changes so far), e.g. before evaluating."""
        if self._distributed():
            self.pull()

    def average_parameters(self) -> None:
        """The servers' weights are the model: take them (not a collective in this mode)."""
        self.flush()

    def consensus_distance(self) -> float:
        """0.0: every rank takes the same stored weights (at different moments: async has no consensus
        point; :meth:`flush` on every rank after a barrier gives each the same)."""
        return 0.0
