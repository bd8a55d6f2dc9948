"""The children of one bpslaunch: start them in their own sessions, forward their output
behind a prefix, notice who ended, and stop them all (used by every launcher backend and by
scripts/netns_job.py).

Every child runs in its own session, so that stopping it also stops whatever it started:
the supervisor sends the signal to the child's process group, waits a grace period, then
sends SIGKILL. On Linux every child also gets a parent-death signal: if bpslaunch itself is
killed (SIGKILL leaves it no time to stop anyone), the kernel stops its children (workers and
servers at once; the scheduler with SIGTERM, so that it can remove the job's secret file).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO

from ..compat import zip_exact
from ..local_processes import (
    GENERATION_FORMED,
    REGISTRATIONS_VAR,
    STOP_REQUEST,
    WORKER_REGISTERED,
    start_ticks,
)
from ..transport import shm
from .diagnosis import NO_WORKER_REGISTERED
from .sessions import describe_exit, exit_code, start_in_session

GRACE_SECONDS = 3.0  # between the polite signal and SIGKILL
SERVICE_EXIT_SECONDS = 5.0  # how long the scheduler and servers get to exit after the workers
REGISTRATION_LAG_SECONDS = 1.0  # the scheduler's report of a registration may trail a worker's exit this long
_POLL_SECONDS = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SEGMENT_END = re.compile(rb"(\r\n|\r|\n)")  # what ends one piece of a child's output
@dataclasses.dataclass
class Child:
    """One process a Supervisor started: its exit code once it ended, its output's pumps."""

    label: str
    role: str
    proc: subprocess.Popen
    pumps: list[threading.Thread]
    code: int | None = None
    registered: bool = False  # a worker the scheduler reported registered (REGISTRATIONS_VAR)
    segments_env: Mapping[str, str] | None = None  # a worker on this host: sweep its shared memory
    log: IO[bytes] | None = None  # --output-dir: this process's own log file
    # The last lines it printed on stderr (when piped): bpslaunch quotes them when it fails.
    tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))


