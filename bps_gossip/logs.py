"""Logging set-up from BYTEPS_LOG_LEVEL (TRACE and FATAL map onto DEBUG and CRITICAL), and the
one line a worker prints when Ctrl-C stops it (:func:`install_interrupt_summary`)."""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}


def get_logger(role: str, level: str = "WARNING") -> logging.Logger:
    """A logger named ``bps_gossip.<role>`` writing to stderr at ``level``."""
    logger = logging.getLogger(f"bps_gossip.{role}")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[bps_gossip {role} %(asctime)s %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(_LEVELS.get(level, logging.WARNING))
    return logger


# -- Ctrl-C in a job ---------------------------------------------------------------
# A terminal's Ctrl-C reaches bpslaunch, which passes SIGINT on to every worker: each one's main
# thread raises KeyboardInterrupt wherever it waits, mostly deep inside this library (a push_pull,
# a gossip round), and Python printed a 20-40 line traceback per worker, interleaved.
_OURS = tuple(str(Path(__file__).resolve().parent.parent / package) + os.sep
              for package in ("bps_gossip", "mxnet_plugin"))
_LIBRARIES = tuple(os.path.realpath(path) + os.sep for name, path in sysconfig.get_paths().items()
                   if name in ("stdlib", "platstdlib", "purelib", "platlib"))


def install_interrupt_summary(where: Callable[[], str], level: str) -> None:
    """Make an uncaught KeyboardInterrupt print one line (``where``: e.g. "rank 1"; where the
    user's code and this library were) instead of its traceback, unless ``level`` is DEBUG or
    TRACE. Only Python's own excepthook is replaced, and it still prints every other exception;
    the exit status stays Python's (killed by SIGINT). ``except KeyboardInterrupt`` in the
    user's code works as before."""
    if sys.excepthook is not sys.__excepthook__ or _LEVELS.get(level, logging.WARNING) <= logging.DEBUG:
        return
    python_hook = sys.excepthook

    def summarize(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            python_hook(kind, value, tb)
            return
        try:
            line = interrupt_summary(value, tb, where())
        except Exception:  # never lose the interrupt's report to a bug in the summary
            python_hook(kind, value, tb)
            return
        print(line, file=sys.stderr, flush=True)

    sys.excepthook = summarize


def interrupt_summary(value: BaseException, tb: TracebackType | None, where: str) -> str:
    """One line for a KeyboardInterrupt: the innermost line of the user's code it passed through,
    and the innermost of this library's, e.g. ``KeyboardInterrupt on rank 1 at train.py:15
    (trainer.step(8)), waiting in bps_gossip/futures.py:52 (wait); BYTEPS_LOG_LEVEL=DEBUG prints
    the traceback``."""
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if os.path.realpath(f.filename).startswith(_OURS)]
    # A compiled extension's frame names the file it was built from, relative and absent here
    # (pyzmq's "zmq/backend/cython/_zmq.py"): a library's, not the user's.
    users = [f for f in frames if f not in mine and not os.path.realpath(f.filename).startswith(_LIBRARIES)
             and (f.filename.startswith("<") or os.path.isfile(f.filename))]
    # "<string>": code made by exec, as MXNet's operators are (or a `python -c` script: the outermost)
    user = ([f for f in users if not f.filename.startswith("<")] or users[:1] or [None])[-1]
    text = f"KeyboardInterrupt{f' ({value})' if str(value) else ''} on {where}"
    if user is not None:
        text += f" at {_place(user)}" + (f" ({user.line})" if user.line else "")
    if mine:
        text += f", waiting in {_place(mine[-1], ours=True)} ({mine[-1].name})"
    return text + "; BYTEPS_LOG_LEVEL=DEBUG prints the traceback"


def _place(frame: traceback.FrameSummary, ours: bool = False) -> str:
    """file:line, the file relative to the package root (ours) or the working directory."""
    path = os.path.realpath(frame.filename)
    base = str(Path(__file__).resolve().parent.parent) if ours else os.getcwd()
    if path.startswith(base + os.sep):
        path = path[len(base) + 1:]
    return f"{path}:{frame.lineno}"
