"""When ``mode='auto'`` gossips and when it averages gradients: the decision, from measurements.

Training runs in windows of BPS_GOSSIP_AUTO_WINDOW steps. At the end of each, every rank
measures its seconds per step in the window, the ranks average that number with one
push_pull, and :class:`AutoPolicy` decides on the averages: the same bytes on every rank, so
every rank takes the same decision and switches at the same step.

In short: each mode is measured first (allreduce in a half window, or not at all where gossip's
step is well under an estimate of allreduce's, or where a slow rank would make it wait); then
the faster one per step runs, gossip counting as faster only below GOSSIP_MARGIN of allreduce's
time (PLATEAU_MARGIN on a loss plateau where the ranks drifted apart). Windows double while the
decision stays; gossip's models are made exactly their average when they drift apart by more
than DRIFT_STEPS steps of progress; the mode not running is measured again now and then.
The whole rule, each constant and the measurements behind it: docs/gossip-internals.md.
"""

from __future__ import annotations

import dataclasses
import math

MODES = ("gossip", "allreduce")  # in the order they are first measured
GOSSIP_MARGIN = 0.6  # gossip runs when its step takes less than this fraction of allreduce's
REPROBE_WINDOWS = 20  # windows in the chosen mode before the other one is measured again
PROBE_SHARE = 0.05  # of the time in the chosen mode, at most, spent measuring the other again
PROBE_FRACTION = 0.5  # a probe's window is this fraction of a window (3 steps at least): it may be the slow mode
# Of a slow rank's lateness measured by gossip (the cascade of rounds waiting on it inflates it:
# 0.77 s late on the emulated 20 Mbit/s link, where an allreduce step took 0.46 s), the share an
# allreduce step is taken to wait for it every step until allreduce is measured.
ALLREDUCE_WAIT = 0.5
MAX_WINDOWS = 8  # a window grows (x2 a decision that changes nothing) to this many windows' steps
AVERAGE_SHARE = 0.05  # of gossip's time, at most, spent on exact averages while the models drift
UNKNOWN_PRICE = 2 ** 62  # the interval between exact averages while their price is not known (never due)
MAX_AVERAGE_WINDOWS = 64  # the longest interval between exact averages, in windows
# The ranks have drifted apart when they are farther from their average than this many steps of its
# net progress (as if each trained on gradients that many steps stale). Measured on emulated hosts
# (the digits MLP, 4 workers) they were 1-4 steps apart, and exact averages changed no epoch's accuracy.
DRIFT_STEPS = 10
LR_DROP = 0.5  # a learning rate below this fraction of the last exact average's brings one at once
PLATEAU_THRESHOLD = 0.01  # a window's loss this fraction below the best so far is progress
PLATEAU_WINDOWS = 5  # windows' steps without progress: the plateau
PLATEAU_MARGIN = 0.5  # on the plateau, gossip runs when its step takes less than this fraction of allreduce's


