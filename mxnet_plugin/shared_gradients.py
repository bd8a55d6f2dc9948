"""Gradients that live in shared memory, so that push_pull copies nothing in or out.

A push_pull to a server on this host (or to the host's leader) goes through shared memory:
the worker copied each gradient into its segment, the server summed there, and the worker
copied the sum back, two passes over every gradient a step (on resnet18_v1, ~11 ms of a
worker's CPU per step on this 2-core machine). Here the gradients are made in the shared
memory itself (:func:`bps_gossip.shared_buffer`): one buffer for the trained parameters, each
fused bucket's gradients back to back in the order the bucket sends them, so the bucket's
flat message is the gradients' own memory, and a gradient sent alone is its own message.

An MXNet array over memory we own is made through DLPack (``MXNDArrayFromDLPackEx``) with a
tensor description of our own whose deleter is NULL: MXNet frees the array without calling
back into Python (numpy's DLPack deleter would run without the GIL inside ``MXNDArrayFree``
and crash the interpreter), and the buffer stays mapped while the process lives. The
parameter's gradient is replaced by the new array, holding the same values, and marked for
autograd as gluon does (``autograd.mark_variables``); backward, hybridized or not, then
writes into it. Nothing depends on it staying there: if a gradient moves (gluon makes new ones
on ``reset_ctx``; an operation on it failed), push_pull copies as before.

The Module API binds its gradient arrays into its executor once: when it sets up its optimizer
with the 'bpsgossip' store, its executor (one device) is bound again over the same arrays with the
parameters' gradients in shared memory (:func:`share_module_gradients`).

``BPS_GOSSIP_SHM_GRADIENTS=0`` keeps MXNet's own gradient arrays.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, NDArrayHandle, check_call

import bps_gossip as core

from .fusion import nbytes_of

ALIGN = 64  # each group starts on a cache line
log = logging.getLogger("bps_gossip.mxnet_plugin")


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _ManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_KIND = {"f": 2, "i": 0, "u": 1}  # DLPack's type codes: float, int, uint
_CPU = 1


def enabled() -> bool:
    """``BPS_GOSSIP_SHM_GRADIENTS`` (1, the default, or 0), as the job's Config read it."""
    return core.job_config().shm_gradients


def array_over(memory: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> mx.nd.NDArray:
    """An MXNet CPU array of ``shape`` and ``dtype`` over the start of ``memory`` (which must
    outlive it: MXNet never frees it)."""
    dtype = np.dtype(dtype)
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    described = _ManagedTensor()
    described.dl_tensor = _Tensor(memory.__array_interface__["data"][0], _Device(_CPU, 0), len(shape),
                                  _DataType(_DL_KIND[dtype.kind], dtype.itemsize * 8, 1), dims, None, 0)
    described.deleter = None
    # MXNet frees the array at a time of its own, maybe while the interpreter shuts down: the
    # description (a few dozen bytes) is kept for the process's life, as the memory is.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(described))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(dims))
    handle = NDArrayHandle()
    check_call(_LIB.MXNDArrayFromDLPackEx(ctypes.byref(described), ctypes.c_bool(True), ctypes.byref(handle)))
    return mx.nd.NDArray(handle=handle)


def _movable(param: mx.gluon.Parameter) -> bool:
    grads = param.list_grad()
    return param.grad_req != "null" and len(grads) == 1 and _movable_array(grads[0])


def _arrays_in_shared_memory(groups: list[list[mx.nd.NDArray]]) -> list[list[mx.nd.NDArray]] | None:
    """New arrays shaped like each group's, back to back per group in one shared-memory buffer
    (each group on a cache line), or None where the job has no shared memory."""
    spans = [-(-sum(nbytes_of(a) for a in group) // ALIGN) * ALIGN for group in groups]
    memory = core.shared_buffer(sum(spans)) if sum(spans) else None
    if memory is None:
        return None
    placed, start = [], 0
    for group, span in zip(groups, spans):
        offset, arrays = start, []
        for old in group:
            nbytes = nbytes_of(old)
            arrays.append(array_over(memory[offset:offset + nbytes], tuple(old.shape), np.dtype(old.dtype)))
            offset += nbytes
        placed.append(arrays)
        start += span
    return placed


def _movable_array(grad: mx.nd.NDArray | None) -> bool:
    return (grad is not None and grad.context.device_type == "cpu" and grad.stype == "default"
            and np.dtype(grad.dtype).kind in _DL_KIND)


def share_gradients(groups: list[list[mx.gluon.Parameter]]) -> int:
    """Put each group's gradients back to back in one shared-memory buffer (a group whose
    members cannot all move stays where it is); return how many gradients moved."""
    if not enabled():
        return 0
    groups = [group for group in groups if group and all(_movable(p) for p in group)]
    placed = _arrays_in_shared_memory([[p.list_grad()[0] for p in group] for group in groups])
    if placed is None:
        return 0
    for group, arrays in zip(groups, placed):
        for param, new in zip(group, arrays):
            param.list_grad()[0].copyto(new)  # the values of this step (queued after backward, like any operation)
            param._grad = [new]  # noqa: SLF001 - gluon keeps a parameter's gradients there
            data = param.list_data()
            fresh = [array._fresh_grad for array in data]  # noqa: SLF001 - marking clears it
            mx.autograd.mark_variables(data, param._grad, param.grad_req)  # noqa: SLF001
            for array, was in zip(data, fresh):
                array._fresh_grad = was  # noqa: SLF001 - the step's gradient is in the new array
    moved = sum(len(group) for group in groups)
    log.debug("%d gradients moved into shared memory", moved)
    return moved


def share_module_gradients(module: mx.module.Module, plan: Callable[[list[mx.nd.NDArray]], list[list[int]]]) -> int:
    """The Module API's form of :func:`share_gradients`: its executor (one device) is bound again
    over the same arrays, with the parameters' gradients in shared memory, grouped as ``plan``
    groups the gradients Module hands the store each step (indices into that list). Returns how
    many gradients moved (0 with several devices, or where the job has no shared memory)."""
    group = module._exec_group  # noqa: SLF001 - Module's executors, as MXNet keeps them
    if not enabled() or group is None or len(group.execs) != 1 or group.grad_arrays is None:
        return 0
    executor = group.execs[0]
    named = [(name, grads[0]) for name, grads in zip(group.param_names, group.grad_arrays) if grads[0] is not None]
    if not named or not all(_movable_array(grad) for _, grad in named):
        return 0
    groups = plan([grad for _, grad in named])
    placed = _arrays_in_shared_memory([[named[i][1] for i in indices] for indices in groups])
    if placed is None:
        return 0
    gradients = {name: grad for name, grad in executor.grad_dict.items() if grad is not None}
    for indices, arrays in zip(groups, placed):
        for index, new in zip(indices, arrays):
            name, old = named[index]
            old.copyto(new)  # 'add' accumulates into what is there
            gradients[name] = new
    group.execs[0] = group.symbol.bind(executor._ctx, args=executor.arg_dict, args_grad=gradients,  # noqa: SLF001
                                       grad_req=group.grad_req, aux_states=executor.aux_dict,
                                       group2ctx=executor._group2ctx, shared_exec=executor)  # noqa: SLF001
    group._collect_arrays()  # noqa: SLF001 - the group's lists of arrays, from its executors
    moved = sum(len(indices) for indices in groups)
    log.debug("%d Module gradients moved into shared memory", moved)
    return moved
