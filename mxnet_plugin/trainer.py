"""DistributedTrainer: gluon.Trainer whose first step broadcasts and whose later steps
either gossip-average the models (SGP, the default) or sum the gradients over workers
(BytePS's allreduce mode)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np

import bps_gossip as core

from .compression import parse_compression_params
from .fusion import plan_buckets, push_pull_bucket_in_engine
from .gossip_mode import ParameterGossip
from .ops import finish_push_pull, push_pull_async, to_device, to_host
from .overlap import enabled_by_default, push_pull_in_engine, raise_pending_error
from .parameters import (
    broadcast_initialized,
    broadcast_when_initialized,
    check_root_rank,
    is_initialized,
)

MODES = core.config.TRAINER_MODES


def _given_params(params: Any) -> list[mx.gluon.Parameter]:
    """The parameters in the order the network registered them (roughly forward order)."""
    if isinstance(params, (mx.gluon.ParameterDict, Mapping)):
        items = list(params.values())
    elif isinstance(params, (list, tuple)):
        items = list(params)
    else:
        raise TypeError(f"DistributedTrainer: params must be a ParameterDict, dict or list, got {type(params).__name__}")
    for param in items:
        if not isinstance(param, mx.gluon.Parameter):
            raise TypeError(f"DistributedTrainer: {param!r} is not a gluon Parameter")
    return items


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon.Trainer for bps_gossip jobs.

    The first ``step()`` (or an explicit ``_init_params()``) broadcasts every parameter
    from ``root_rank``; parameters with deferred shapes are broadcast right after their
    initialization in the first forward. ``step(batch_size)`` takes the per-worker
    batch size in both modes.

    ``mode`` defaults to BPS_GOSSIP_MODE (``bpslaunch --mode``), else ``'gossip'``.

    ``mode='gossip'``: Stochastic Gradient Push. Each step applies the local
    optimizer update (momentum and other optimizer state stay local), then mixes the
    parameters with this round's peers on ``graph`` (npdde, dde, bipartite-exp, linear,
    bipartite-linear, ring; ``peers_per_itr`` peers per round). ``push_sum=False``
    uses symmetric push-pull averaging (D-PSGD) instead. ``overlap=True`` lets a round's
    messages arrive while the next step computes (at most ``synch_freq`` + 1 rounds
    open). ``average_every=K`` replaces the models by their exact average through the
    servers every K steps (0: never). Call ``flush()`` before evaluating or saving in
    overlap mode (``save_states`` does it); ``consensus_distance()`` and
    ``average_parameters()`` are collectives: call them on every rank.

    ``compression_params`` (BytePS's dict, see docs/compression.md): in allreduce mode the
    gradients are compressed as in BytePS; in gossip mode the gossip messages are, by
    CHOCO-Gossip on a ring with consensus step ``gossip_gamma`` (error feedback and
    momentum settings are for gradients and do not apply there).

    ``mode='allreduce'``: every step sums the gradients over workers (priority
    ``-index``, so the first layers come back first) and divides by the number of
    workers through the optimizer's rescale factor, as in BytePS. With
    ``overlap_backward`` (default: ``BPS_GOSSIP_OVERLAP_BACKWARD``, on) each gradient's
    push_pull runs inside MXNet's engine as soon as backward has written it and
    ``step()`` returns at once (see ``mxnet_plugin.overlap``); without it, ``step()``
    waits for each gradient in turn, last layer first, and copies it through host buffers.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None, root_rank: int = 0,
                 compression_params: dict | None = None, mode: str | None = None, graph: str = "npdde",
                 peers_per_itr: int = 1, push_sum: bool = True, overlap: bool = False, synch_freq: int = 0,
                 average_every: int = 0, overlap_backward: bool | None = None, gossip_gamma: float = 0.2) -> None:
        optimizer_params = dict(optimizer_params or {})
        given_params = dict(optimizer_params)
        self._compression, self._fp16 = parse_compression_params(compression_params, optimizer_params)
        if mode is None:
            mode = core.load_config().mode  # BPS_GOSSIP_MODE, or bpslaunch --mode
            if self._fp16 and self._compression is None and mode == "gossip":
                warnings.warn("DistributedTrainer: fp16 applies to pushed gradients, which gossip mode does not "
                              "push: averaging gradients (mode='allreduce') instead", stacklevel=2)
                mode = "allreduce"
        if mode not in MODES:
            raise ValueError(f"DistributedTrainer: mode={mode!r} is not one of {MODES}")
        if mode == "gossip" and (self._compression is not None or self._fp16):
            if self._fp16:
                raise ValueError("DistributedTrainer: fp16 applies to mode='allreduce'; gossip compresses its "
                                 "messages with a compressor (onebit, topk, randomk, dithering)")
            # Compressed gossip (CHOCO) compresses model differences and keeps its own error memory:
            # error feedback and momentum for gradients do not apply, the optimizer keeps its momentum.
            self._compression = dataclasses.replace(self._compression, ef=False, momentum=None)
            optimizer_params = given_params
        compressing = mode == "allreduce" and (self._compression is not None or self._fp16)
        if not 0 < gossip_gamma <= 1:
            raise ValueError(f"DistributedTrainer: gossip_gamma={gossip_gamma!r} must be in (0, 1]")
        if isinstance(average_every, bool) or not isinstance(average_every, int) or average_every < 0:
            raise ValueError(f"DistributedTrainer: average_every={average_every!r} must be an int >= 0")
        self.root_rank = check_root_rank(root_rank, "DistributedTrainer")
        self.mode = mode
        given = _given_params(params)
        # Sorted by name so that every rank numbers them alike (BytePS does the same).
        super().__init__(sorted(given, key=lambda p: p.name), optimizer, optimizer_params=optimizer_params,
                         kvstore=None)
        # Backward produces gradients roughly in reverse registration order: staging them in
        # that order lets the last layers' push_pulls run while earlier layers still compute.
        index_of = {id(param): index for index, param in enumerate(self._params)}
        self._ready_order = [(index_of[id(p)], p) for p in reversed(given)]
        self.average_every = average_every
        if overlap_backward is None:
            # Elastic jobs take the host path: a push_pull that fails inside MXNet's engine marks
            # the gradient and every array computed from it as failed for good, so the state
            # could not be restored; on the host path step() raises before the update instead.
            overlap_backward = enabled_by_default() and not core.is_elastic() and not compressing
        elif overlap_backward and compressing:
            raise ValueError("DistributedTrainer: compression runs on the host path: overlap_backward=False")
        self.overlap_backward = bool(overlap_backward)
        self._batch_size = 1
        self.num_steps = 0
        self._buckets: list | None = None  # allreduce overlap: fused small gradients, planned at the first step
        self._alone: list = []
        self._gossip: ParameterGossip | None = None
        self._unscaled = self._scale
        if mode == "allreduce":
            self._scale /= core.size()
        else:
            self._gossip = ParameterGossip(self._params, tag="trainer", compression=self._compression,
                                           gamma=gossip_gamma, graph=graph, peers_per_itr=peers_per_itr,
                                           push_sum=push_sum, overlap=overlap, synch_freq=synch_freq)
        for param in self._params:
            if not is_initialized(param):
                broadcast_when_initialized(param, self.root_rank)

    def reset_world(self) -> None:
        """Elastic: adapt to the job's new size() once the state is synced (every rank).

        Allreduce mode divides gradients by the new number of workers; gossip mode builds
        the graph for the new size and restarts push-sum from weight 1 on the synced
        parameters. The first-step broadcast counts as done (the sync did it).
        """
        if self._gossip is None:
            self._scale = self._unscaled / core.size()
        else:
            self._gossip.reset_world()
        self._params_to_init = [param for param in self._params if not is_initialized(param)]

    def _init_params(self) -> None:
        """Broadcast every initialized parameter that has not been broadcast yet."""
        ready = [param for param in self._params_to_init if is_initialized(param)]
        self._params_to_init = [param for param in self._params_to_init if not is_initialized(param)]
        broadcast_initialized([(param.name, param.list_data()) for param in ready], self.root_rank)

    # -- gossip mode --------------------------------------------------------------
    def _update(self, ignore_stale_grad: bool = False) -> None:
        if self._gossip is None:
            super()._update(ignore_stale_grad)
            return
        before = self._gossip.values_before_update()
        super()._update(ignore_stale_grad)
        self._gossip.after_update(before)
        self.num_steps += 1
        if self.average_every and self.num_steps % self.average_every == 0:
            self._gossip.average_exactly()

    def flush(self) -> None:
        """Absorb in-flight gossip (overlap mode) so that the parameters are final."""
        if self._gossip is not None:
            self._gossip.flush()

    def average_parameters(self) -> None:
        """Make every rank's parameters exactly their average over ranks (collective)."""
        if self._gossip is None:
            return  # allreduce mode keeps every rank identical already
        self._gossip.average_exactly()

    def consensus_distance(self) -> float:
        """RMS distance of this rank's parameters from their average over ranks (collective)."""
        if self._gossip is None:
            return 0.0
        return self._gossip.consensus_distance()

    def save_states(self, fname: str) -> None:
        """Absorb in-flight gossip, then save the optimizer states."""
        self.flush()
        super().save_states(fname)

    # -- allreduce mode -----------------------------------------------------------
    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """One training step; ``batch_size`` is this worker's batch."""
        if self._gossip is None and (self._compression is not None or self._fp16):
            # As BytePS: gradients are divided by batch_size x workers before they are
            # compressed (onebit without scaling depends on it), the optimizer rescales by 1.
            self._batch_size = batch_size
            self._scale = batch_size
        super().step(batch_size, ignore_stale_grad)

    def _allreduce_compressed(self) -> None:
        pending = []
        for index, param in self._ready_order:
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            host = to_host(grads[0])
            for grad in grads[1:]:
                host += to_host(grad)
            host /= host.dtype.type(self._batch_size * core.size())
            wire = host.astype(np.float16) if self._fp16 and host.dtype.kind == "f" else host
            handle = core.push_pull_async(wire, f"gradient_{param.name}", average=False, priority=-index, out=wire,
                                          compression=self._compression)
            pending.append((handle, wire, grads))
        for handle, wire, grads in pending:
            core.synchronize(handle)
            for grad in grads:
                to_device(wire.astype(np.dtype(grad.dtype), copy=False), grad)

    def _allreduce_grads(self) -> None:
        if self._gossip is not None:
            return  # gossip mode: gradients stay local; the models are mixed after the update
        if self._compression is not None or self._fp16:
            self._allreduce_compressed()
            return
        if self.overlap_backward:
            if self._buckets is None:  # grad_req and devices are settled by the first step
                self._buckets, self._alone = plan_buckets(self._ready_order)
            for bucket in self._buckets:  # small gradients: one message per bucket (fusion.py)
                push_pull_bucket_in_engine(bucket)
            for index, param in self._alone:
                push_pull_in_engine(param.list_grad(), f"gradient_{param.name}", average=False, priority=-index)
            return
        raise_pending_error()
        pending = []
        for index, param in self._ready_order:
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
