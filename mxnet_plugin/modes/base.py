"""TrainerMode: what DistributedTrainer asks of a mode, and what it hands one.

DistributedTrainer is a gluon.Trainer that chooses one mode object at construction
and calls it at fixed points; it never asks which mode it runs. A new mode is one
subclass here and one entry in :data:`mxnet_plugin.modes.MODE_CLASSES`.

The points, in the order of a step::

    trainer.step(batch_size)
      mode.before_step(batch_size)      # e.g. allreduce + compression: per-step scaling
      gluon: rescale, then
      mode.reduce_gradients()           # allreduce: push_pull; gossip: nothing
      mode.update(apply)                # apply() runs the optimizer; gossip mixes after it

and outside steps: ``reset_world()`` (elastic, after the state is synced), ``flush()``,
``average_parameters()`` and ``consensus_distance()``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar

import mxnet as mx

from bps_gossip.compression import CompressionSpec

from .options import GossipOptions


@dataclasses.dataclass(frozen=True)
class ModeSetup:
    """What DistributedTrainer parsed from its arguments, for the mode it chose.

    ``optimizer_params`` is the caller's dict; ``compressed_optimizer_params`` the same after
    ``compression_params`` took what it uses (BytePS moves ``momentum`` into Nesterov
    compression). ``registered`` lists the parameters in the order the network registered
    them (the trainer's own ``_params`` are sorted by name).
    """

    compression: CompressionSpec | None = None
    fp16: bool = False
    optimizer_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    compressed_optimizer_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    overlap_backward: bool | None = None
    gossip: GossipOptions = dataclasses.field(default_factory=GossipOptions)
    registered: tuple[mx.gluon.Parameter, ...] = ()


class TrainerMode(abc.ABC):
    """One way of keeping the workers of a DistributedTrainer in agreement.

    Built once by DistributedTrainer, after gluon.Trainer's own initialization (so
    ``trainer._params``, sorted by name and alike on every rank, exist), and kept for the
    trainer's life.
    """

    name: ClassVar[str]
    overlap_backward: bool = False  # whether gradients' push_pulls run inside MXNet's engine

    def __init__(self, trainer: mx.gluon.Trainer, setup: ModeSetup) -> None:
        self.trainer = trainer

    @staticmethod
    @abc.abstractmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The optimizer's parameters in this mode (decided before the mode is built)."""

    @abc.abstractmethod
    def before_step(self, batch_size: int) -> None:
        """``step(batch_size)`` begins (``batch_size``: this worker's batch)."""

    @abc.abstractmethod
    def reduce_gradients(self) -> None:
        """gluon.Trainer's ``_allreduce_grads``: the backward's gradients are written."""

    @abc.abstractmethod
    def update(self, apply: Callable[[], None]) -> None:
        """Run the optimizer update (``apply()``) and whatever this mode does around it."""

    @abc.abstractmethod
    def reset_world(self) -> None:
        """Elastic: the job's size changed and every rank holds the synced state."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Finish whatever is in flight so that the parameters are final."""

    @abc.abstractmethod
    def average_parameters(self) -> None:
        """Make every rank's parameters exactly their average over ranks (collective)."""

    @abc.abstractmethod
    def consensus_distance(self) -> float:
        """RMS distance of this rank's parameters from their average over ranks (collective)."""
