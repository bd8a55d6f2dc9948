"""Queue work in MXNet's dependency engine without a custom operator.

``mx.nd.Custom`` costs 200-450 us of the caller's Python per call (the operator's
property object, shape and type inference, a thread of MXNet's custom-operator pool
blocked while the network answers): on resnet18_v1, ~45 push_pulls a step, that is
10-20 ms of the training thread. MXNet's C API has the primitive under it,
``MXEnginePushAsyncND``: a function and the arrays it reads and writes. The engine
calls the function once every earlier write to those arrays is done, and holds every
later reader or writer until the function's completion callback is called, from any
thread: 2-3 us a call, and no thread waits on the network.

:func:`push_async` wraps it. The function gets a ``done`` callable and must call it
exactly once, with the error if the operation failed (it is called for it if the function
raises): MXNet then keeps the error on the arrays the operation writes, and the next wait on
them or on anything computed from them raises it (:mod:`mxnet_plugin.engine_errors`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from typing import Callable, Optional

import mxnet as mx
from mxnet.base import _LIB, check_call

from .engine_errors import engine_error

log = logging.getLogger("bps_gossip.mxnet_plugin")

Done = Callable[[Optional[BaseException]], None]  # done(None), or done(error) for a failure
Work = Callable[[Done], None]

_ASYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_CALLBACK_WORDS = 3  # engine::CallbackOnComplete: the callback, the engine, the operation block


class _Context(ctypes.Structure):
    """mxnet::Context as the C API reads it: device type (1 = CPU) and device id."""

    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


_work: dict[int, Work] = {}  # token -> the work of a queued operation, until the engine runs it
_work_lock = threading.Lock()
_tokens = itertools.count(1)


def _completion(on_complete: int) -> Done:
    """A callable that completes the operation once, with an error or not (the engine's
    callback is copied: it lives on the stack of the call that hands it over)."""
    words = ctypes.cast(on_complete, ctypes.POINTER(ctypes.c_void_p * _CALLBACK_WORDS)).contents
    function, engine, block = words[0], words[1], words[2]
    called = threading.Lock()

    def done(error: BaseException | None = None) -> None:
        if not called.acquire(blocking=False):
            return
        if error is None:
            _COMPLETE(function)(engine, block, None)
            return
        with engine_error(f"{type(error).__name__}: {error}") as carried:
            _COMPLETE(function)(engine, block, carried)

    return done


def _run(run_context: int, on_complete: int, token: int) -> None:
    """The engine's entry point, on one of its threads: run the work of ``token``."""
    done = _completion(on_complete)
    with _work_lock:
        work = _work.pop(token or 0, None)
    if work is None:  # cannot happen; never leave the engine waiting
        done(None)
        return
    try:
        work(done)
    except BaseException as exc:  # noqa: BLE001 - the work reports its own errors; the engine must go on
        log.exception("an operation queued in MXNet's engine raised")
        done(exc)


_RUN = _ASYNC_FUNC(_run)  # one trampoline for every operation, alive as long as the module


def push_async(work: Work, reads: list[mx.nd.NDArray], writes: list[mx.nd.NDArray], name: str,
               priority: int = 0) -> None:
    """Queue ``work(done)`` after every pending write to ``reads`` and ``writes``; later readers
    of ``writes`` (and later writers of either) wait until ``done()`` is called."""
    context = writes[0].context if writes else reads[0].context
    device = _Context(context.device_typeid, context.device_id)
    token = next(_tokens)
    with _work_lock:
        _work[token] = work
    const = (ctypes.c_void_p * max(1, len(reads)))(*[a.handle.value for a in reads])
    mutable = (ctypes.c_void_p * max(1, len(writes)))(*[a.handle.value for a in writes])
    try:
        check_call(_LIB.MXEnginePushAsyncND(_RUN, ctypes.c_void_p(token), None, ctypes.byref(device),
                                            const, len(reads), mutable, len(writes), None,
                                            ctypes.c_int(int(priority)), ctypes.c_char_p(name.encode()),
                                            ctypes.c_bool(False)))
    except BaseException:
        with _work_lock:
            _work.pop(token, None)
        raise
