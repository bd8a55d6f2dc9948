"""Horovod's collectives for MXNet users: ``allgather``, ``broadcast_object``,
``allgather_object``, ``allreduce`` and ``grouped_allreduce`` (with their in-place forms),
with horovod.mxnet's names and argument order, and ``grouped_push_pull`` in BytePS's naming.

Every collective runs over the whole job: ``process_set`` is accepted for Horovod's argument
order and must be left as None. Without a ``name`` a call takes a fixed one per function
(Horovod makes one up per call), so unnamed calls of one function match by their order on
each rank, as in Horovod. Objects are plain data (see :mod:`bps_gossip.objects`), never pickled.
"""

from __future__ import annotations

from typing import Any, Sequence

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.compat import zip_exact

from .ops import to_device

Average = "average"  # Horovod's reduction ops that a parameter server can do: a sum, or its mean
Sum = "sum"


def _check_process_set(process_set: object, where: str) -> None:
    if process_set is not None:
        raise NotImplementedError(f"{where}: process sets are not supported; every collective runs over the "
                                  "whole job (leave process_set=None)")


def _is_average(average: bool | None, op: str | None, where: str) -> bool:
    """Horovod's rule: ``op`` (Average when None), or the deprecated ``average``, not both."""
    if average is not None and op is not None:
        raise ValueError(f"{where}: give op or the deprecated average, not both")
    if op is None:
        return average is None or bool(average)
    if op not in (Average, Sum):
        raise ValueError(f"{where}: op={op!r} is not supported (use mxnet_plugin.Average or mxnet_plugin.Sum)")
    return op == Average


def _host(tensor: Any) -> Any:
    """A dense NDArray's values on the host; anything else as given (the core names it)."""
    if isinstance(tensor, mx.nd.NDArray) and tensor.stype == "default":
        return tensor.asnumpy()
    return tensor


def allgather(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
              process_set: object = None) -> mx.nd.NDArray:
    """Every rank's ``tensor`` concatenated along the first dimension in rank order (a new
    NDArray on ``tensor``'s context); ``tensor`` is unchanged.

    Ranks may differ in the first dimension; the dtype and the other dimensions must agree,
    or every rank raises TensorMismatchError naming the ranks that differ
    (:func:`bps_gossip.allgather`). A numpy array gives a numpy array.
    """
    _check_process_set(process_set, "allgather")
    gathered = core.allgather(_host(tensor), name or "allgather", priority)
    if not isinstance(tensor, mx.nd.NDArray):
        return gathered
    return mx.nd.array(gathered, ctx=tensor.context, dtype=gathered.dtype)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = None) -> Any:
    """root_rank's ``obj`` on every rank (plain data: see :mod:`bps_gossip.objects`); one that
    cannot be encoded raises TypeError on every rank, naming its type."""
    _check_process_set(process_set, "broadcast_object")
    return core.broadcast_object(obj, name or "broadcast_object", root_rank)


def allgather_object(obj: Any, name: str | None = None, process_set: object = None) -> list[Any]:
    """A list of every rank's ``obj`` in rank order (plain data); an object that cannot be
    encoded raises TypeError on every rank, naming the rank and the type."""
    _check_process_set(process_set, "allgather_object")
    return core.allgather_object(obj, name or "allgather_object")


def _reduce(tensors: Sequence[mx.nd.NDArray], names: list[str], average: bool, priority: int,
            prescale: float, postscale: float) -> list[np.ndarray]:
    """Every tensor's sum or mean over the ranks, as host arrays; all start before any waits."""
    hosts = []
    for tensor, name in zip_exact(tensors, names):
        if not isinstance(tensor, mx.nd.NDArray) or tensor.stype != "default":
            raise TypeError(f"allreduce({name!r}): expected a dense mxnet NDArray, got {type(tensor).__name__}")
        host = tensor.asnumpy()
        if prescale != 1.0:
            np.multiply(host, prescale, out=host, casting="unsafe")
        hosts.append(host)
    started = [core.push_pull_async(host, name, average=average, priority=priority, out=host)
               for host, name in zip_exact(hosts, names)]
    for handle, host in zip_exact(started, hosts):
        core.synchronize(handle)
        if postscale != 1.0:
            np.multiply(host, postscale, out=host, casting="unsafe")
    return hosts


def _new_like(host: np.ndarray, tensor: mx.nd.NDArray) -> mx.nd.NDArray:
    """A new NDArray of ``tensor``'s shape, dtype and context holding ``host``."""
    out = mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    to_device(host, out)
    return out


def _names(count: int, name: str | None, default: str) -> list[str]:
    base = name or default
    return [f"{base}.{i}" for i in range(count)]


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], average: bool | None = None, name: str | None = None,
                      priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: object = None, op: str | None = None) -> list[mx.nd.NDArray]:
    """New NDArrays holding the mean (``op=Average``, the default) or sum (``op=Sum``) over the
    ranks of each tensor in the list, tensors matched by list position; each is multiplied by
    ``prescale_factor`` before and ``postscale_factor`` after. ``tensors`` are unchanged."""
    _check_process_set(process_set, "grouped_allreduce")
    tensors = list(tensors)
    hosts = _reduce(tensors, _names(len(tensors), name, "grouped_allreduce"),
                    _is_average(average, op, "grouped_allreduce"), priority, prescale_factor, postscale_factor)
    return [_new_like(host, tensor) for host, tensor in zip_exact(hosts, tensors)]


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None, name: str | None = None,
                       priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: object = None, op: str | None = None) -> list[mx.nd.NDArray]:
    """:func:`grouped_allreduce` written into ``tensors`` in place; returns them."""
    _check_process_set(process_set, "grouped_allreduce_")
    tensors = list(tensors)
    hosts = _reduce(tensors, _names(len(tensors), name, "grouped_allreduce"),
                    _is_average(average, op, "grouped_allreduce_"), priority, prescale_factor, postscale_factor)
    for host, tensor in zip_exact(hosts, tensors):
        to_device(host, tensor)
    return tensors


def allreduce(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, priority: int = 0,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None,
              op: str | None = None) -> mx.nd.NDArray:
    """A new NDArray: the mean (default) or sum of ``tensor`` over the ranks (Horovod's allreduce)."""
    _check_process_set(process_set, "allreduce")
    host, = _reduce([tensor], [name or "allreduce"], _is_average(average, op, "allreduce"), priority,
                    prescale_factor, postscale_factor)
    return _new_like(host, tensor)


def allreduce_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, priority: int = 0,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None,
               op: str | None = None) -> mx.nd.NDArray:
    """:func:`allreduce` written into ``tensor`` in place; returns it."""
    _check_process_set(process_set, "allreduce_")
    host, = _reduce([tensor], [name or "allreduce"], _is_average(average, op, "allreduce_"), priority,
                    prescale_factor, postscale_factor)
    to_device(host, tensor)
    return tensor


def grouped_push_pull(tensors: Sequence[mx.nd.NDArray], version: int = 0, priority: int = 0,
                      name: str | None = None, is_average: bool = True) -> None:
    """``byteps_push_pull`` of a list of tensors at once, in place: tensor i goes under
    ``<name>.<i>`` (name: 'grouped_push_pull' when None); every push starts before any waits."""
    tensors = list(tensors)
    hosts = _reduce(tensors, _names(len(tensors), name, "grouped_push_pull"), bool(is_average), priority, 1.0, 1.0)
    for host, tensor in zip_exact(hosts, tensors):
        to_device(host, tensor)