@dataclasses.dataclass(frozen=True)
class Window:
    """One window's measurements, averaged over the ranks."""

    mode: str  # the mode that ran it
    seconds_per_step: float
    routing_changed: bool = False  # gossip: the set of ranks it routes around changed in the window
    slow_lateness: float = 0.0  # gossip: seconds, the latest of the ranks it routes around (0: none)
    windows: int = 1  # its length, in windows (a long one: Decision.windows); a probe's counts as 1
    average_seconds: float = 0.0  # what the last exact average took (0: none yet)
    learning_rate: float = 0.0  # the optimizer's at the window's end (0: not known)
    loss: float | None = None  # the mean over the window's steps and the ranks (None: not given by every rank)
    # gossip: seconds an allreduce step takes at least, from the links gossip measured (0: not known)
    allreduce_estimate: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What runs in the next window, and why (for the log)."""

    mode: str
    why: str
    probe: bool = False  # a short window (PROBE_FRACTION) that measures allreduce
    windows: int = 1  # the next window's length in windows (unless a probe)
    average: bool = False  # gossip goes on from an exact average over ranks made now (then record_average)


class AutoPolicy:
    """The decision rule of the module docstring; one per trainer, fed every window in order."""

    def __init__(self, margin: float = GOSSIP_MARGIN, reprobe_windows: int = REPROBE_WINDOWS, window: int = 10,
                 probe_share: float = PROBE_SHARE) -> None:
        if not 0 < margin <= 1:
            raise ValueError(f"margin={margin!r} must be in (0, 1]")
        if reprobe_windows < 1:
            raise ValueError(f"reprobe_windows={reprobe_windows!r} must be >= 1")
        if window < 1 or not 0 < probe_share <= 1:
            raise ValueError(f"window={window!r} must be >= 1 and probe_share={probe_share!r} in (0, 1]")
        self.margin = margin
        self.reprobe_windows = reprobe_windows
        self.window, self.probe_share = window, probe_share
        self.cost: dict[str, float] = {}  # seconds per step, the last window of each mode
        self.since_probe = 0  # windows of the chosen mode since the other one ran (a long one counts as many)
        self.time_in_best = 0.0  # seconds in them
        self.estimated = False  # allreduce's cost is an estimate (from gossip's slow ranks), not measured
        self.remeasured = False  # the last window re-measured gossip after its routing changed
        self.average_cost = 0.0  # seconds, the last exact average's (0: none yet)
        self.average_every = window  # gossip steps between exact averages (0: as often as AVERAGE_SHARE allows)
        self.since_average = 0  # gossip steps since the models were last equal
        self.average_lr = 0.0  # the learning rate at the last exact average (0: not known)
        self.best_loss: float | None = None  # the lowest window loss that was progress
        self.since_best = 0  # steps since then

    @staticmethod
    def first() -> str:
        """The mode of the first window."""
        return MODES[0]

    @staticmethod
    def short(mode: str) -> bool:
        """Whether a window that measures ``mode`` is a short one: allreduce's is (it may be the slow
        mode); gossip's is not (its first rounds find the slow ranks it then routes around)."""
        return mode == "allreduce"

    @staticmethod
    def probe_steps(window: int) -> int:
        """The steps of a probe's window when windows are ``window`` steps."""
        return max(3, int(window * PROBE_FRACTION)) if window >= 3 else window

    def reset(self) -> None:
        """Forget the costs (the job's size changed: every cost with it)."""
        self.cost.clear()
        self.since_probe, self.time_in_best = 0, 0.0
        self.estimated = self.remeasured = False
        self.average_every, self.since_average, self.average_lr, self.average_cost = self.window, 0, 0.0, 0.0
        self.best_loss, self.since_best = None, 0

    def decide(self, window: Window) -> Decision:
        """The mode of the next window, given the one that just ended."""
        decision = self.choose_mode(window)
        if decision.mode != window.mode:
            self.since_average = 0  # a switch makes the models equal
            self.average_lr = window.learning_rate or self.average_lr
            return decision
        if window.mode != "gossip":
            return decision
        self.since_average += self.window * window.windows
        lr, last = window.learning_rate, self.average_lr
        if not last:
            self.average_lr = lr
        if last and lr < LR_DROP * last:
            why = f"the learning rate fell from {last:.3g} to {lr:.3g}"
        elif self.since_average >= self.average_interval():
            why = f"{self.since_average} gossip steps since the models were equal"
        else:
            return dataclasses.replace(decision, windows=self.until_average(decision.windows))
        self.average_lr = lr or last
        return dataclasses.replace(decision, average=True, why=f"{decision.why}; exact average: {why}")

    def until_average(self, windows: int) -> int:
        """``windows``, or fewer: the next gossip window ends when the next exact average is due."""
        due = self.average_interval() - self.since_average
        return max(1, min(windows, math.ceil(due / self.window)))

    def average_interval(self) -> int:
        """Gossip steps between exact averages now: ``average_every``, and at least enough that an
        exact average's price is AVERAGE_SHARE of theirs. The price is the last one's; before the
        first, an allreduce step's (a model's worth each way through the servers, as an exact
        average), and none is due while that is not known either."""
        step = self.cost.get("gossip", 0.0)
        price = self.average_cost or self.cost.get("allreduce", 0.0)
        if step <= 0 or price <= 0:
            return UNKNOWN_PRICE
        return max(self.average_every, math.ceil(price / (AVERAGE_SHARE * step)), 1)

    def record_average(self, drift: float, moved: float | None) -> str:
        """Note the exact average just made on a decision: the ranks were ``drift`` from it (RMS), and
        it moved ``moved`` (RMS; None: not known) since the last one, which was ``since_average``
        gossip steps ago. Returns what the log says."""
        for name, value in (("drift", drift), ("moved", 0.0 if moved is None else moved)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be finite and >= 0")
        steps, self.since_average = max(1, self.since_average), 0
        longest = self.window * MAX_AVERAGE_WINDOWS
        if moved is not None and drift > DRIFT_STEPS * moved / steps:
            self.average_every = 0
            why = f"more than {DRIFT_STEPS} steps' progress: the next as soon as its price allows"
        else:
            self.average_every = min(2 * max(steps, self.window), longest)
            why = f"the next after {self.average_every} steps at least (twice as many)"
        where = f"; the average moved {moved / steps:.3g} a step in {steps}" if moved is not None else ""
        return f"exact average: the ranks were {drift:.3g} from it (RMS){where}: {why}"

    @staticmethod
    def _check(window: Window) -> None:
        if window.mode not in MODES:
            raise ValueError(f"window of mode {window.mode!r}: not one of {MODES}")
        for field in ("seconds_per_step", "slow_lateness", "average_seconds", "learning_rate", "allreduce_estimate"):
            value = getattr(window, field)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{field}={value!r} must be finite and >= 0")
        if window.loss is not None and not math.isfinite(window.loss):
            raise ValueError(f"loss={window.loss!r} must be finite (or None: not known)")
        if not 1 <= window.windows <= MAX_WINDOWS:
            raise ValueError(f"windows={window.windows!r} must be in [1, {MAX_WINDOWS}]")

    def choose_mode(self, window: Window) -> Decision:
        """The mode rule alone, before ``decide`` adds the exact averages' schedule (a subclass
        may replace it: a test's policy on fixed step times does)."""
        self._check(window)
        self.cost[window.mode] = window.seconds_per_step
        self._follow_loss(window)
        if window.average_seconds > 0:
            self.average_cost = window.average_seconds
        if window.mode == "allreduce":
            self.estimated = False
        if window.mode == "gossip" and window.routing_changed and not self.remeasured:
            self.remeasured = True
            return Decision("gossip", "measuring gossip again (the ranks it routes around changed in the window)")
        self.remeasured = False
        if "allreduce" not in self.cost and window.mode == "gossip" and window.slow_lateness > 0:
            waits = ALLREDUCE_WAIT * window.slow_lateness
            if window.seconds_per_step < self.margin * waits:
                self.cost["allreduce"], self.estimated = waits, True
                return Decision("gossip", f"allreduce not measured: each of its steps would wait about "
                                          f"{waits * 1000:.0f} ms for the slow rank gossip routes around "
                                          f"({window.slow_lateness * 1000:.0f} ms late), gossip's step "
                                          f"{window.seconds_per_step * 1000:.1f} ms")
        estimate = window.allreduce_estimate
        if ("allreduce" not in self.cost and window.mode == "gossip" and estimate > 0
                and window.seconds_per_step < self.margin * estimate):
            self.cost["allreduce"], self.estimated = estimate, True
            return Decision("gossip", f"allreduce not measured: its step takes at least {estimate * 1000:.1f} ms "
                                      f"(its bytes over the links gossip measured), gossip's "
                                      f"{window.seconds_per_step * 1000:.1f} ms")
        missing = [mode for mode in MODES if mode not in self.cost]
        if missing:
            bound = f"; from the links at least {estimate * 1000:.1f} ms, gossip's " \
                    f"{window.seconds_per_step * 1000:.1f} ms" if estimate > 0 and window.mode == "gossip" else ""
            return Decision(missing[0], f"measuring {missing[0]} (not measured yet{bound})",
                            probe=self.short(missing[0]))
        best = self._best()
        other = MODES[1 - MODES.index(best)]
        if window.mode == best:
            self.since_probe += window.windows
            self.time_in_best += window.seconds_per_step * self.window * window.windows
        if (window.mode == best and self.since_probe >= self.reprobe_windows
                and self.time_in_best * self.probe_share >= self._probe_seconds(other)):
            self.since_probe, self.time_in_best = 0, 0.0
            return Decision(other, f"measuring {other} again ({self.reprobe_windows} windows of {best})",
                            probe=self.short(other))
        gossip, allreduce = self.cost["gossip"], self.cost["allreduce"]
        why = (f"gossip {gossip * 1000:.1f} ms a step {'<' if best == 'gossip' else '>='} {self._margin():g} x "
               f"allreduce's {allreduce * 1000:.1f} ms{' (estimated)' if self.estimated else ''}")
        if self.plateau():
            why += (f"; the loss plateaued: none {PLATEAU_THRESHOLD:.0%} below its best {self.best_loss:.4g} "
                    f"in {self.since_best} steps")
            why += f", the ranks {'over' if self.drifted else 'within'} {DRIFT_STEPS} steps' progress apart"
        return Decision(best, why, windows=min(2 * window.windows, MAX_WINDOWS) if window.mode == best else 1)

    def _probe_seconds(self, mode: str) -> float:
        """What measuring ``mode`` again costs, at its last measured price."""
        steps = self.probe_steps(self.window) if self.short(mode) else self.window
        return steps * self.cost[mode]

    def plateau(self) -> bool:
        """Whether the loss has made no progress for PLATEAU_WINDOWS windows' steps."""
        return self.best_loss is not None and self.since_best >= PLATEAU_WINDOWS * self.window

    def _follow_loss(self, window: Window) -> None:
        """The plateau's bookkeeping: a window loss PLATEAU_THRESHOLD below the best is progress."""
        if window.loss is None:
            return
        best = self.best_loss
        if best is None or window.loss < best - PLATEAU_THRESHOLD * abs(best):
            self.best_loss, self.since_best = window.loss, 0
        else:
            self.since_best += self.window * window.windows

    @property
    def drifted(self) -> bool:
        """Whether the last exact average found the ranks over DRIFT_STEPS steps' progress apart."""
        return self.average_every == 0

    def _margin(self) -> float:
        return min(self.margin, PLATEAU_MARGIN) if self.plateau() and self.drifted else self.margin

    def _best(self) -> str:
        return "gossip" if self.cost["gossip"] < self._margin() * self.cost["allreduce"] else "allreduce"
