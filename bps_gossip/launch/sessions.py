"""Processes in sessions of their own: how bpslaunch, the tests and the benchmarks start a process
so that stopping it stops everything it started, and how they stop it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping

from .. import placement

_PR_SET_PDEATHSIG = 1
# Looked up once here: the child between fork and exec should only make the system call.
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None


def _dies_with_parent(signum: int, parent: int):  # noqa: ANN202 - a preexec_fn
    """A preexec_fn: ``signum`` reaches the child when its parent ends (or has ended already)."""
    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(128 + signum)
    return preexec


def start_in_session(argv: list[str], env: Mapping[str, str], parent_death: int | None = None,
                     **popen: object) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session (its own process group), so that
    :func:`kill_groups` stops it and everything it started, on the CPUs ``env``'s placement names (bps_gossip.placement).
    ``parent_death``: the signal it gets when this process ends (Linux; only from the main thread, since the kernel
    sends it when the forking thread ends). ``popen``: Popen's stream arguments."""
    armed = parent_death is not None and _prctl is not None and threading.current_thread() is threading.main_thread()
    popen["preexec_fn"] = placement.start_on_cpus(env, _dies_with_parent(parent_death, os.getpid()) if armed else None)
    return subprocess.Popen(argv, env=dict(env), start_new_session=True, **popen)  # type: ignore[call-overload]


def kill_groups(procs: Iterable[subprocess.Popen], grace: float = 0.0, reap: float = 5.0) -> None:
    """Give ``procs`` up to ``grace`` seconds to exit, then SIGKILL the process group of each one
    still running (the group of one that exited too: what it started may live on), and wait up
    to ``reap`` seconds for each. The one way tests, benchmarks and bpslaunch stop what they started."""
    chosen = list(procs)
    deadline = time.monotonic() + grace
    for proc in chosen:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in chosen:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in chosen:
        try:
            proc.wait(reap)
        except subprocess.TimeoutExpired:
            pass


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a child killed by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(code: int) -> str:
    """'code 3', or 'code 137 (killed by SIGKILL)'."""
    if code > 128:
        try:
            return f"code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"code {code}"