class Supervisor:
    """The children of one bpslaunch: start them, forward their output, stop them all.

    Use as a context manager: leaving it kills every process group still alive, even on
    an exception, and restores the signal handlers it installed.
    """

    # Set from the command line (--output-dir, --timestamps) for every Supervisor of this bpslaunch.
    output_dir: str | None = None
    timestamps: bool = False

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.signals: list[int] = []  # signals bpslaunch received, in order
        # Whether a scheduler started here reports registrations, and how many it reported
        # (workers of other launchers' too: those of a remote or joining worker count).
        self.watches_registrations = False
        self.registrations = 0
        self.generations: list[tuple[float, int, int]] = []  # (monotonic time, generation, workers) formed
        self._out_lock = threading.Lock()
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)  # acted on by the waiting loop, never inside the handler

    # -- starting -------------------------------------------------------------------
    def start(self, argv: list[str], env: Mapping[str, str], role: str, label: str,
              prefix: str | None, stdin_data: bytes | None = None) -> Child:
        """Start ``argv`` in a new session. With a ``prefix``, its stdout and stderr are piped
        and forwarded line by line behind the prefix; without one, it shares ours. With
        ``stdin_data``, its stdin is a pipe that gets these bytes and then stays open until the
        child ends (bps_gossip.launch.remote stops its command when its stdin ends, and sweeps
        on its host). A worker started here has its shared-memory segments swept when it exits."""
        pipe = subprocess.PIPE if prefix is not None else None
        stdin = subprocess.DEVNULL if prefix is not None or role != "worker" else None
        if stdin_data is not None:
            stdin = subprocess.PIPE
        # the scheduler cleans up after a killed launcher (bps_gossip.scheduler.node.main), and
        # SIGHUP tells it apart from an ordinary stop
        death = signal.SIGHUP if role == "scheduler" else signal.SIGKILL
        proc = start_in_session(argv, env, parent_death=death, stdin=stdin, stdout=pipe, stderr=pipe)
        if stdin_data is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin_data)
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it ended at once: its exit code tells the waiting loop
        child = Child(label, role, proc, [])
        if role == "scheduler" and env.get(REGISTRATIONS_VAR) == "1" and prefix is not None:
            self.watches_registrations = True
        if role == "worker" and stdin_data is None:
            child.segments_env = env
        if prefix is not None:
            log = None
            if self.output_dir is not None:  # one file per process, its output without prefixes
                os.makedirs(self.output_dir, exist_ok=True)
                log = open(os.path.join(self.output_dir, label.replace(" ", "") + ".log"), "ab")  # noqa: SIM115
                child.log = log
            for pipe_in, sink, tail in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, child.tail)):
                requests = role == "scheduler" and pipe_in is proc.stderr  # its stop requests (local_processes.py)
                thread = threading.Thread(target=self._pump, args=(pipe_in, sink, prefix.encode(), tail, log, requests),
                                          name=f"bpslaunch-{label}", daemon=True)
                thread.start()
                child.pumps.append(thread)
        self.children.append(child)
        return child

    def _pump(self, pipe: IO[bytes], sink: IO[str], prefix: bytes, tail: collections.deque[str] | None = None,
              log: IO[bytes] | None = None, requests: bool = False) -> None:
        """Copy ``pipe`` to ``sink`` behind ``prefix``, one line at a time; a carriage return
        ends a segment too, so progress bars (tqdm redraws with '\r') stay whole and prefixed
        instead of piling up into one garbled line. With ``requests`` (the scheduler's stderr),
        stop requests are acted on instead of shown."""
        out = getattr(sink, "buffer", None)
        pending = b""
        with pipe:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                pending += chunk
                segments = _SEGMENT_END.split(pending)
                pending = segments.pop()  # the part after the last terminator (maybe empty)
                if not pending and segments and segments[-1] == b"\r":  # maybe the first half of "\r\n"
                    pending = b"".join(segments[-2:])
                    del segments[-2:]
                for text, end in zip_exact(segments[0::2], segments[1::2]):
                    if not text and end == b"\r":
                        continue  # a bar's leading carriage return: nothing to show yet
                    if requests and text.startswith(STOP_REQUEST.encode()):
                        self._stop_request(text.decode(errors="replace"))
                        continue
                    if requests and text.startswith(WORKER_REGISTERED.encode()):
                        self._registered(text.decode(errors="replace"))
                        continue
                    if requests and text.startswith(GENERATION_FORMED.encode()):
                        self._formed(text.decode(errors="replace"))
                        continue
                    self._emit(out, sink, prefix, text + end, tail if end != b"\r" else None, log)
            if pending:
                self._emit(out, sink, prefix, pending + b"\n", tail, log)

    def _emit(self, out: IO[bytes] | None, sink: IO[str], prefix: bytes, piece: bytes,
              tail: collections.deque[str] | None, log: IO[bytes] | None) -> None:
        if tail is not None:
            tail.append(piece.decode(errors="replace").rstrip())
        if self.timestamps:
            prefix = time.strftime("%H:%M:%S ").encode() + prefix
        segment = prefix + piece
        with self._out_lock:
            if log is not None:
                log.write(piece)
                log.flush()
            if out is not None:
                out.write(segment)
            else:  # a text-only stream (e.g. replaced by a test harness)
                sink.write(segment.decode(errors="replace"))
            sink.flush()

    def _stop_request(self, line: str) -> None:
        """The scheduler removed a worker that still runs (stuck or stopped): stop it, if it is
        one this bpslaunch started and still the same process."""
        parts = line.split()
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            return
        pid, ticks = int(parts[1]), int(parts[2])
        for child in self.children:
            if child.role == "worker" and child.proc.pid == pid and child.proc.poll() is None \
                    and start_ticks(pid) == ticks:
                self.note(f"stopping {child.label} (pid {pid}, SIGKILL): the scheduler removed it from the job")
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                return

    def _registered(self, line: str) -> None:
        """The scheduler says a worker registered: count it, and mark the child it belongs to
        (the registered process is the child or one it started: it is in the child's session)."""
        self.registrations += 1
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            return
        try:
            session = os.getsid(int(parts[1]))
        except OSError:  # gone already, or not on this host (ssh)
            return
        for child in self.children:
            if child.role == "worker" and child.proc.pid == session:
                child.registered = True

    def _formed(self, line: str) -> None:
        """The scheduler sent an address book: remember when, which generation and its size."""
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            self.generations.append((time.monotonic(), int(parts[1]), int(parts[2])))

    def none_registered(self) -> bool:
        """True when this bpslaunch's scheduler reports registrations and no worker registered
        (after a moment for the scheduler's report of a registration to arrive)."""
        deadline = time.monotonic() + REGISTRATION_LAG_SECONDS
        while self.watches_registrations and self.registrations == 0 and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        return self.watches_registrations and self.registrations == 0

    def note(self, message: str) -> None:
        """Print one line of bpslaunch's own on stderr."""
        with self._out_lock:
            print(f"bpslaunch: {message}", file=sys.stderr, flush=True)

    # -- waiting --------------------------------------------------------------------
    def reap(self) -> list[Child]:
        """Record the exit codes of children that ended since the last call; return them."""
        ended = []
        for child in self.children:
            if child.code is None and child.proc.poll() is not None:
                child.code = exit_code(child.proc.returncode)
                if child.segments_env is not None:  # a killed worker could not unlink its own
                    removed = shm.sweep_after(child.proc.pid, child.segments_env)
                    if removed:
                        self.note(f"removed {removed} shared-memory segment(s) that {child.label} "
                                  f"(pid {child.proc.pid}, {describe_exit(child.code)}) left in /dev/shm")
                ended.append(child)
        return ended

    def wait(self, fail_fast: bool, services_seconds: float | None = SERVICE_EXIT_SECONDS) -> int:
        """Wait for every worker; return the first non-zero exit code (in time), else 0.

        With ``fail_fast``, a worker that fails, or a scheduler or server that fails before
        the workers are done, stops the whole job at once. A stop signal always does. Then
        the scheduler and servers get ``services_seconds`` to exit by themselves (None: as
        long as they take, e.g. while they serve other launchers' workers).
        """
        first_error = 0
        while True:
            if self.signals:
                sig = self.signals[0]
                self.note(f"got {signal.Signals(sig).name}; stopping every process")
                self.stop(sig)
                return 128 + sig
            for child in self.reap():
                if child.code != 0 and first_error == 0:
                    if fail_fast or child.role == "worker":
                        first_error = child.code
                    if fail_fast:
                        self.note(f"{child.label} (pid {child.proc.pid}) exited with code {child.code}; "
                                  "stopping every process")
                        self.stop(signal.SIGTERM)
                        return first_error
            if all(c.code is not None for c in self.children if c.role == "worker"):
                break
            time.sleep(_POLL_SECONDS)
        if first_error == 0 and self.none_registered():
            self.note(NO_WORKER_REGISTERED)
            self.stop(signal.SIGTERM)
            return 1
        self.wait_services(services_seconds)
        if self.signals:
            self.stop(self.signals[0])
            return 128 + self.signals[0]
        return first_error

    def wait_services(self, seconds: float | None = SERVICE_EXIT_SECONDS, note_after: float = 10.0) -> None:
        """Give the scheduler and servers ``seconds`` (None: no limit, with a note after
        ``note_after`` seconds) to exit by themselves; then stop them."""
        start = time.monotonic()
        noted = seconds is not None
        while any(c.code is None for c in self.children) and not self.signals:
            waited = time.monotonic() - start
            if seconds is not None and waited >= seconds:
                break
            if not noted and waited > note_after:
                late = ", ".join(c.label for c in self.children if c.code is None)
                self.note(f"worker done; {late} still serving the job's other workers (they exit once "
                          "every worker has shut down)")
                noted = True
            time.sleep(_POLL_SECONDS)
            self.reap()
        late = [c.label for c in self.children if c.code is None]
        if late and not self.signals:
            self.note(f"{', '.join(late)} did not exit within {seconds:.0f} s after the workers; stopping them")
            self.stop(signal.SIGTERM)
        for child in self.children:
            if child.role != "worker" and child.code not in (0, None):
                self.note(f"{child.label} exited with code {child.code} after the workers finished")

    # -- stopping -------------------------------------------------------------------
    @staticmethod
    def signal_group(pgid: int, sig: int) -> bool:
        """Send ``sig`` to a process group; False when the group is gone."""
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # a zombie leader on some systems; treat as alive
            return True
        return True

    def stop(self, sig: int) -> None:
        """Send ``sig`` to every live child's group; SIGKILL what is left after the grace period
        (at once if bpslaunch gets another stop signal meanwhile)."""
        alive = [c for c in self.children if c.proc.poll() is None]
        for child in alive:
            self.signal_group(child.proc.pid, sig)
        seen = len(self.signals)
        deadline = time.monotonic() + GRACE_SECONDS
        while (any(c.proc.poll() is None for c in alive) and time.monotonic() < deadline
               and len(self.signals) <= seen):
            time.sleep(_POLL_SECONDS)
        late = [c for c in alive if c.proc.poll() is None]
        if late and len(self.signals) <= seen:  # (a second Ctrl-C asked for it: nothing to say)
            self.note(f"{', '.join(c.label for c in late)} still running {GRACE_SECONDS:g} s after "
                      f"{signal.Signals(sig).name}: SIGKILL")
        for child in late:
            self.signal_group(child.proc.pid, signal.SIGKILL)
        for child in alive:
            child.proc.wait()
        self.reap()

    def close(self) -> None:
        """Kill every group still alive (also what finished children left behind), wait for
        the output to drain, and restore the signal handlers."""
        try:
            groups = [c.proc.pid for c in self.children]
            for child in self.children:
                if child.proc.poll() is None:
                    self.signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            stragglers = [g for g in groups if self.signal_group(g, signal.SIGTERM)]
            deadline = time.monotonic() + 1.0
            while stragglers and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                stragglers = [g for g in stragglers if self.signal_group(g, 0)]
            for group in stragglers:
                self.signal_group(group, signal.SIGKILL)
            for child in self.children:
                for pump in child.pumps:
                    pump.join(timeout=2.0)
                if child.log is not None:
                    child.log.close()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
