"""DistributedTrainer: gluon.Trainer whose first step broadcasts and whose later steps
either gossip-average the models (SGP, the default) or sum the gradients over workers
(BytePS's allreduce mode). The modes live in :mod:`mxnet_plugin.modes`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import mxnet as mx

import bps_gossip as core

from .compression import mode_for_compression, parse_compression_params
from .modes import GossipOptions, ModeSetup, TrainerMode, mode_class
from .modes.base import step_loss
from .parameters import (
    broadcast_initialized,
    broadcast_when_initialized,
    check_root_rank,
    is_initialized,
    take_hook_broadcast,
)
from .unsupported import refuse_sparse, refuse_update_on_kvstore

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
    """A gluon.Trainer for bps_gossip jobs, with byteps.mxnet's signature.

    ``DistributedTrainer(params, optimizer, optimizer_params=None, root_rank=0,
    compression_params=None)`` as in BytePS. The first ``step()`` (or ``_init_params()``)
    broadcasts every parameter from ``root_rank`` (deferred shapes: right after their first
    forward). ``step(batch_size)`` takes the per-worker batch size in every mode.

    ``mode`` (default BPS_GOSSIP_MODE, ``bpslaunch --mode``, else ``'gossip'``) picks the mode
    object (:mod:`mxnet_plugin.modes`) the trainer hands the work to:

    - ``'gossip'``: Stochastic Gradient Push, a local update then a mix with this round's peers;
      ``graph``, ``peers_per_itr``, ``push_sum``, ``overlap``, ``synch_freq``, ``average_every``,
      ``gossip_gamma``, ``route_slow_links`` (or ``gossip_options=``) set it. Slow links are
      routed around by default. ``flush()`` before evaluating in overlap mode;
      ``consensus_distance()`` and ``average_parameters()`` are collectives (docs/gossip.md).
    - ``'allreduce'``: gradients summed over workers and scaled by the optimizer's rescale factor,
      as in BytePS; with ``overlap_backward`` (default BPS_GOSSIP_OVERLAP_BACKWARD, on) each
      push_pull runs inside MXNet's engine as backward writes its gradient.
    - ``'auto'``: one of the two at a time, chosen every BPS_GOSSIP_AUTO_WINDOW steps the same way
      on every rank; ``active_mode`` and ``mode_history`` say what ran (docs/gossip-auto.md).
    - ``'async'`` (or BYTEPS_ENABLE_ASYNC=1): BytePS's asynchronous training, no wait (docs/async.md).

    ``compression_params`` (BytePS's dict, docs/compression.md) compresses gradients in allreduce
    mode and, by CHOCO-Gossip on a ring (``gossip_gamma``), the gossip messages in gossip mode.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None, root_rank: int = 0,
                 compression_params: dict | None = None, mode: str | None = None, *,
                 overlap_backward: bool | None = None, gossip_options: GossipOptions | None = None,
                 update_on_kvstore: bool | None = None, **gossip: Any) -> None:
        refuse_update_on_kvstore(update_on_kvstore, "DistributedTrainer")  # False/None: what it does anyway
        options = GossipOptions.merge(gossip_options, gossip)
        given_optimizer_params = dict(optimizer_params or {})
        compressed_optimizer_params = dict(given_optimizer_params)
        compression, fp16 = parse_compression_params(compression_params, compressed_optimizer_params)
        cls = mode_class(mode_for_compression(mode, compression), compression, fp16)
        self.root_rank = check_root_rank(root_rank, "DistributedTrainer")
        given = _given_params(params)
        refuse_sparse(given, "DistributedTrainer")
        setup = ModeSetup(compression=compression, fp16=fp16, optimizer_params=given_optimizer_params,
                          compressed_optimizer_params=compressed_optimizer_params,
                          overlap_backward=overlap_backward, gossip=options, registered=tuple(given))
        # Sorted by name so that every rank numbers them alike (BytePS does the same).
        super().__init__(sorted(given, key=lambda p: p.name), optimizer, optimizer_params=cls.optimizer_params(setup),
                         kvstore=None)
        self._gossip_options = options
        self._mode: TrainerMode = cls(self, setup)
        self.num_steps = 0  # optimizer updates so far
        for param in self._params:
            if not is_initialized(param):
                broadcast_when_initialized(param, self.root_rank)

    @property
    def mode(self) -> str:
        """The mode this trainer was built for: 'gossip', 'allreduce', 'auto' or 'async'."""
        return self._mode.name

    @property
    def mode_object(self) -> TrainerMode:
        """The mode object that runs the steps (:mod:`mxnet_plugin.modes`): for tests and tools that
        look at its state (a gossip mode's averager, auto's policy); training needs none of it."""
        return self._mode

    @property
    def active_mode(self) -> str:
        """The mode running now: 'gossip', 'allreduce' or 'async' (with mode='auto', the one chosen last)."""
        return self._mode.running().name

    @property
    def mode_history(self) -> list[tuple[int, str, str]]:
        """mode='auto': (step, mode, why) of every decision (the newest 1,024); other modes: []."""
        return self._mode.decisions()

    @property
    def overlap_backward(self) -> bool:
        """Whether gradients' push_pulls run inside MXNet's engine (allreduce mode only)."""
        return self._mode.overlap_backward

    @property
    def gossip_options(self) -> GossipOptions:
        """The gossip options given (used in gossip mode)."""
        return self._gossip_options

    @property
    def average_every(self) -> int:
        """Gossip mode: the exact average through the servers every this many steps (0: never)."""
        return self._gossip_options.average_every

    def reset_world(self) -> None:
        """Elastic: adapt to the job's new size() once the state is synced (every rank).

        Allreduce mode divides gradients by the new number of workers; gossip mode builds
        the graph for the new size and restarts push-sum from weight 1 on the synced
        parameters. The first-step broadcast counts as done (the sync did it).
        """
        self._mode.reset_world()
        self._params_to_init = [param for param in self._params if not is_initialized(param)]

    def _init_params(self) -> None:
        """Broadcast every initialized parameter that has not been broadcast yet: a deferred one
        was broadcast by its initialization in the first forward, and is not broadcast again."""
        ready = [param for param in self._params_to_init if is_initialized(param)]
        self._params_to_init = [param for param in self._params_to_init if not is_initialized(param)]
        ready = [param for param in ready if not take_hook_broadcast(param, self.root_rank)]
        broadcast_initialized([(param.name, param.list_data()) for param in ready], self.root_rank)

    def step(self, batch_size: int, ignore_stale_grad: bool = False, loss: Any = None) -> None:
        """One training step; ``batch_size`` is this worker's batch.

        ``loss`` (optional): this step's loss, an NDArray (its mean counts), a list of them (one per
        device) or a number. ``mode='auto'`` follows its trend (on a plateau exactness may pay:
        :mod:`mxnet_plugin.modes.auto_policy`); the other modes ignore it. An NDArray is read once a
        window, not every step (no wait on the forward pass); a non-finite loss leaves its window's
        trend unknown.
        """
        value = step_loss(loss)
        self._mode.before_step(batch_size)
        self._mode.observe_loss(value)
        super().step(batch_size, ignore_stale_grad)

    def _allreduce_grads(self) -> None:
        self._mode.reduce_gradients()

    def _update(self, ignore_stale_grad: bool = False) -> None:
        self._mode.update(functools.partial(super()._update, ignore_stale_grad))
        self.num_steps += 1

    def flush(self) -> None:
        """Absorb in-flight gossip (overlap mode), or take the servers' current weights (async mode), so
        that the parameters are final."""
        self._mode.flush()

    def average_parameters(self) -> None:
        """Make every rank's parameters exactly their average over ranks (collective)."""
        self._mode.average_parameters()

    def consensus_distance(self) -> float:
        """RMS distance of this rank's parameters from their average over ranks (collective)."""
        return self._mode.consensus_distance()

    def save_states(self, fname: str) -> None:
        """Absorb in-flight gossip, then save the optimizer states."""
        self.flush()
        super().save_states(fname)
