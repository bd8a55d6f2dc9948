"""DistributedTrainer's allreduce mode: BytePS's gradient push_pull.

Every step sums each gradient over the workers (priority ``-index``, so the first layers
come back first) and divides by the number of workers through the optimizer's rescale
factor, as BytePS does. Three data paths, chosen once:

- overlap_backward (default, see :mod:`mxnet_plugin.overlap`): each gradient's push_pull
  runs inside MXNet's engine as soon as backward has written it, small gradients fused
  into buckets (:mod:`mxnet_plugin.fusion`); ``step()`` returns at once.
- host: ``step()`` waits for each gradient in turn, last layer first, and copies it
  through host buffers (the default in elastic jobs: a failed push_pull then raises
  before the update instead of poisoning MXNet's arrays).
- compressed (``compression_params``): the host path, with gradients divided by
  batch size x workers before they are compressed, as BytePS does.
"""

from __future__ import annotations

from typing import Any, Callable

import mxnet as mx
import numpy as np

import bps_gossip as core

from ..fusion import Bucket, PlannedBucket, balance_servers, plan_buckets
from ..ops import finish_push_pull, push_pull_async, to_device, to_host
from ..overlap import enabled_by_default, push_pull_in_engine, raise_pending_error
from ..shared_gradients import share_gradients
from .base import ModeSetup, TrainerMode


def _host_sum(grads: list[mx.nd.NDArray]) -> np.ndarray:
    """The sum of a gradient's device copies, as a new host array."""
    host = to_host(grads[0])
    for grad in grads[1:]:
        host += to_host(grad)
    return host


def _gradient_name(param: mx.gluon.Parameter) -> str:
    return f"gradient_{param.name}"


class AllreduceMode(TrainerMode):
    """Sum the gradients over workers before every update (BytePS's DistributedTrainer)."""

    name = "allreduce"

    @staticmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The optimizer's parameters less what gradient compression took (momentum)."""
        return setup.compressed_optimizer_params

    def __init__(self, trainer: mx.gluon.Trainer, setup: ModeSetup) -> None:
        super().__init__(trainer, setup)
        self.compression, self.fp16 = setup.compression, setup.fp16
        self.compressing = self.compression is not None or self.fp16
        self.overlap_backward = self._choose_overlap(setup.overlap_backward)
        # Backward produces gradients roughly in reverse registration order: staging them in
        # that order lets the last layers' push_pulls run while earlier layers still compute.
        index_of = {id(param): index for index, param in enumerate(trainer._params)}
        self.ready_order: Bucket = [(index_of[id(p)], p) for p in reversed(setup.registered)]
        self.buckets: list[PlannedBucket] | None = None  # fused small gradients, planned at the first step
        self.alone: Bucket = []  # gradients too large to fuse
        self.batch_size = 1  # this worker's batch of the current step (compressed path)
        self.unscaled = trainer._scale
        trainer._scale = self.unscaled / core.size()

    def _choose_overlap(self, overlap_backward: bool | None) -> bool:
        if overlap_backward is None:
            # Elastic jobs take the host path: a push_pull that fails inside MXNet's engine marks
            # the gradient and every array computed from it as failed for good, so the state
            # could not be restored; on the host path step() raises before the update instead.
            return enabled_by_default() and not core.is_elastic() and not self.compressing
        if overlap_backward and self.compressing:
            raise ValueError("DistributedTrainer: compression runs on the host path: overlap_backward=False")
        return bool(overlap_backward)

    def before_step(self, batch_size: int) -> None:
        """Compressed: gradients are divided by batch_size x workers before they are compressed
        (onebit without scaling depends on it), and the optimizer rescales by 1 (as BytePS)."""
        if self.compressing:
            self.batch_size = batch_size
            self.trainer._scale = batch_size

    def reduce_gradients(self) -> None:
        """Sum every gradient over the workers, on the path chosen at construction."""
        if self.compressing:
            self._push_pull_compressed()
        elif self.overlap_backward:
            self._push_pull_in_engine()
        else:
            self._push_pull_on_host()

    def update(self, apply: Callable[[], None]) -> None:
        """The optimizer's update, on gradients already summed."""
        apply()

    def reset_world(self) -> None:
        """Divide gradients by the job's new number of workers."""
        self.trainer._scale = self.unscaled / core.size()

    def flush(self) -> None:
        """Nothing to do: the parameters are final after each update (MXNet's engine orders any
        read after the push_pulls and the update queued in it)."""

    def average_parameters(self) -> None:
        """Nothing to do: every rank applies the same summed gradients, so the parameters agree."""

    def consensus_distance(self) -> float:
        """0.0: every rank holds the same parameters."""
        return 0.0

    # -- the data paths -----------------------------------------------------------
    def _learned(self) -> Bucket:
        return [(index, param) for index, param in self.ready_order if param.grad_req != "null"]

    def _push_pull_in_engine(self) -> None:
        if self.buckets is None:  # grad_req and devices are settled by the first step
            buckets, self.alone = plan_buckets(self.ready_order)
            # each bucket's gradients back to back in shared memory: push_pull copies nothing
            share_gradients([[param for _, param in bucket] for bucket in buckets]
                            + [[param] for _, param in self.alone])
            self.buckets = [PlannedBucket(bucket) for bucket in buckets]
            balance_servers([(b.name, [p.list_grad()[0] for p in b.params]) for b in self.buckets]
                            + [(_gradient_name(param), param.list_grad()[:1]) for _, param in self.alone])
        for bucket in self.buckets:  # small gradients: one message per bucket (fusion.py)
            bucket.push_pull_in_engine()
        for index, param in self.alone:
            push_pull_in_engine(param.list_grad(), _gradient_name(param), average=False, priority=-index)

    def _push_pull_on_host(self) -> None:
        raise_pending_error()
        pending = []
        for index, param in self._learned():
            grads = param.list_grad()
            if len(grads) == 1:
                started = push_pull_async(grads[0], _gradient_name(param), average=False, priority=-index)
            else:  # several devices in this worker: sum them locally first
                host = _host_sum(grads)
                started = (core.push_pull_async(host, _gradient_name(param), average=False, priority=-index,
                                                out=host), host)
            pending.append((started, grads))
        for started, grads in pending:
            finish_push_pull(started, grads)

    def _push_pull_compressed(self) -> None:
        pending = []
        for index, param in self._learned():
            grads = param.list_grad()
            host = _host_sum(grads)
            host /= host.dtype.type(self.batch_size * core.size())
            wire = host.astype(np.float16) if self.fp16 and host.dtype.kind == "f" else host
            handle = core.push_pull_async(wire, _gradient_name(param), average=False, priority=-index, out=wire,
                                          compression=self.compression)
            pending.append((handle, wire, grads))
        for handle, wire, grads in pending:
            core.synchronize(handle)
            for grad in grads:
                to_device(wire.astype(np.dtype(grad.dtype), copy=False), grad)
