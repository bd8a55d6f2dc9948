"""DistributedTrainer's ``mode='auto'``: gossip or allreduce, whichever trains faster here.

The trainer holds both modes and runs one at a time. Every BPS_GOSSIP_AUTO_WINDOW steps (half
as many in a window that measures allreduce; twice as many after each decision that changes
nothing, up to 8 times) the ranks average what they measured (seconds per step; in gossip,
whether the ranks it routes around changed and how late they are; the loss, when ``step`` is
given it) with one push_pull, and :class:`~.auto_policy.AutoPolicy` decides the same way on
every rank which mode runs the next window. In gossip around slow ranks the decision is taken
on the window before, whose push_pull travelled while this one ran (one every rank waits at
would hold the fast ranks up for the slow ones). The log says at INFO what it switched to and
why; ``DistributedTrainer.mode_history`` keeps the newest MAX_HISTORY decisions.

Switching keeps the ranks' models consistent:

- allreduce -> gossip: the models are equal; push-sum starts again from them, weight 1.
- gossip -> allreduce: the models and the optimizer's states (momentum) are made exactly
  their average over ranks, so that the same summed gradients keep every model equal.

While gossip runs, a decision may also make the models exactly their average (when they drift
apart, or the learning rate fell); each such average measures the drift it removed and how far
the average moved since the last, and tells the policy.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Callable

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.gathered import robust_mean, usable_rows

from ..ops import to_device, to_host
from ..overlap import wait_all
from .allreduce import AllreduceMode
from .auto_policy import AutoPolicy, Decision, Window
from .base import ModeSetup, TrainerMode
from .gossip import GossipMode

log = logging.getLogger("bps_gossip.worker")  # the worker's handler and BYTEPS_LOG_LEVEL
MAX_HISTORY = 1024  # decisions kept for mode_history (the newest)
WINDOW_KEY = "auto_mode_window"  # the gather_rows of each window's measurements
MAX_SECONDS = 1e6  # a window's seconds past this are no rank's measurement
# A window's measurements, by column: seconds a step, routing changed (0/1), the slowest rank's
# lateness, the last exact average's seconds, the learning rate, the mean loss, whether the loss
# is known (0/1), allreduce's estimated seconds a step; what an honest rank can send.
WINDOW_LOW = np.array([0.0, 0.0, 0.0, 0.0, 0.0, -np.inf, 0.0, 0.0])
WINDOW_HIGH = np.array([MAX_SECONDS, 1.0, MAX_SECONDS, MAX_SECONDS, np.inf, np.inf, 1.0, MAX_SECONDS])


def _gathered(future: Any) -> np.ndarray | None:
    """A window's gathered rows; None (with a warning) when a rank pushed something else under its
    name: the round failed alike on every rank, and no rank's step raises for it."""
    try:
        return core.synchronize(future)
    except core.TensorMismatchError as error:
        log.warning("mode='auto': a window's measurements could not be gathered: %s", error)
        return None


def combine_windows(rows: np.ndarray) -> np.ndarray | None:
    """Every rank's window measurements (a row each) as one row: per column the median of the
    rows that are finite and in range (a minority's lies cannot move it past the honest ranks'
    numbers; the rest are left out with a warning naming their ranks); the loss counts as known
    only if every usable rank gave one. None when no row is usable."""
    usable = usable_rows(rows, WINDOW_LOW, WINDOW_HIGH, "mode='auto''s window measurements")
    if not usable.any():
        return None
    mean = robust_mean(rows, usable)
    mean[6] = rows[usable, 6].min()
    return mean


def _state_arrays(state: Any) -> list[mx.nd.NDArray]:
    """The arrays of one optimizer state (an array, a tuple or list of them, or None)."""
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [array for part in state for array in _state_arrays(part)]
    return []


