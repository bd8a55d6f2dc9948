"""broadcast_parameters: make every rank hold root's parameters, deferred ones included.

Gluon parameters whose shapes are unknown until the first forward get the broadcast
injected into their initialization: their ``_init_impl`` (which Gluon calls right after
it learns the shapes, see mxnet/gluon/parameter.py) is wrapped so that, once the
values exist, they are replaced by root's. Every rank then holds root's values right
after its first forward, whatever seed each rank used, and the trainer's first step does not
broadcast them again (:func:`take_hook_broadcast`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mxnet as mx
from mxnet.gluon.parameter import DeferredInitializationError

import bps_gossip as core
from bps_gossip.errors import BpsGossipError

from .ops import broadcast_async, finish_push_pull

PARAMETER_PREFIX = "parameter_"


def check_root_rank(root_rank: object, where: str) -> int:
    """Return ``root_rank`` if it is a rank of this job; raise ValueError otherwise."""
    size = core.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"{where}: root_rank={root_rank!r} is not a rank of this job (size {size}) "
                         f"[on rank {core.rank()}]")
    return root_rank


def is_initialized(param: mx.gluon.Parameter) -> bool:
    """True once the parameter holds data (not deferred, not waiting for initialize())."""
    return param._data is not None


def broadcast_initialized(params: list[tuple[str, list[mx.nd.NDArray]]], root_rank: int) -> None:
    """Broadcast root's value of each (name, copies) into every copy; all start before any waits."""
    pending = [(broadcast_async(copies[0], PARAMETER_PREFIX + name, root_rank), copies)
               for name, copies in params]
    failed = None
    try:
        for started, copies in pending:
            finish_push_pull(started, copies)
    except BpsGossipError as exc:
        failed = exc
    if failed is not None:
        # The message names the tensor, the ranks and what each pushed; the frames below this one
        # are only the wait for the reply (futures, the engine), so the user's traceback ends here.
        raise failed.with_traceback(None)


def take_hook_broadcast(param: mx.gluon.Parameter, root_rank: int) -> bool:
    """True if ``param``'s deferred initialization already broadcast its current values from
    ``root_rank`` (:func:`broadcast_when_initialized`); forgets it, so that it counts once."""
    done = param.__dict__.pop("_bps_hook_broadcast", None)
    return done is not None and done[0] == root_rank and done[1] is param._data


def broadcast_when_initialized(param: mx.gluon.Parameter, root_rank: int) -> None:
    """Make ``param`` take root's values as soon as Gluon initializes it (deferred init)."""
    if getattr(param, "_bps_broadcast_hooked", False):
        return
    original = param._init_impl

    def init_then_broadcast(data: Any, ctx_list: Any) -> None:
        original(data, ctx_list)
        del param._init_impl  # back to the class's method: later re-initializations are local
        param._bps_broadcast_hooked = False
        try:
            broadcast_initialized([(param.name, param.list_data())], root_rank)
        except Exception as exc:
            # Gluon initializes inside its own `except DeferredInitializationError` (Block.forward):
            # that control-flow exception, chained before ours, would add a traceback that says nothing.
            if isinstance(exc.__context__, DeferredInitializationError):
                exc.__suppress_context__ = True
            raise
        # The values (this very list of arrays) are root's: a re-initialization makes a new list.
        param._bps_hook_broadcast = (root_rank, param._data)

    param._init_impl = init_then_broadcast
    param._bps_broadcast_hooked = True


def broadcast_parameters(params: Mapping[str, mx.nd.NDArray] | mx.gluon.ParameterDict, root_rank: int = 0
                         ) -> None:
    """Broadcast parameters from ``root_rank`` to every rank, bit-exact, in place.

    ``params`` is a dict of NDArrays (Module API: ``arg_params``, ``aux_params``) or a
    Gluon ParameterDict. Parameters that are not initialized yet (deferred shapes) are
    broadcast right after Gluon initializes them, i.e. during the first forward.
    Names are sorted, so every rank agrees whatever order it built its network in.
    """
    root_rank = check_root_rank(root_rank, "broadcast_parameters")
    if isinstance(params, mx.gluon.ParameterDict):
        ready = []
        for name, param in sorted(params.items()):
            if is_initialized(param):
                ready.append((name, param.list_data()))
            else:
                broadcast_when_initialized(param, root_rank)
        broadcast_initialized(ready, root_rank)
    elif isinstance(params, Mapping):
        for name, value in params.items():
            if not isinstance(value, mx.nd.NDArray):
                raise TypeError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, not an NDArray")
        broadcast_initialized([(name, [value]) for name, value in sorted(params.items())], root_rank)
    else:
        raise TypeError(f"broadcast_parameters: expected a dict of NDArrays or a gluon ParameterDict, "
                        f"got {type(params).__name__}")
