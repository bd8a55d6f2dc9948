"""DistributedTrainer: gluon.Trainer whose first step broadcasts and whose gradients
are summed over workers (BytePS's allreduce mode)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mxnet as mx

import bps_gossip as core

from .ops import finish_push_pull, push_pull_async, to_host
from .parameters import (
    broadcast_initialized,
    broadcast_when_initialized,
    check_root_rank,
    is_initialized,
)

MODES = ("allreduce",)


def _sorted_params(params: Any) -> list[mx.gluon.Parameter]:
    """Parameters sorted by name, so every rank numbers them the same way."""
    if isinstance(params, (mx.gluon.ParameterDict, Mapping)):
        items = list(params.values())
    elif isinstance(params, (list, tuple)):
        items = list(params)
    else:
        raise TypeError(f"DistributedTrainer: params must be a ParameterDict, dict or list, got {type(params).__name__}")
    for param in items:
        if not isinstance(param, mx.gluon.Parameter):
            raise TypeError(f"DistributedTrainer: {param!r} is not a gluon Parameter")
    return sorted(items, key=lambda p: p.name)


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon.Trainer for bps_gossip jobs.

    The first ``step()`` (or an explicit ``_init_params()``) broadcasts every parameter
    from ``root_rank``; parameters with deferred shapes are broadcast right after their
    initialization in the first forward. In ``mode='allreduce'`` every step sums the
    gradients over workers (priority ``-index``, so the first layers come back first)
    and divides by the number of workers through the optimizer's rescale factor, so
    ``step(batch_size)`` takes the per-worker batch size, as in BytePS.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None, root_rank: int = 0,
                 compression_params: dict | None = None, mode: str = "allreduce") -> None:
        if mode not in MODES:
            raise ValueError(f"DistributedTrainer: mode={mode!r} is not one of {MODES}")
        if compression_params:
            raise ValueError("DistributedTrainer: gradient compression is not supported yet "
                             f"(compression_params={compression_params!r})")
        self.root_rank = check_root_rank(root_rank, "DistributedTrainer")
        self.mode = mode
        super().__init__(_sorted_params(params), optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._scale /= core.size()
        for param in self._params:
            if not is_initialized(param):
                broadcast_when_initialized(param, self.root_rank)

    def _init_params(self) -> None:
        """Broadcast every initialized parameter that has not been broadcast yet."""
        ready = [param for param in self._params_to_init if is_initialized(param)]
        self._params_to_init = [param for param in self._params_to_init if not is_initialized(param)]
        broadcast_initialized([(param.name, param.list_data()) for param in ready], self.root_rank)

    def _allreduce_grads(self) -> None:
        pending = []
        for index, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if len(grads) == 1:
                started = push_pull_async(grads[0], f"gradient_{param.name}", average=False, priority=-index)
            else:  # several devices in this worker: sum them locally first
                host = to_host(grads[0])
                for grad in grads[1:]:
                    host += to_host(grad)
                started = (core.push_pull_async(host, f"gradient_{param.name}", average=False,
                                                priority=-index, out=host), host)
            pending.append((started, grads))
        for started, grads in pending:
            finish_push_pull(started, grads)
