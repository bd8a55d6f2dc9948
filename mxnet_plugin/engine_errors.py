"""Completing an operation of MXNet's engine with an error, from Python.

An asynchronous operation (:mod:`mxnet_plugin.engine_ops`) ends by calling MXNet's
``CallbackOnComplete(engine, block, const dmlc::Error*)``. Given an error there, MXNet 1.9
keeps a copy on every array the operation writes: the operations that read those arrays are
skipped and pass it on, and the first wait on any of them (``asnumpy()``, ``wait_to_read()``,
``mx.nd.waitall()``) raises ``MXNetError`` with the error's message, as for a failed
operator of its own. So a failed push_pull fails the next read of its gradient and of every
array computed from it, not only the next push_pull.

``dmlc::Error`` is a ``std::runtime_error`` with its own vtable: we build one with
libstdc++'s constructor and libmxnet's exported vtable. MXNet copies it at once
(``std::make_exception_ptr``), so it lives only for the call. Where either symbol is
missing (another MXNet build), :func:`engine_error` gives None and the operation completes
without one: the caller's other means (NaN, the kept error, the exit status) still apply.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from typing import Iterator

from mxnet.base import _LIB

log = logging.getLogger("bps_gossip.mxnet_plugin")

_ERROR_BYTES = 64  # sizeof(dmlc::Error) is 16 (vtable pointer, string pointer); room to spare
_VTABLE_HEADER = 2 * ctypes.sizeof(ctypes.c_void_p)  # offset-to-top and typeinfo precede the slots


class _Symbols:
    """libstdc++'s runtime_error constructor and destructor, and dmlc::Error's vtable."""

    def __init__(self) -> None:
        stdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        self.construct = stdcxx._ZNSt13runtime_errorC2EPKc
        self.construct.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.construct.restype = None
        self.destroy = stdcxx._ZNSt13runtime_errorD2Ev
        self.destroy.argtypes = [ctypes.c_void_p]
        self.destroy.restype = None
        vtable = ctypes.c_void_p.in_dll(_LIB, "_ZTVN4dmlc5ErrorE")
        self.vtable = ctypes.addressof(vtable) + _VTABLE_HEADER


def _load() -> _Symbols | None:
    try:
        return _Symbols()
    except (OSError, AttributeError, ValueError) as exc:
        log.debug("MXNet's engine cannot carry our errors here (%s): failed push_pulls are reported "
                  "by NaN, the next push_pull and the exit status only", exc)
        return None


_symbols = _load()


@contextlib.contextmanager
def engine_error(message: str) -> Iterator[int | None]:
    """A ``dmlc::Error`` holding ``message`` (its address), alive inside the block; None where
    this MXNet build does not allow it."""
    if _symbols is None:
        yield None
        return
    memory = ctypes.create_string_buffer(_ERROR_BYTES)
    address = ctypes.addressof(memory)
    _symbols.construct(address, message.encode("utf-8", "replace"))
    ctypes.c_void_p.from_address(address).value = _symbols.vtable
    try:
        yield address
    finally:
        _symbols.destroy(address)  # frees the message; MXNet holds its own copy