class AutoMode(TrainerMode):
    """Gossip or allreduce, chosen while training from measured step times (module docstring)."""

    name = "auto"

    @staticmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The caller's optimizer parameters (auto takes no compression: both modes use them)."""
        return setup.optimizer_params

    def __init__(self, trainer: mx.gluon.Trainer, setup: ModeSetup) -> None:
        super().__init__(trainer, setup)  # without compression (mode_class refused it)
        config = core.job_config()
        self.window, self.servers = config.auto_window, max(1, config.num_server)
        self.unscaled = trainer._scale
        self.modes: dict[str, TrainerMode] = {"gossip": GossipMode(trainer, setup),
                                              "allreduce": AllreduceMode(trainer, setup)}
        self.policy = AutoPolicy(window=self.window)
        self.history: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=MAX_HISTORY)
        self.steps = 0  # steps begun
        self.window_start: float | None = None  # the clock at the window's second step
        self.window_begin, self.window_steps = 0, self.window  # the window's first step and length
        self.windows = 1  # that length in windows (it grows while the decision stays)
        # The first window warms up (connections open, routing's first decisions are collectives
        # every rank waits at): not measured. At 1 Gbit/s its gossip step was 20-28 ms against
        # 12-19 ms after, and auto measured allreduce it then chose.
        self.warming = True
        self.active: TrainerMode = self.modes[AutoPolicy.first()]
        self.slow_at_start: set[int] = set()  # the ranks gossip routed around when the window began
        self.average_seconds = 0.0  # what this rank's last exact average on a decision took
        self.last_average: dict[str, np.ndarray] | None = None  # the model then (host copy), for how far it moved
        # A gossip window's measurements on their way (future, the array sent, its length in windows)
        self.pending: tuple[Any, np.ndarray, int] | None = None
        self.loss_array: mx.nd.NDArray | None = None  # the window's losses, summed (NDArrays given)
        self.loss_number, self.loss_steps = 0.0, 0  # the sum of numbers given; the steps that gave one
        self._use(self.active.name, "the first window", step=0, probe=AutoPolicy.short(AutoPolicy.first()))

    def running(self) -> TrainerMode:
        """The mode chosen last."""
        return self.active

    def decisions(self) -> list[tuple[int, str, str]]:
        """(step, mode, why) of the newest MAX_HISTORY decisions."""
        return list(self.history)

    @property
    def overlap_backward(self) -> bool:  # type: ignore[override]
        """Whether the running mode pushes gradients inside MXNet's engine."""
        return self.active.overlap_backward

    def _use(self, mode: str, why: str, step: int, probe: bool = False) -> None:
        self.active = self.modes[mode]
        self._begin_window(step, probe)
        self.trainer._scale = self.unscaled / core.size() if mode == "allreduce" else self.unscaled
        self.history.append((step, mode, why))
        log.info("mode='auto' at step %d: %s (%s)", step, mode, why)

    # -- the trainer's points -------------------------------------------------------------
    def before_step(self, batch_size: int) -> None:
        """Count the step; at a window's end, measure, decide together and switch."""
        now = time.perf_counter()
        if self.steps == self.window_begin + self.window_steps and self.window_start is not None:
            self._end_window(now)
        if self.steps == self.window_begin + 1 or self.window_steps == 1:
            self.window_start = now  # from the window's second step: the first pays for a switch
        self.steps += 1
        self.active.before_step(batch_size)

    def reduce_gradients(self) -> None:
        """The running mode's."""
        self.active.reduce_gradients()

    def update(self, apply: Callable[[], None]) -> None:
        """The running mode's."""
        self.active.update(apply)

    def reset_world(self) -> None:
        """Elastic (every rank, joiners too, holds rank 0's synced model and optimizer states):
        both modes follow the new size, and the windows start again from the first, gossip,
        on every rank alike; the costs measured at the old size are forgotten."""
        for mode in self.modes.values():
            mode.reset_world()
        self.policy.reset()
        self.steps, self.window_start = 0, None
        self.last_average, self.average_seconds, self.pending = None, 0.0, None  # the old job's push_pull is gone
        self.warming = True
        self._use(AutoPolicy.first(), f"the job changed to {core.size()} workers: measuring again", step=0,
                  probe=AutoPolicy.short(AutoPolicy.first()))

    def flush(self) -> None:
        """The running mode's."""
        self.active.flush()

    def average_parameters(self) -> None:
        """The exact average over ranks (collective)."""
        self.active.average_parameters()

    def consensus_distance(self) -> float:
        """RMS distance from the average over ranks (collective)."""
        return self.active.consensus_distance()

    # -- windows ----------------------------------------------------------------------------
    def observe_loss(self, loss: mx.nd.NDArray | float | None) -> None:
        """Add the step's loss to the window's (an NDArray stays in MXNet's engine until the window ends)."""
        if loss is None:
            return
        if isinstance(loss, mx.nd.NDArray):
            self.loss_array = loss if self.loss_array is None else self.loss_array + loss
        else:
            self.loss_number += loss
        self.loss_steps += 1

    def window_loss(self) -> tuple[float, float]:
        """The window's mean loss and 1, or (0, 0) when no step gave a finite one."""
        total = self.loss_number + (float(self.loss_array.asscalar()) if self.loss_array is not None else 0.0)
        mean = total / self.loss_steps if self.loss_steps else math.nan
        return (mean, 1.0) if math.isfinite(mean) else (0.0, 0.0)

    def _begin_window(self, step: int, probe: bool, windows: int = 1) -> None:
        self.loss_array, self.loss_number, self.loss_steps = None, 0.0, 0
        self.window_begin, self.windows = step, 1 if probe else windows
        self.window_steps = AutoPolicy.probe_steps(self.window) if probe else self.window * windows
        self.slow_at_start = set(self._slow_links())

    def _slow_links(self) -> dict[int, float]:
        """The ranks gossip routes around, with how late they are (seconds); none outside gossip."""
        gossip = self.modes["gossip"]
        return gossip.gossip.slow_links() if self.active is gossip else {}

    def _allreduce_estimate(self) -> float:
        """A lower bound of an allreduce step's seconds from what gossip's routing measured (0: not
        known, outside gossip): the median fast rank's compute a round plus every worker's
        gradient (the model's bytes) through one server's link, one way, at the median fast
        pair's transit of one model. Every rank has the same numbers (routing decides on sums)."""
        gossip = self.modes["gossip"]
        averager = gossip.gossip.averager if self.active is gossip else None
        routing = averager.routing if averager is not None else None
        if routing is None or not routing.links or not routing.busy:
            return 0.0
        fast = [rank for rank in routing.links if rank not in routing.slow]
        if not fast:
            return 0.0
        transit = float(np.median([routing.links[rank] for rank in fast]))
        compute = float(np.median([routing.busy.get(rank, 0.0) for rank in fast]))
        return compute + transit * core.size() / self.servers

    def _end_window(self, now: float) -> None:
        """Measure the window; decide on it now in allreduce, and in gossip while it routes around
        no rank (the ranks are in step: the push_pull waits for nobody; a decision one window late
        cost a 6-epoch run at 1 Gbit/s ten gossip steps before it switched); while gossip routes
        around slow ranks decide on the window before, whose numbers travelled while this one ran:
        a push_pull every rank waits at would hold the fast ranks up for the slow ones (on one
        slow link, auto's first epoch took 1 s longer). The slow ranks are the same on every rank
        at a window's end (routing decides together), so every rank takes the same branch."""
        assert self.window_start is not None
        if self.warming:  # the same step on every rank: nothing to agree on
            self.warming = False
            self._begin_window(self.steps, probe=False)
            return
        slow = self._slow_links()
        measured = np.array([(now - self.window_start) / max(1, self.window_steps - 1),
                             float(set(slow) != self.slow_at_start), max(slow.values(), default=0.0),
                             self.average_seconds, float(self.trainer.learning_rate), *self.window_loss(),
                             self._allreduce_estimate()], np.float64)
        if self.active.name != "gossip" or not slow:
            if self.pending is not None:  # a window decided on late: the newer numbers decide instead
                _gathered(self.pending[0])
                self.pending = None
            rows = _gathered(core.gather_rows_async(measured, name=WINDOW_KEY))  # every rank's own numbers
            self._switch(self._decide(self.active.name, rows, self.windows))
            return
        previous, self.pending = self.pending, None
        decision = None
        if previous is not None:  # taken before the next push_pull of the key starts
            future, _, windows = previous
            decision = self._decide("gossip", _gathered(future), windows)
        future = core.gather_rows_async(measured, name=WINDOW_KEY)
        if decision is not None and decision.mode != "gossip":
            _gathered(future)  # a switch waits for every rank anyway; this window's numbers are of the mode left
            self._switch(decision)
            return
        self.pending = (future, measured, self.windows)
        if decision is None:  # the first gossip window since gossip began: its decision comes at the next one's end
            self._begin_window(self.steps, probe=False, windows=self.windows)
        else:
            self._switch(decision)

    def _decide(self, mode: str, rows: np.ndarray | None, windows: int) -> Decision:
        """The policy's decision on a window's measurements, every rank's row: combined by
        :func:`combine_windows`; where no rank's are usable, or the policy refuses them, ``mode``
        goes on, on every rank (they all hold the same rows)."""
        mean = None if rows is None else combine_windows(rows)
        if mean is None:
            return Decision(mode, f"{mode} goes on: no rank's window measurements are usable")
        try:
            return self.policy.decide(self._window(mode, mean, windows))
        except ValueError as error:
            log.warning("mode='auto' at step %d: a window's measurements are not usable (%s)", self.steps, error)
            return Decision(mode, f"{mode} goes on: the window's measurements are not usable ({error})")

    @staticmethod
    def _window(mode: str, mean: np.ndarray, windows: int) -> Window:
        # Every rank gave its loss (one that did not sent 0); a mean that overflowed is no trend either
        known = mean[6] >= 1.0 - 1e-9 and math.isfinite(mean[5])
        return Window(mode, float(mean[0]), routing_changed=bool(mean[1] > 0), slow_lateness=float(mean[2]),
                      windows=windows, average_seconds=float(mean[3]), learning_rate=float(mean[4]),
                      loss=float(mean[5]) if known else None, allreduce_estimate=float(mean[7]))

    def _switch(self, decision: Decision) -> None:
        step = self.steps
        if decision.mode == self.active.name:
            self.history.append((step, decision.mode, decision.why))
            log.debug("mode='auto' at step %d: %s (%s)", step, decision.mode, decision.why)
            windows = decision.windows
            if decision.average:
                self.average_exactly(step)
                windows = self.policy.until_average(windows)
            self._begin_window(step, decision.probe, windows)
            return
        self.last_average = None  # the models are equal after a switch: the next average measures from there
        if decision.mode == "allreduce":  # from gossip: equal models and optimizer states first
            self.active.flush()
            self.active.average_parameters()
            self._average_optimizer_states()
        else:  # from allreduce: the models are equal
            wait_all()
        self.modes["gossip"].restart()  # push-sum starts again from the equal models
        self._use(decision.mode, decision.why, step, decision.probe)

    def average_exactly(self, step: int) -> None:
        """An exact average the policy asked for, in gossip: measure the drift it removed and how
        far the average moved since the last one, and tell the policy (collective)."""
        gossip = self.modes["gossip"].gossip
        start = time.perf_counter()
        drift = gossip.average_exactly(measure=True)
        model = gossip.pack()
        moved = None
        if self.last_average is not None and self.last_average.keys() == model.keys():
            squares = sum(float(np.sum(np.square(model[key] - self.last_average[key], dtype=np.float64)))
                          for key in model)
            moved = float(np.sqrt(squares / max(1, sum(value.size for value in model.values()))))
        self.last_average, self.average_seconds = model, time.perf_counter() - start
        drifted = self.policy.drifted
        try:
            why = self.policy.record_average(float(drift or 0.0), moved)
        except ValueError as error:  # the same on every rank: they measured the same numbers
            why = f"an exact average whose measure is not usable ({error})"
        self.history.append((step, "gossip", why))
        level = logging.INFO if drifted != self.policy.drifted or moved is None else logging.DEBUG
        log.log(level, "mode='auto' at step %d: gossip (%s)", step, why)

    def _average_optimizer_states(self) -> None:
        """Make every optimizer state (momentum, ...) its exact average over ranks (collective)."""
        for device, updater in enumerate(self.trainer._updaters):
            for index in sorted(updater.states):
                for part, array in enumerate(_state_arrays(updater.states[index])):
                    if np.dtype(array.dtype).kind != "f":
                        continue
                    host = to_host(array)
                    core.push_pull(host, name=f"auto_state_{device}_{index}_{part}", average=True, out=host)
                    to_device(host, array)
