"""oneDNN (MKLDNN) memory layouts: reading and writing NDArrays that hold one.

MXNet 1.9's CPU build runs convolutions with oneDNN. An inference forward (outside
``autograd.record()``) stores each convolution weight in oneDNN's blocked layout
inside the NDArray itself, and arrays like that cannot be seen as a plain buffer:
``_sync_copyfrom`` and any raw pointer fail with "We can't generate TBlob for MKLDNN
data" (reading through ``asnumpy()`` works; it reorders into its copy). Training
forwards and backward leave weights and gradients in the default layout.

So before the plugin writes into an array, or takes a raw view of its memory, the
array is brought back to the default layout in place (:func:`make_default`). That
costs nothing when the layout is already the default (one C call, ~1 us); otherwise
it waits for the array and reorders it once, as MXNet itself does before saving it.
The next inference forward reorders the weight again, as it would anyway.

Inside MXNet's engine (an operation queued there) an array cannot be reordered: that would
wait for the operator itself. :func:`raw_view` there only checks, without waiting,
and raises :class:`OneDNNLayoutError` instead of reading blocked memory as if it were
plain.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

import bps_gossip as core


class OneDNNLayoutError(core.BpsGossipError):
    """An array holds a oneDNN layout where it cannot be reordered (inside MXNet's engine)."""


def make_default(array: mx.nd.NDArray) -> None:
    """Bring ``array`` to MXNet's default layout in place if it holds a oneDNN one.

    Must not be called from inside an MXNet operator. Free when the layout is the
    default already; otherwise waits for pending writes to ``array`` and reorders it.
    """
    if array.size:
        pointer = ctypes.c_void_p()
        # MXNDArrayGetData reorders a oneDNN array to the default layout (and waits for it).
        check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))


def holds_onednn_layout(array: mx.nd.NDArray) -> bool:
    """Whether ``array`` holds a oneDNN layout right now (never waits, never reorders)."""
    return bool(array.size) and default_address(array) is None


def default_address(array: mx.nd.NDArray) -> int | None:
    """The address of ``array``'s memory (not empty) in the default layout, or None while it
    holds a oneDNN layout: never waits, never reorders, so it may run inside an operator."""
    managed = ctypes.c_void_p()
    try:
        # ToDLPack needs a plain buffer: it refuses oneDNN arrays instead of converting them.
        check_call(_LIB.MXNDArrayToDLPack(array.handle, ctypes.byref(managed)))
    except mx.base.MXNetError as exc:
        if "MKLDNN" in str(exc):
            return None
        raise
    try:
        # DLManagedTensor starts with DLTensor: data (void *) first, byte_offset (uint64) at 40
        fields = ctypes.cast(managed, ctypes.POINTER(ctypes.c_uint64))
        return int(fields[0]) + int(fields[5])
    finally:
        check_call(_LIB.MXNDArrayCallDLPackDeleter(managed))


def raw_view(array: mx.nd.NDArray, what: str) -> np.ndarray:
    """A writable numpy view of ``array``'s memory: no wait, no copy.

    Only safe where MXNet's engine has granted access to ``array`` (inside an operator).
    Raises :class:`OneDNNLayoutError` naming ``what`` if the memory is in a oneDNN layout.
    """
    if array.size == 0:
        return np.empty(array.shape, array.dtype)
    address_in_engine(array, what)
    return _pointer_view(array)


def address_in_engine(array: mx.nd.NDArray, what: str) -> int:
    """:func:`default_address` of a non-empty array inside an operator, or
    :class:`OneDNNLayoutError` naming ``what``."""
    address = default_address(array)
    if address is None:
        raise OneDNNLayoutError(
            f"{what}: the array holds a oneDNN (MKLDNN) layout inside MXNet's engine, where it cannot be "
            "reordered; an inference forward made it so after this push_pull was queued. Wait for the "
            "forward (mx.nd.waitall()) before queueing, or set BPS_GOSSIP_OVERLAP_BACKWARD=0")
    return address


class IdleViews:
    """Writable views of the memory of arrays nothing in MXNet's engine is using (after a wait
    for it), reordered to the default layout first if one held a oneDNN layout; for arrays read
    or written every step, one slot each (a parameter's copy): the slot's view is made again
    only when it holds another array or the array's memory moved.

    Making a view costs a dozen C calls (shape, size, dtype, pointer); on networks of a
    hundred small tensors (mobilenet) that was over a millisecond a step. A hit costs one:
    the pointer, which also brings a oneDNN layout back to the default one, as
    :func:`make_default` does. A slot keeps its array alive until the slot holds another,
    so ``is`` cannot mistake a new array at a freed one's address for it.
    """

    def __init__(self) -> None:
        self._slots: dict[Hashable, tuple[mx.nd.NDArray, int | None, np.ndarray]] = {}

    def flat(self, slot: Hashable, array: mx.nd.NDArray) -> np.ndarray:
        """A writable one-dimensional view of ``array``'s memory (idle: after a wait for MXNet's engine)."""
        held, address, view = self._slots.get(slot, (None, None, None))
        if held is array and address is None:  # empty: no memory to look up
            return view
        pointer = ctypes.c_void_p()
        if held is array:
            check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
            if pointer.value == address:
                return view
        make_default(array)
        view = _pointer_view(array).reshape(-1)
        self._slots[slot] = (array, _address(view), view)
        return view


def idle_view(array: mx.nd.NDArray) -> np.ndarray:
    """A writable flat view of ``array``'s memory once nothing in MXNet's engine reads or writes
    it (a wait), in the default layout (reordered if it held a oneDNN one). Not inside an operator."""
    check_call(_LIB.MXNDArrayWaitToWrite(array.handle))
    make_default(array)
    return _pointer_view(array).reshape(-1)


def _address(view: np.ndarray) -> int | None:
    return view.__array_interface__["data"][0] if view.size else None


def _pointer_view(array: mx.nd.NDArray) -> np.ndarray:
    if array.size == 0:
        return np.empty(array.shape, array.dtype)
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    dtype = np.dtype(array.dtype)
    return _view_at(pointer.value, array.size * dtype.itemsize, dtype).reshape(array.shape)


def _view_at(address: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
    """A flat numpy view of ``nbytes`` of memory at ``address``."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)


def contiguous_span(views: list[np.ndarray]) -> np.ndarray | None:
    """One flat array over ``views`` if they lie back to back in memory in this order (one
    dtype), else None: a fused bucket whose gradients are shared sends that instead of a copy."""
    if not views or any(v.dtype != views[0].dtype for v in views):
        return None
    start = views[0].__array_interface__["data"][0]
    at = start
    for view in views:
        if view.size and view.__array_interface__["data"][0] != at:
            return None
        at += view.nbytes
    return _view_at(start, at - start, views[0].dtype)
