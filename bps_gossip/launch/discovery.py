"""Where the hosts of an elastic multi-host job come from, and which of them are kept out.

``-H`` and ``--hostfile`` give a fixed list (:class:`FixedHosts`); ``--host-discovery-script
SCRIPT`` asks a script, as Horovod Elastic does (:class:`ScriptDiscovery`): it prints one
``host`` or ``host:slots`` a line and is run again whenever the launcher wants the hosts now.
A script that fails leaves the last good list in place, so one bad run does not take every
host away. :class:`Blacklist` keeps the hosts whose workers failed out of the job, for good or
(``--blacklist-cooldown-range LO HI``) for a cooldown that doubles with each failure.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
import random
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from ..errors import ConfigError
from .backend import note as bpslaunch_note
from .hostfile import MAX_SLOTS, Host, check_unique, parse_host_item

DISCOVERY_TIMEOUT_SECONDS = 10.0  # a script that runs longer is killed and counts as failed
MAX_OUTPUT_BYTES = 1 << 20  # stdout and stderr together; more is a failure, not a longer wait
NOTE_OUTPUT_CHARS = 300  # how much of a failed script's output a note shows
JITTER = 0.1  # a cooldown is up to 10% longer, so hosts that failed together come back apart


class HostDiscovery(abc.ABC):
    """Where the hosts of an elastic multi-host job come from."""

    @abc.abstractmethod
    def hosts(self) -> list[Host]:
        """The hosts available now (a failing source: its last good list)."""

    def describe(self) -> str:
        """The source as the command line gave it, for bpslaunch's messages."""
        return type(self).__name__


class FixedHosts(HostDiscovery):
    """``-H`` or ``--hostfile``: always the same hosts; ``where`` is how the command line gave them."""

    def __init__(self, hosts: Sequence[Host], where: str) -> None:
        self._hosts = list(hosts)
        self._where = where

    def hosts(self) -> list[Host]:
        return list(self._hosts)

    def describe(self) -> str:
        return self._where


@dataclasses.dataclass
class _Run:
    """What one run of the script gave: ``failure`` (what went wrong, after the script's name)
    is None when it exited 0 in time."""

    stdout: str
    output: str  # stdout then stderr, for the note when it failed
    failure: str | None


class ScriptDiscovery(HostDiscovery):
    """``--host-discovery-script SCRIPT``: the hosts are what the executable ``script`` (run
    without a shell, in its own process group, with ``env`` or bpslaunch's environment) prints
    now, one ``host`` or ``host:slots`` a line (``default_slots``: ``--slots-per-host``); blank
    lines and ``#`` comments are ignored, and an empty output means every host is gone.

    A run fails if the script exits non-zero, runs past ``timeout`` seconds (its whole process
    group is killed), prints more than :data:`MAX_OUTPUT_BYTES` or a line that is not a valid,
    new host; :meth:`hosts` then returns the last good list and tells ``note`` once per distinct
    failure, and once more when the script works again.
    """

    def __init__(self, script: str, default_slots: int = 1, timeout: float = DISCOVERY_TIMEOUT_SECONDS,
                 note: Callable[[str], None] = bpslaunch_note, env: Mapping[str, str] | None = None) -> None:
        where = f"--host-discovery-script {script}"
        path = shutil.which(script, path=(os.environ if env is None else env).get("PATH")) if script else None
        if path is None:
            why = "is not executable (chmod +x it)" if script and os.path.isfile(script) else \
                "is not found (give a path to an executable, e.g. ./discover.sh)"
            raise ConfigError(f"{where}: {script!r} {why}")
        if not 1 <= default_slots <= MAX_SLOTS:
            raise ConfigError(f"--slots-per-host {default_slots} must be between 1 and {MAX_SLOTS}")
        if not timeout > 0:
            raise ConfigError(f"{where}: the timeout {timeout} must be > 0 seconds")
        self._script, self._path, self._where = script, path, where
        self._default_slots, self._timeout, self._note = default_slots, timeout, note
        self._env = None if env is None else dict(env)
        self._last_good: list[Host] = []
        self._failing: str | None = None  # the failure last noted, until a run succeeds
        self._failures = 0

    @property
    def failures(self) -> int:
        """How many runs of the script failed so far."""
        return self._failures

    def describe(self) -> str:
        return self._where

    def hosts(self) -> list[Host]:
        run = _run_script(self._path, self._timeout, self._env)
        failure = None if run.failure is None else f"{self._script} {run.failure}"
        if failure is None:
            try:
                found = self._parse(run.stdout)
            except ConfigError as exc:
                failure = str(exc)
        if failure is not None:
            self._failed(failure, run.output)
        else:
            if self._failing is not None:
                self._note(f"host discovery works again: {self._script} lists {_count(found)}")
            self._failing, self._last_good = None, found
        return list(self._last_good)

    def _parse(self, stdout: str) -> list[Host]:
        hosts = []
        for number, line in enumerate(stdout.splitlines(), 1):
            item = line.split("#", 1)[0].strip()
            if item:
                hosts.append(parse_host_item(item, f"{self._script} output line {number}", self._default_slots))
        return check_unique(hosts, f"{self._script} output")

    def _failed(self, failure: str, output: str) -> None:
        self._failures += 1
        if failure == self._failing:  # said already; a script failing every second says it once
            return
        self._failing = failure
        shown = " | ".join(line.strip() for line in output.strip().splitlines() if line.strip())
        if len(shown) > NOTE_OUTPUT_CHARS:
            shown = shown[:NOTE_OUTPUT_CHARS] + "..."
        self._note(f"host discovery: {failure} (keeping the last good list of {_count(self._last_good)}): "
                   f"{shown or '(no output)'}")


