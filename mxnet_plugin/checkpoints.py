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


def _key(index: Any) -> int | str:
    return int(index) if isinstance(index, (int, np.integer)) else str(index)


# Running values MXNet 1.9.1's optimizers keep on the optimizer object itself (Nadam's product of
# momentum schedules): state like the counters, which a checkpoint file carries in the pickled optimizer.
RUNNING_VALUES = ("m_schedule",)


def optimizer_counters(optimizer: Any) -> dict[str, Any]:
    """The update counters an optimizer's steps read (Adam's bias correction, lr schedules):
    ``num_update``, the per-index counts of every device, as plain ints, and the running values."""
    return {"num_update": int(optimizer.num_update),
            "devices": [[int(device), {_key(k): int(v) for k, v in counts.items()}]
                        for device, counts in sorted(optimizer._all_index_update_counts.items())],
            "running": {name: float(getattr(optimizer, name)) for name in RUNNING_VALUES if hasattr(optimizer, name)}}


def set_optimizer_counters(optimizer: Any, counters: dict[str, Any]) -> None:
    """Put counters from :func:`optimizer_counters` into ``optimizer``.

    MXNet 1.9.1 keeps one count table per device in ``_all_index_update_counts``, and each
    ``Updater.__call__`` points ``_index_update_count`` back at the current device's table:
    replacing ``_index_update_count`` alone is undone at the next update (Adam then ran with the
    old counts). A device of ours the counters do not name gets the first device's counts."""
    tables = {int(device): {_key(k): int(v) for k, v in counts.items()} for device, counts in counters["devices"]}
    if not tables:
        tables = {0: {}}
    first = next(iter(tables.values()))
    for device in optimizer._all_index_update_counts:
        tables.setdefault(device, dict(first))
    optimizer._all_index_update_counts = tables
    optimizer._index_update_count = tables[min(tables)]
    optimizer.num_update = int(counters["num_update"])
    for name, value in counters.get("running", {}).items():
        if name in RUNNING_VALUES and hasattr(optimizer, name):
            setattr(optimizer, name, float(value))


def set_updater_states(updaters: list[mx.optimizer.Updater], states: dict[int, Any] | None,
                       counters: dict[str, Any] | None) -> None:
    """Give ``updaters`` the states of :func:`states_to_host` and the counters of
    :func:`optimizer_counters` (what ``Updater.set_states`` does after unpickling)."""
    if states is not None:
        for updater in updaters:
            # states_synced False: MXNet moves each state to its parameter's device at the next update.
            updater.states = {int(i): states_to_device(s) for i, s in states.items()}
            updater.states_synced = dict.fromkeys(updater.states, False)
    if counters is not None:
        for optimizer in {id(u.optimizer): u.optimizer for u in updaters}.values():
            set_optimizer_counters(optimizer, counters)


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
        mine = ({int(i): states_to_host(s) for i, s in updaters[0].states.items()},
                optimizer_counters(updaters[0].optimizer))
    states, counters = core.broadcast_object(mine, name, root_rank)
    if core.rank() != root_rank:
        set_updater_states(updaters, states, counters)


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
                set_optimizer_counters(kept, optimizer_counters(loaded))
    broadcast_optimizer_states(owner, root_rank, "load_optimizer_states")
