"""Fusion for the 'bpsgossip' KVStore: a whole step's pushpulls, as few messages as it takes.

gluon.Trainer and Module hand a store one gradient at a time, ``pushpull(i, grad,
priority=-i)`` for every parameter, every step. On networks of many small tensors
(mobilenet0.25: ~80 gradients of a few KiB) one round trip each costs more than the
step's compute. A store handed one key at a time cannot fuse without guessing what the
rest of the step will be, so instead the step is handed over whole:

- ``kv.pushpull([k1, k2, ...], [v1, v2, ...])`` (MXNet's list form) fuses the listed keys;
- gluon.Trainer's ``_allreduce_grads`` and Module's ``_update_params`` (mxnet/model.py),
  when their store is ours, pass all of the step's dense gradients in one such call
  (installed by :func:`teach_trainer_and_module`; other stores and subclasses that
  override ``_allreduce_grads`` are untouched).

Consecutive small keys of one dtype and device count are summed as one flat message
(:mod:`mxnet_plugin.fusion`, Horovod's fusion buffer), each inside MXNet's engine as soon
as its last member exists; larger keys go alone. Every element is the same sum over
workers as with separate pushpulls. Every rank plans from the same keys and shapes in
the same order, so the names agree; a rank whose keys or shapes differ gets the
server's mismatch error (the layout travels with the push).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Tuple

import mxnet as mx

from .fusion import balance_servers, cut_buckets, layout_text, nbytes_of, push_pull_fused_in_engine
from .shared_gradients import share_gradients, share_module_gradients

Call = Tuple[Any, List[mx.nd.NDArray], int]  # (key, this worker's arrays of it, priority), summed in place
PushAlone = Callable[[Any, List[mx.nd.NDArray], int], None]


def plan_calls(arrays: list[list[mx.nd.NDArray]]) -> tuple[list[list[int]], list[int]]:
    """Each call's arrays (one per device) -> fused buckets of call indices, and the calls sent alone."""
    return cut_buckets((index, nbytes_of(copies[0]), (copies[0].dtype, len(copies)))
                       for index, copies in enumerate(arrays))


def send_groups(grads: list[mx.nd.NDArray]) -> list[list[int]]:
    """How a step of these gradients (one device each) travels: every fused bucket, then every
    gradient sent alone, as indices (for laying them out in shared memory that way)."""
    buckets, alone = plan_calls([[grad] for grad in grads])
    return buckets + [[index] for index in alone]


class StepFusion:
    """Plans buckets for a list of in-place pushpulls (kept while the keys and shapes stay the same)."""

    def __init__(self, prefix: str, push_alone: PushAlone) -> None:
        self.prefix = prefix  # tensor names are prefix + key
        self.push_alone = push_alone  # (key, arrays, priority): one key's in-engine push_pull
        self.planned_calls: tuple = ()  # ((key, arrays), ...) of the planned calls
        self.buckets: list[tuple[list[int], str, str]] = []  # (call indices, name, layout)
        self.alone: list[int] = []
        self.shared = False  # whether gradients were offered to shared memory (once)

    def pushpull(self, calls: list[Call], owners: list[mx.gluon.Parameter] | None = None) -> None:
        """Sum every call's arrays over workers, in place, fused where small (returns at once).
        ``owners``, the gluon parameters whose gradients the calls are (one each), lets the
        first step move the gradients into shared memory, laid out as planned."""
        if not self._same_calls(calls):
            if owners is not None and not self.shared:
                self.shared = True
                buckets, alone = plan_calls([arrays for _, arrays, _ in calls])
                share_gradients([[owners[i] for i in indices] for indices in buckets + [[i] for i in alone]])
                calls = [(key, owner.list_grad(), priority) for (key, _, priority), owner in zip(calls, owners)]
            self.plan(calls)
        for indices, name, layout in self.buckets:
            if len(indices) == 1:
                key, arrays, priority = calls[indices[0]]
                self.push_alone(key, arrays, priority)
                continue
            push_pull_fused_in_engine([calls[i][1] for i in indices], name, layout,
                                      priority=max(calls[i][2] for i in indices))
        for index in self.alone:
            self.push_alone(*calls[index])

    def _same_calls(self, calls: list[Call]) -> bool:
        """Whether ``calls`` are the planned ones: the same keys with the same array objects (the
        plan holds them, so their ids cannot be reused; an array's shape and dtype never change)."""
        if len(calls) != len(self.planned_calls):
            return False
        for (key, arrays, _), (planned_key, planned) in zip(calls, self.planned_calls):
            if key != planned_key or len(arrays) != len(planned) or any(a is not b for a, b in zip(arrays, planned)):
                return False
        return True

    def plan(self, calls: list[Call]) -> None:
        """Cut ``calls`` into fused buckets and lone keys (``buckets``, ``alone``), remember them
        as the planned calls and place the tensors on servers; the next ``pushpull`` of the same
        calls follows this plan."""
        planned_calls = tuple((key, tuple(arrays)) for key, arrays, _ in calls)
        groups, self.alone = plan_calls([arrays for _, arrays, _ in calls])
        self.buckets = []
        for indices in groups:
            first = calls[indices[0]][0]
            members = [(f"{self.prefix}{calls[i][0]}", tuple(calls[i][1][0].shape)) for i in indices]
            self.buckets.append((indices, f"{self.prefix}fused_{first}_{len(indices)}", layout_text(members)))
        self.planned_calls = planned_calls
        balance_servers([(name if len(indices) > 1 else f"{self.prefix}{calls[indices[0]][0]}",
                          [calls[i][1][0] for i in indices]) for indices, name, _ in self.buckets]
                        + [(f"{self.prefix}{calls[i][0]}", calls[i][1][:1]) for i in self.alone])


