"""The byteps.mxnet collectives on NDArrays: declare, push_pull, broadcast.

Each NDArray goes through the core once each way: ``asnumpy()`` waits for MXNet's
engine and copies into a fresh host buffer that is also the send buffer; the sum
comes back into that same buffer (in place), and one ``_sync_copyfrom`` puts it
into the NDArray (after reordering an array that holds a oneDNN layout, see
``mxnet_plugin.layouts``).
"""

from __future__ import annotations

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.futures import Future as Handle
from bps_gossip.protocol.data import SMALL_PUSH_BYTES

from .layouts import idle_view, make_default
from .overlap import (
    enabled_by_default,
    own_errors,
    push_pull_in_engine,
    raise_pending_error,
    wait_to_read,
)


def _check_tensor(tensor: object, where: str, name: object) -> mx.nd.NDArray:
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{where}({name!r}): expected an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{where}({name!r}): sparse NDArrays ({tensor.stype}) are not supported")
    return tensor


def _require_name(name: object, where: str) -> str:
    if name is None or not isinstance(name, str) or not name:
        raise ValueError(
            f"{where}: every tensor needs a name (name={name!r}); the name identifies the tensor "
            "on every rank, e.g. byteps_push_pull(grad, name='gradient_fc1_weight')"
        )
    return name


def to_host(tensor: mx.nd.NDArray) -> np.ndarray:
    """Wait for ``tensor`` and copy it once into a new host array (the send buffer)."""
    return tensor.asnumpy()


def to_device(host: np.ndarray, tensor: mx.nd.NDArray) -> None:
    """Copy ``host`` into ``tensor`` (one copy, through MXNet's engine).

    A tensor that an inference forward left in a oneDNN layout goes back to the default
    layout first (``mxnet_plugin.layouts``); ``_sync_copyfrom`` cannot write into one.
    """
    if host.size:
        make_default(tensor)
        tensor._sync_copyfrom(host)


def byteps_declare_tensor(name: str, **kwargs: object) -> None:
    """Declare a tensor name (optional: push_pull declares implicitly; order does not matter).

    Keyword arguments (BytePS uses them for compression settings) are accepted and ignored.
    """
    core.declare(_require_name(name, "byteps_declare_tensor"))


def byteps_push_pull(tensor: mx.nd.NDArray, version: int = 0, priority: int = 0, name: str | None = None,
                     is_average: bool = True) -> None:
    """Sum (or average, the default) ``tensor`` over all workers, in place.

    As in BytePS, the result is written into ``tensor``; unlike BytePS the call returns
    only when it is there (so ``tensor.wait_to_read()`` is not needed, but harmless).
    The push_pull runs in MXNet's engine on the tensor's own memory (no copy to and from
    a host array) unless BPS_GOSSIP_OVERLAP_BACKWARD=0 or the job is elastic; a tensor of at
    most 64 KiB goes from the calling thread instead, once the engine is done with it.
    """
    name = _require_name(name, "byteps_push_pull")
    _check_tensor(tensor, "byteps_push_pull", name)
    # (a 0-d NDArray of MXNet's legacy semantics has no plain memory to view: host path)
    if tensor.ndim and tensor.size and enabled_by_default() and not core.is_elastic():
        raise_pending_error()
        if tensor.size * np.dtype(tensor.dtype).itemsize <= SMALL_PUSH_BYTES and tensor.context.device_type == "cpu":
            # Small: from this thread, on the tensor's memory once MXNet's engine is done with it
            # (a 4 KiB push_pull of 2 workers: an operation queued in the engine cost ~150 us more).
            with own_errors():
                view = idle_view(tensor)
            core.push_pull(view, name, average=is_average, priority=priority, out=view)
            return
        # A tensor an operation is still computing may not have its memory yet, and asking for
        # its address from this thread would allocate it a second time beside that operation.
        wait_to_read(tensor)
        push_pull_in_engine([tensor], name, average=is_average, priority=priority)
        wait_to_read(tensor)  # raises this push_pull's own error, if it failed
        raise_pending_error()
        return
    host = to_host(tensor)
    core.push_pull(host, name, average=is_average, priority=priority, version=version, out=host)
    to_device(host, tensor)


def push_pull_async(tensor: mx.nd.NDArray, name: str, average: bool = True, priority: int = 0
                    ) -> tuple[Handle, np.ndarray]:
    """Start a push_pull of ``tensor``; finish it with :func:`finish_push_pull`."""
    name = _require_name(name, "push_pull")
    _check_tensor(tensor, "push_pull", name)
    host = to_host(tensor)
    return core.push_pull_async(host, name, average=average, priority=priority, out=host), host


def finish_push_pull(pending: tuple[Handle, np.ndarray], tensors: list[mx.nd.NDArray]) -> None:
    """Wait for a push_pull started by :func:`push_pull_async`; write the result to ``tensors``."""
    handle, host = pending
    core.synchronize(handle)
    for tensor in tensors:
        to_device(host, tensor)


def broadcast_async(tensor: mx.nd.NDArray, name: str, root_rank: int = 0, priority: int = 0
                    ) -> tuple[Handle, np.ndarray]:
    """Start a broadcast of root's ``tensor``; finish it with :func:`finish_push_pull`."""
    name = _require_name(name, "broadcast")
    _check_tensor(tensor, "broadcast", name)
    host = to_host(tensor)
    return core.broadcast_async(host, name, root_rank=root_rank, out=host, priority=priority), host


def broadcast(tensor: mx.nd.NDArray, root_rank: int = 0, name: str | None = None) -> mx.nd.NDArray:
    """Return a new NDArray holding root_rank's ``tensor`` (bit-exact); ``tensor`` is unchanged."""
    pending = broadcast_async(tensor, _require_name(name, "broadcast"), root_rank)
    core.synchronize(pending[0])
    return mx.nd.array(pending[1], ctx=tensor.context, dtype=tensor.dtype)


def broadcast_(tensor: mx.nd.NDArray, root_rank: int = 0, name: str | None = None) -> mx.nd.NDArray:
    """Broadcast root_rank's ``tensor`` into ``tensor`` on every rank, in place."""
    pending = broadcast_async(tensor, _require_name(name, "broadcast_"), root_rank)
    finish_push_pull(pending, [tensor])
    return tensor
