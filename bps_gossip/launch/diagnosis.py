"""Why a job ended that the exit codes alone do not tell: workers that never reached the job,
and failures at start-up that a restart cannot fix.

- **No worker registered.** The scheduler bpslaunch starts reports each worker that registers
  (:data:`~bps_gossip.local_processes.WORKER_REGISTERED` on its stderr). Workers that all exit 0 with
  none registered never called ``bps.init()``: typically a Gluon script that forgot ``import
  mxnet_plugin``, for which MXNet quietly drops ``kvstore='bpsgossip'`` and every rank trains
  alone. bpslaunch says so and exits 1 instead of 0.
- **A start-up failure that repeats** (elastic jobs). A worker that fails with bps_gossip's
  ConfigError (a setting that is wrong; not the scheduler refusing it for the moment), or with
  a programming error before it registered (ValueError, ImportError, NameError, ... as the last
  line of its traceback says), is not restarted: the job ends with that error. A
  slot whose processes fail at start-up (before registering, or within
  :data:`~.elastic.QUICK_FAILURE_SECONDS`) the same way (exit status and last error line, numbers
  aside) :data:`SAME_FAILURES_TO_STOP` times in a row ends the job too. A worker that had
  registered and fails otherwise is restarted as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

NO_WORKER_REGISTERED = (
    "every worker exited, and none registered with the scheduler: the script never called bps.init() "
    "(nor created a DistributedTrainer or a 'bpsgossip' KVStore), so each worker trained alone. Was "
    "mxnet_plugin imported? Without it MXNet quietly ignores kvstore='bpsgossip'. Stopping the job")
SAME_FAILURES_TO_STOP = 3  # a slot failing at start-up the same way this often in a row ends the job
# The last line of a traceback: "ValueError: ...", "bps_gossip.errors.ConfigError: ...".
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception))(?::|$)")
# Errors of the script or its settings: the same at every start, not worth a restart when they
# come before the worker registered (a ConfigError never is).
NOT_WORTH_A_RESTART = ("ConfigError", "SyntaxError", "IndentationError", "ImportError", "ModuleNotFoundError",
                       "NameError", "AttributeError", "TypeError", "ValueError", "FileNotFoundError")
_TRANSIENT = "the scheduler refused"  # a ConfigError that may pass: the job is full, or is changing


def error_line(lines: Iterable[str]) -> str:
    """The exception line of the last traceback among a process's last stderr ``lines`` (or
    its last non-empty line; '' when there is none)."""
    lines = [line.strip() for line in lines if line.strip()]
    found = next((line for line in reversed(lines) if _ERROR_LINE.match(line)), None)
    return found if found is not None else (lines[-1] if lines else "")


def not_worth_a_restart(error: str, registered: bool) -> bool:
    """Whether a worker failed with a configuration error, or with a programming error before
    it ``registered`` (``error``: the last line of its traceback)."""
    match = _ERROR_LINE.match(error)
    if match is None or _TRANSIENT in error:
        return False
    return match.group(1) == "ConfigError" or match.group(1) in NOT_WORTH_A_RESTART and not registered


class StartupFailures:
    """Per slot: the start-up failure its processes repeated in a row, and how often."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[tuple[int, str], int]] = {}  # slot -> (fingerprint, count)

    def count(self, slot: int, code: int, error: str, at_start: bool) -> int:
        """Note a failure in ``slot`` (exit ``code``, last error line ``error``); return how many
        failures in a row at start-up were the same as this one (0 when it was not at start-up)."""
        if not at_start:
            self.last.pop(slot, None)
            return 0
        fingerprint = (code, re.sub(r"\d+", "N", error))  # pids, ports and times differ each time
        previous, count = self.last.get(slot, (None, 0))
        count = count + 1 if previous == fingerprint else 1
        self.last[slot] = (fingerprint, count)
        return count