def _count(hosts: Sequence[Host]) -> str:
    return f"{len(hosts)} host{'' if len(hosts) == 1 else 's'}"


def _run_script(path: str, timeout: float, env: Mapping[str, str] | None) -> _Run:
    """Run ``path`` in a process group of its own; read at most MAX_OUTPUT_BYTES for at most
    ``timeout`` seconds, then kill the group if the script is not done."""
    try:
        proc = subprocess.Popen([path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=None if env is None else dict(env), start_new_session=True)
    except OSError as exc:
        return _Run("", "", f"could not be started: {exc.strerror or exc}")
    late = f"did not finish within {timeout:g} s (killed)"
    deadline = time.monotonic() + timeout
    with proc:
        out, err, failure = _read_bounded(proc, deadline, late)
        if failure is None:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failure = late
        if failure is not None:
            _kill_group(proc)
        elif proc.returncode != 0:
            failure = _exit_text(proc.returncode)
    stdout, stderr = (data.decode("utf-8", "replace") for data in (out, err))
    return _Run(stdout, stdout + stderr, failure)


def _read_bounded(proc: subprocess.Popen, deadline: float, late: str) -> tuple[bytes, bytes, str | None]:
    """Both pipes of ``proc`` until they close, the deadline passes (failure ``late``) or too
    much arrives. The script's children may hold them open: they are waited for too."""
    chunks: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    total, failure = 0, None
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and failure is None:
            left = deadline - time.monotonic()
            ready = selector.select(left) if left > 0 else []
            if not ready:
                failure = late
            for key, _ in ready:
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                chunks[key.fd] += data
                total += len(data)
            if total > MAX_OUTPUT_BYTES:
                failure = f"wrote more than {MAX_OUTPUT_BYTES} bytes (killed)"
    out, err = chunks.values()
    return bytes(out), bytes(err), failure


def _kill_group(proc: subprocess.Popen) -> None:
    # The script is not reaped yet, so its pid (its group's id) cannot have been reused.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def check_cooldown_range(values: Sequence[float]) -> tuple[float, float]:
    """``--blacklist-cooldown-range LO HI`` as a pair; ConfigError unless 0 < LO <= HI, both finite."""
    where = f"--blacklist-cooldown-range {' '.join(map(str, values))}"
    try:
        low, high = (float(value) for value in values)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: give two numbers of seconds, LO HI") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ConfigError(f"{where}: need 0 < LO <= HI, both finite seconds")
    return low, high


@dataclasses.dataclass
class _Out:
    until: float | None  # clock() when it may come back; None: never
    why: str
    failures: int


class Blacklist:
    """Hosts that failed, kept out for a cooldown (Horovod's --blacklist-cooldown-range LO HI:
    without it a failed host stays out for good).

    The n-th failure of a host keeps it out ``LO * 2**(n-1)`` seconds plus up to 10% jitter,
    never below LO nor above HI; ``clock`` and ``rng`` are there for tests.
    """

    def __init__(self, cooldown: tuple[float, float] | None = None, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._cooldown = None if cooldown is None else check_cooldown_range(cooldown)
        self._clock = clock
        self._rng = rng or random.Random()
        self._hosts: dict[str, _Out] = {}

    def add(self, address: str, why: str) -> float | None:
        """Keep ``address`` out because ``why``; return for how many seconds (None: for good)."""
        failures = self._hosts[address].failures + 1 if address in self._hosts else 1
        seconds = None
        if self._cooldown is not None:
            low, high = self._cooldown
            base = min(low * 2.0 ** min(failures - 1, 64), high)  # the exponent capped: no overflow
            seconds = min(max(base * (1 + self._rng.uniform(0, JITTER)), low), high)
        self._hosts[address] = _Out(None if seconds is None else self._clock() + seconds, why, failures)
        return seconds

    def __contains__(self, address: str) -> bool:
        out = self._hosts.get(address)
        return out is not None and (out.until is None or self._clock() < out.until)

    def why(self, address: str) -> str | None:
        """Why ``address`` is out, or None if it is not (any more)."""
        return self._hosts[address].why if address in self else None

    def active(self) -> dict[str, str]:
        """Address -> why, for the hosts still out."""
        return {address: out.why for address, out in self._hosts.items() if address in self}
