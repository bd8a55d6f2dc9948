"""Names our threads carry in the operating system, so that ``top -H``, ``ps -L`` and
``/proc/<pid>/task/<tid>/comm`` tell communication from compute.

Python before 3.14 does not hand ``threading.Thread(name=...)`` to the OS: every thread shows
the interpreter's name ("python3"), as MXNet's and OpenMP's do. scripts/bench_training.py
counts the CPU of the threads named here (and ZeroMQ's, which libzmq names "ZMQbg/...")
as communication.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

PREFIX = "bpsg-"  # every thread of ours: what the benchmarks and a user's top -H look for
ENGINE = PREFIX + "engine"  # a worker's communication engine thread
_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last one NUL
# Looked up once: a thread names itself on its first line, before any other work.
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None


def name_this_thread(name: str) -> None:
    """Give the calling thread the OS name ``name`` (Linux; cut to 15 bytes). Elsewhere, or
    where prctl is missing, nothing happens: a name is a label, never a reason to fail."""
    if _prctl is None:
        return
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode(errors="replace")[:_NAME_BYTES]), 0, 0, 0)


def named(name: str, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` run under the OS thread name ``name``: for threading.Thread(target=...)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        name_this_thread(name)
        return target(*args, **kwargs)

    return run
