"""mxnet_plugin: the byteps.mxnet API on bps_gossip, for MXNet 1.9 and Gluon.

Scripts written for ``byteps.mxnet`` run after changing only the import::

    import mxnet_plugin as bps
    bps.init()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})

Importing it also registers the 'bpsgossip' KVStore type.
"""

import bps_gossip as _core
from bps_gossip import generation, init, local_rank, local_size, rank, size

from . import overlap as _overlap
from .gossip_mode import flush_all as _flush_gossip
from .kvstore import BpsGossip
from .ops import broadcast, broadcast_, byteps_declare_tensor, byteps_push_pull
from .optimizer import DistributedOptimizer
from .parameters import broadcast_parameters
from .trainer import DistributedTrainer

__all__ = [
    "BpsGossip", "DistributedOptimizer", "DistributedTrainer", "broadcast", "broadcast_", "broadcast_parameters",
    "byteps_declare_tensor", "byteps_push_pull", "generation", "init", "local_rank", "local_size", "rank", "shutdown", "size",
]


def shutdown() -> None:
    """Absorb in-flight gossip of every DistributedTrainer and let push_pulls queued in
    MXNet's engine finish, then leave the job; raise a kept push_pull error, if any."""
    if _core.is_initialized():
        _flush_gossip()
        _overlap.drain()
    _core.shutdown()
    _overlap.raise_pending_error()
