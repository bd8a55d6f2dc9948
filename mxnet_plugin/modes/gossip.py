"""DistributedTrainer's gossip mode: Stochastic Gradient Push on the parameters.

Gradients stay local: each step applies the local optimizer update (momentum and other
optimizer state stay local), then mixes the parameters with this round's peers
(:class:`~mxnet_plugin.modes.parameter_gossip.ParameterGossip`), as set by
:class:`~mxnet_plugin.modes.options.GossipOptions`. With a compressor in
``compression_params`` the messages are compressed by CHOCO-Gossip.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import mxnet as mx

from .base import ModeSetup, TrainerMode
from .parameter_gossip import ParameterGossip


class GossipMode(TrainerMode):
    """Local updates, then one gossip round per step (SGP; CHOCO when compressing)."""

    name = "gossip"

    @staticmethod
    def optimizer_params(setup: ModeSetup) -> dict[str, Any]:
        """The caller's optimizer parameters: compressed gossip compresses model differences and
        keeps its own error memory, so the optimizer keeps its momentum."""
        return setup.optimizer_params

    def __init__(self, trainer: mx.gluon.Trainer, setup: ModeSetup) -> None:
        super().__init__(trainer, setup)
        if setup.fp16:
            raise ValueError("DistributedTrainer: fp16 applies to mode='allreduce'; gossip compresses its "
                             "messages with a compressor (onebit, topk, randomk, dithering)")
        compression = setup.compression
        if compression is not None:  # error feedback and momentum are for gradients: not here
            compression = dataclasses.replace(compression, ef=False, momentum=None)
        self.options = setup.gossip
        self.updates = 0  # optimizer updates so far, for average_every
        self.gossip = ParameterGossip(trainer._params, tag="trainer", options=self.options, compression=compression)

    def before_step(self, batch_size: int) -> None:
        """Nothing: the optimizer rescales by 1 / batch_size, this worker's batch, as gluon does."""

    def reduce_gradients(self) -> None:
        """Nothing: gradients stay local; the models are mixed after the update."""

    def update(self, apply: Callable[[], None]) -> None:
        """The local update, then one gossip round; every ``average_every`` updates the exact average."""
        before = self.gossip.values_before_update()
        apply()
        self.gossip.after_update(before)
        self.updates += 1
        every = self.options.average_every
        if every and self.updates % every == 0:
            self.gossip.average_exactly()

    def reset_world(self) -> None:
        """Build the graph for the new size and restart push-sum from weight 1 on the synced parameters."""
        self.gossip.reset_world()

    def restart(self) -> None:
        """Push-sum starts again from weight 1 on equal parameters (the same job: the ranks keep
        routing around the slow ones they found)."""
        self.gossip.reset_world(keep_routing=True)

    def flush(self) -> None:
        """Absorb in-flight gossip rounds (overlap) and write the model back."""
        self.gossip.flush()

    def average_parameters(self) -> None:
        """The exact average over ranks, through the servers (collective)."""
        self.gossip.average_exactly()

    def consensus_distance(self) -> float:
        """RMS distance from the average over ranks, through the servers (collective)."""
        return self.gossip.consensus_distance()