def _dense(arrays: list[mx.nd.NDArray]) -> bool:
    return arrays[0].stype == "default"


def _dense_gradient(param: mx.gluon.Parameter) -> bool:
    """Whether the parameter's gradient is dense: its declared storage (no C call per array every
    step) where gluon keeps it, else its array's."""
    stype = getattr(param, "_grad_stype", None)
    return stype == "default" if isinstance(stype, str) else _dense(param.list_grad())


def teach_trainer_and_module(store_type: type) -> None:
    """Make gluon.Trainer and Module hand a step's gradients to a ``store_type`` store in one call
    (``store.pushpull_step(calls)``), so that it can fuse them, and Module make its gradients in
    shared memory when it sets up its optimizer with such a store."""
    _teach_trainer(store_type)
    _teach_module_gradients(store_type)
    _teach_update_params(store_type)


def _teach_trainer(store_type: type) -> None:
    allreduce = mx.gluon.Trainer._allreduce_grads
    if getattr(allreduce, "_bps_gossip", False):
        return

    def allreduce_grads(trainer: mx.gluon.Trainer) -> None:
        store = trainer._kvstore
        if isinstance(store, store_type) and not trainer._update_on_kvstore:
            trained = [(i, p) for i, p in enumerate(trainer._params) if p.grad_req != "null"]
            if all(_dense_gradient(p) for _, p in trained):
                calls = [(i, p.list_grad(), -i) for i, p in trained]
                store.pushpull_step(calls, owners=[p for _, p in trained])
                return
        allreduce(trainer)

    allreduce_grads._bps_gossip = True
    mx.gluon.Trainer._allreduce_grads = allreduce_grads


def _teach_module_gradients(store_type: type) -> None:
    init_optimizer = mx.module.Module.init_optimizer
    if getattr(init_optimizer, "_bps_gossip_gradients", False):
        return

    def init_optimizer_sharing(module: mx.module.Module, *args: Any, **kwargs: Any) -> Any:
        result = init_optimizer(module, *args, **kwargs)
        store = getattr(module, "_kvstore", None)
        if isinstance(store, store_type) and store.overlap_backward:
            share_module_gradients(module, send_groups)  # laid out as update_params sends them
        return result

    functools.update_wrapper(init_optimizer_sharing, init_optimizer)
    init_optimizer_sharing._bps_gossip_gradients = True
    mx.module.Module.init_optimizer = init_optimizer_sharing


def _teach_update_params(store_type: type) -> None:
    update = mx.model._update_params
    if getattr(update, "_bps_gossip", False):
        return

    def update_params(param_arrays: Any, grad_arrays: Any, updater: Any, num_device: int, kvstore: Any = None,
                      param_names: Any = None) -> None:
        if isinstance(kvstore, store_type):
            pairs = list(zip(param_arrays, grad_arrays))
            calls = [(param_names[i], grads, -i) for i, (_, grads) in enumerate(pairs) if grads[0] is not None]
            if all(_dense(grads) and _dense(args) for args, grads in pairs if grads[0] is not None):
                kvstore.pushpull_step(calls)
                kvstore = None  # summed: the rest is MXNet's local update
        update(param_arrays, grad_arrays, updater, num_device, kvstore, param_names)

    update_params._bps_gossip = True
    for module in (mx.model, mx.module.module):
        if getattr(module, "_update_params", None) is update:
            module._update_params = update_params
