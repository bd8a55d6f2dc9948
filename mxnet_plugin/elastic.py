"""Elastic training for Gluon: the state of a network and its trainer, a sampler, run.

Usage (see docs/elastic.md and examples/train_digits_elastic.py)::

    bps.init()
    sampler = elastic.ElasticSampler(len(dataset), shuffle=True)
    loader = gluon.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    state = elastic.GluonState(net, trainer, sampler=sampler, epoch=0)

    @elastic.run
    def train(state):
        while state.epoch < epochs:
            for batch_index, (x, y) in enumerate(loader):
                ...forward, backward, trainer.step(batch_size)...
                sampler.record_batch(batch_index, batch_size)
                if batch_index % 10 == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.compat import zip_exact
from bps_gossip.elastic import ElasticSampler as _CoreSampler
from bps_gossip.elastic import ObjectState, broadcast_object
from bps_gossip.elastic import run as _core_run
from bps_gossip.elastic.comm import Comm

from . import overlap
from .checkpoints import optimizer_counters, set_updater_states, states_to_host
from .ops import to_device, to_host
from .parameters import broadcast_initialized, is_initialized
from .trainer import DistributedTrainer

__all__ = ["ElasticSampler", "GluonState", "run"]

Result = TypeVar("Result")


def run(func: Callable[..., Result], *, comm: Comm | None = None) -> Callable[..., Result]:
    """:func:`bps_gossip.elastic.run` for Gluon: the same retry loop, where a push_pull that
    failed inside MXNet's engine is known by its own error wherever it surfaces. A read of an
    array computed from it (the loss, the weights) raises ``MXNetError``; the error behind it (a
    WorkersChangedError when a worker died or joins) is raised in its place, so that the ranks
    reset and go on as when the next step raises it."""

    @functools.wraps(func)
    def attempt(*args: Any, **kwargs: Any) -> Result:
        with overlap.own_errors():
            return func(*args, **kwargs)

    return _core_run(attempt, comm=comm)


class ElasticSampler(_CoreSampler, mx.gluon.data.Sampler):
    """:class:`bps_gossip.elastic.ElasticSampler` as a Gluon Sampler (for DataLoader's ``sampler=``)."""


def _parameters(net_or_params: Any) -> list[mx.gluon.Parameter]:
    if isinstance(net_or_params, mx.gluon.Block):
        params = net_or_params.collect_params()
    else:
        params = net_or_params
    if isinstance(params, (mx.gluon.ParameterDict, dict)):
        return [params[name] for name in sorted(params.keys())]
    if isinstance(params, (list, tuple)):
        return sorted(params, key=lambda p: p.name)
    raise TypeError(f"GluonState: expected a Block, ParameterDict or list of Parameters, got {type(params).__name__}")


class GluonState(ObjectState):
    """Parameters, optimizer states and any user values (``**kwargs``) of a Gluon job.

    ``save()`` copies the parameters and the trainer's optimizer states to host memory;
    ``restore()`` puts them back; ``sync()`` broadcasts rank 0's parameters (bit-exact),
    optimizer states and values, then adapts the trainer to the new number of workers
    (allreduce: the gradient scale; gossip: a new graph, push-sum weights restart at 1).
    Parameters must be initialized (run one forward first when shapes are deferred).
    """

    def __init__(self, net_or_params: Any, trainer: mx.gluon.Trainer, **kwargs: Any) -> None:
        self.params = _parameters(net_or_params)
        self.trainer = trainer
        self._saved_params: list[np.ndarray] = []
        self._saved_optimizer: dict[int, Any] | None = None
        super().__init__(**kwargs)

    def _check_initialized(self, where: str) -> None:
        missing = [p.name for p in self.params if not is_initialized(p)]
        if missing:
            raise core.NotInitializedError(
                f"GluonState.{where}: parameters {missing[:5]} are not initialized yet; call "
                "net.initialize() and run one forward pass (deferred shapes) before creating the state")

    def _optimizer_states(self) -> dict[int, Any] | None:
        """The optimizer states as numpy copies (MXNet's get_states() would pickle them, and the
        sync must never unpickle what comes through the servers)."""
        updaters = getattr(self.trainer, "_updaters", None)
        if not updaters:
            return None
        return {index: states_to_host(state) for index, state in updaters[0].states.items()}

    def _load_optimizer_states(self, states: dict[int, Any] | None, counters: dict[str, Any] | None) -> None:
        set_updater_states(self.trainer._updaters, states, counters)

    def _counters(self) -> dict[str, Any]:
        return optimizer_counters(self.trainer._optimizer)

    def _settle(self) -> None:
        """Let push_pulls queued in MXNet's engine finish; raise the error of one that failed."""
        if isinstance(self.trainer, DistributedTrainer):
            self.trainer.flush()
        overlap.drain()
        overlap.raise_pending_error()

    def save(self) -> None:
        """Copy parameters, optimizer states and values (the commit point)."""
        self._check_initialized("save")
        self._settle()
        self._saved_params = [to_host(p.list_data()[0]) for p in self.params]
        self._saved_optimizer = self._optimizer_states()
        self._saved_counters = self._counters()
        super().save()

    def restore(self) -> None:
        """Go back to the last commit."""
        for param, value in zip_exact(self.params, self._saved_params):
            for copy in param.list_data():
                to_device(value, copy)
        self._load_optimizer_states(self._saved_optimizer, self._saved_counters)
        super().restore()

    def sync(self) -> None:
        """Make every rank hold rank 0's parameters, optimizer states and values."""
        self._check_initialized("sync")
        overlap.drain()
        if core.size() > 1:
            broadcast_initialized([(f"elastic.{p.name}", p.list_data()) for p in self.params], 0)
            states, counters = broadcast_object((self._optimizer_states(), self._counters()),
                                                "elastic.optimizer")
            self._load_optimizer_states(states, counters)
        if isinstance(self.trainer, DistributedTrainer):
            self.trainer.reset_world()
        super().sync()  # the values, then save(): the synced state is the commit point
