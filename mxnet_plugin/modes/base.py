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
import numbers
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


def step_loss(loss: Any) -> mx.nd.NDArray | float | None:
    """``step(..., loss=)`` as one scalar: a float, or an NDArray of shape (1,) on the CPU, not yet
    computed (MXNet's engine runs it; reading it waits). None: no loss given."""
    if loss is None:
        return None
    arrays = loss if isinstance(loss, (list, tuple)) and loss else [loss]
    if all(isinstance(array, mx.nd.NDArray) for array in arrays):
        for array in arrays:
            if array.size == 0:
                raise ValueError(f"DistributedTrainer.step: loss is an empty NDArray (shape {array.shape})")
        means = [array.astype("float32", copy=False).mean().as_in_context(mx.cpu()) for array in arrays]
        return means[0] if len(means) == 1 else mx.nd.add_n(*means) / len(means)
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"DistributedTrainer.step: loss must be an NDArray, a list of NDArrays (one per device) or "
                    f"a number, got {type(loss).__name__}")


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

    def running(self) -> TrainerMode:
        """The mode that runs the steps now: this one (``mode='auto'``: the one it chose last)."""
        return self

    def decisions(self) -> list[tuple[int, str, str]]:
        """(step, mode, why) of every decision between modes (only ``mode='auto'`` takes any)."""
        return []

    @staticmethod
    @abc.abstractmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The optimizer's parameters in this mode (decided before the mode is built)."""

    @abc.abstractmethod
    def before_step(self, batch_size: int) -> None:
        """``step(batch_size)`` begins (``batch_size``: this worker's batch)."""

    def observe_loss(self, loss: mx.nd.NDArray | float | None) -> None:
        """The step's loss (``step(..., loss=)``; :func:`step_loss`'s form, None: not given), after ``before_step``;
        only ``mode='auto'`` uses it, the others let it go."""
        del loss

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
