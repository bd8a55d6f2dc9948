"""Checkpoints across ranks: the optimizer states of one rank on every rank, never pickled on the
wire (the recipe for every entry point: docs/checkpoints.md).

Parameters go with :func:`~mxnet_plugin.broadcast_parameters`. The optimizer states (momentum,
Adam's moments...) and the update counters that learning-rate schedules read travel here as
numpy arrays through :func:`bps_gossip.broadcast_object` (msgpack). A checkpoint file is read by
MXNet's own ``Updater.set_states`` on the root only: it is the user's own file, nothing that
came through a socket.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

import bps_gossip as core

from .ops import to_host
from .parameters import check_root_rank


def states_to_host(state: Any) -> Any:
    """An optimizer state (NDArray, None, or tuples/lists of them) with numpy copies of the arrays."""
    if isinstance(state, mx.nd.NDArray):
        return to_host(state)
    if isinstance(state, (tuple, list)):
        return type(state)(states_to_host(item) for item in state)
    return state


def states_to_device(state: Any) -> Any:
    """The inverse of :func:`states_to_host` (arrays land on the CPU; MXNet moves each to its
    parameter's device at the next update)."""
    if isinstance(state, np.ndarray):
        return mx.nd.array(state, dtype=state.dtype)
    if isinstance(state, (tuple, list)):
        return type(state)(states_to_device(item) for item in state)
    return state


def updaters_of(owner: Any, where: str) -> list[mx.optimizer.Updater]:
    """The updaters that hold ``owner``'s optimizer states: a gluon Trainer's (one per device), a
    Module's (after ``init_optimizer``), or an Updater itself."""
    if isinstance(owner, mx.gluon.Trainer):
        return list(owner._updaters)
    if isinstance(owner, mx.mod.Module):
        updater = getattr(owner, "_updater", None)
        if updater is None:
            raise ValueError(f"{where}: the Module has no updater of its own; call init_optimizer() first "
                             "(with kvstore='bpsgossip', a DistributedOptimizer, or no kvstore)")
        return [updater]
    if isinstance(owner, mx.optimizer.Updater):
        return [owner]
    raise TypeError(f"{where}: expected a gluon Trainer, a Module or an mxnet Updater, got {type(owner).__name__}")


def _counters(optimizer: Any) -> dict[str, Any]:
    return {"num_update": int(optimizer.num_update),
            "index_update_count": {int(k) if isinstance(k, (int, np.integer)) else str(k): int(v)
                                   for k, v in optimizer._index_update_count.items()}}


def _set_counters(optimizer: Any, counters: dict[str, Any]) -> None:
    optimizer.num_update = counters["num_update"]
    optimizer._index_update_count = dict(counters["index_update_count"])


def broadcast_optimizer_states(owner: Any, root_rank: int = 0, name: str = "optimizer_states") -> None:
    """Give every rank root_rank's optimizer states and update counters (collective).

    ``owner``: a gluon Trainer (DistributedTrainer or ``kvstore='bpsgossip'``), a Module after
    ``init_optimizer``, or an Updater. The states go through the servers as numpy arrays
    (msgpack), never pickled; the optimizer's settings stay each rank's own.
    """
    root_rank = check_root_rank(root_rank, "broadcast_optimizer_states")
    updaters = updaters_of(owner, "broadcast_optimizer_states")
    mine = None
    if core.rank() == root_rank:
        mine = ({int(i): states_to_host(s) for i, s in updaters[0].states.items()}, _counters(updaters[0].optimizer))
    states, counters = core.broadcast_object(mine, name, root_rank)
    if core.rank() == root_rank:
        return
    for updater in updaters:
        # What Updater.set_states does after unpickling: states_synced False moves each state to
        # its parameter's device at the next update.
        updater.states = {int(i): states_to_device(s) for i, s in states.items()}
        updater.states_synced = dict.fromkeys(updater.states, False)
    _set_counters(updaters[0].optimizer, counters)


def load_optimizer_states(owner: Any, fname: str, root_rank: int = 0) -> None:
    """Read optimizer states saved by ``Trainer.save_states`` or ``Module.save_optimizer_states``
    on root_rank only, then give them to every rank (collective; see
    :func:`broadcast_optimizer_states`). Each rank keeps its own optimizer object (built with the
    script's settings); the update counters come from the file."""
    root_rank = check_root_rank(root_rank, "load_optimizer_states")
    updaters = updaters_of(owner, "load_optimizer_states")
    if core.rank() == root_rank:
        with open(fname, "rb") as handle:
            data = handle.read()
        for updater in updaters:
            kept = updater.optimizer
            updater.set_states(data)  # MXNet's own reader of its own file format
            loaded, updater.optimizer = updater.optimizer, kept
            if loaded is not kept:
                _set_counters(kept, _counters(loaded))
    broadcast_optimizer_states(owner, root_rank, "load_optimizer_states")
