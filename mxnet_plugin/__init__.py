"""mxnet_plugin: the byteps.mxnet API on bps_gossip, for MXNet 1.9 and Gluon.

Scripts written for ``byteps.mxnet`` run after changing only the import::

    import mxnet_plugin as bps
    bps.init()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})

Importing it also registers the 'bpsgossip' KVStore type.
"""

from __future__ import annotations

try:  # normally already imported at start-up by its .pth (see setup.py); not with python -S
    import bps_gossip_numpy_aliases as _numpy_aliases  # noqa: F401 - before mxnet, on numpy >= 1.24
except ImportError:
    pass

import bps_gossip as _core
from bps_gossip import generation, init, local_rank, local_size, rank, size
from bps_gossip import suspension as _suspension

from . import overlap as _overlap
from .checkpoints import broadcast_optimizer_states, load_optimizer_states
from .collectives import (
    Average,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_push_pull,
)
from .compression import Compression
from .kvstore import BpsGossip
from .modes import GossipOptions
from .modes.parameter_gossip import flush_all as _flush_gossip
from .ops import broadcast, broadcast_, byteps_declare_tensor, byteps_push_pull
from .optimizer import DistributedOptimizer
from .parameters import broadcast_parameters
from .trainer import DistributedTrainer

__all__ = [
    "Average", "BpsGossip", "Compression", "DistributedOptimizer", "DistributedTrainer", "GossipOptions", "Sum", "allgather", "allgather_object", "allreduce",
    "allreduce_", "broadcast", "broadcast_", "broadcast_object", "broadcast_optimizer_states", "broadcast_parameters",
    "byteps_declare_tensor", "byteps_push_pull", "generation", "grouped_allreduce", "grouped_allreduce_", "grouped_push_pull", "init", "load_optimizer_states", "local_rank", "local_size", "rank", "resume", "shutdown", "size",
    "suspend",
]


def shutdown() -> None:
    """Absorb in-flight gossip of every DistributedTrainer and let push_pulls queued in
    MXNet's engine finish, then leave the job; raise a kept push_pull error, if any."""
    if _core.is_initialized():
        _flush_gossip()
        _overlap.drain()
    _core.shutdown()
    _overlap.raise_pending_error()


def suspend() -> None:
    """BytePS's suspend(): leave the elastic job for a while (the others go on), after this
    worker's queued push_pulls and gossip finish; :func:`resume` joins it again. Refused at once
    (ConfigError) in a job that is not elastic and for a job's only worker. See docs/elastic.md."""
    _suspension.suspend(leave=shutdown)


def resume(num_workers: int | None = None, num_servers: int | None = None, global_rank: int | None = None,
           context: object = None) -> None:
    """BytePS's resume(): join the job left by :func:`suspend` again, admitted at the others' next
    commit with a new rank. Inside ``elastic.run`` it raises ResumedInterrupt, and ``run`` syncs
    this worker's state from rank 0 before its training function goes on.

    ``num_workers`` (worker machines, DMLC_NUM_WORKER) and ``num_servers`` are checked, not
    applied: the running job decides who is in it. ``global_rank`` and ``context`` are accepted
    for BytePS's signature and not used (ranks come from the scheduler)."""
    _suspension.resume(num_workers, num_servers)
