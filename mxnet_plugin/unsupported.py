"""What MXNet offers that bps_gossip does not, refused early and plainly, naming what to do instead.

- A server-side optimizer (``update_on_kvstore=True``, ``kv.set_optimizer``): our servers only
  sum; they never run MXNet and never unpickle anything a worker sends, so an optimizer cannot
  travel to them. Every rank updates locally (``update_on_kvstore=False``), which gives the same
  model as dist_sync with the same optimizer.
- Sparse storage (row_sparse gradients or weights, ``sparse_grad=True`` Embedding,
  ``kv.row_sparse_pull``): the servers sum dense arrays only. Use dense gradients
  (``sparse_grad=False``, the default).

Each check raises on every rank from the call that first shows the setting (the trainer's
constructor where MXNet would only notice at the first step).
"""

from __future__ import annotations

from typing import Any, Iterable

from bps_gossip import ConfigError

NO_SERVER_OPTIMIZER = ("has no server-side optimizer (its servers only sum gradients; they never run MXNet or "
                       "unpickle an optimizer)")
SERVER_OPTIMIZER = f"{NO_SERVER_OPTIMIZER}: use update_on_kvstore=False, every rank then updates locally with the same result"
SPARSE = ("supports dense arrays only (no row_sparse gradients, weights or row_sparse_pull): use dense "
          "gradients, e.g. gluon.nn.Embedding(..., sparse_grad=False), the default")


def refuse_ignored_settings(config: Any) -> None:
    """ConfigError for settings the 'bpsgossip' store would otherwise ignore silently (every rank
    would train synchronously, with local updates): BYTEPS_ENABLE_ASYNC=1 and
    MXNET_UPDATE_ON_KVSTORE=1 (gluon.Trainer's and Module's updates on the servers). ``config``:
    the job's bps_gossip Config."""
    if config.enable_async:
        raise ConfigError("BYTEPS_ENABLE_ASYNC=1: the 'bpsgossip' KVStore (gluon.Trainer, Module) has no "
                          "asynchronous mode; it would train synchronously. Use "
                          "DistributedTrainer(..., mode='async') for asynchronous training, or unset it")
    if config.mxnet_update_on_kvstore:
        raise ConfigError(f"MXNET_UPDATE_ON_KVSTORE=1 (or true/yes/on): the 'bpsgossip' KVStore {NO_SERVER_OPTIMIZER}; "
                          "unset it or set it to 0, and every rank updates locally with the same result")


def refuse_update_on_kvstore(update_on_kvstore: Any, where: str) -> None:
    """ValueError if ``update_on_kvstore`` asks for updates on the servers."""
    if update_on_kvstore:
        raise ValueError(f"{where}: update_on_kvstore={update_on_kvstore!r}: bps_gossip {SERVER_OPTIMIZER}")


def refuse_sparse(params: Iterable[Any], where: str) -> None:
    """ValueError naming the gluon Parameters whose gradient or weight storage is not dense."""
    sparse = [text for text in map(_sparse_storage, params) if text]
    if sparse:
        raise ValueError(f"{where}: sparse parameters {', '.join(sparse)}: bps_gossip {SPARSE}")


def refuse_sparse_arrays(arrays: Iterable[Any], where: str) -> None:
    """ValueError if any NDArray is stored sparse."""
    kinds = sorted({array.stype for array in arrays if array.stype != "default"})
    if kinds:
        raise ValueError(f"{where}: {', '.join(kinds)} arrays: bps_gossip {SPARSE}")


def _sparse_storage(param: Any) -> str:
    """'name (grad row_sparse)' for a parameter stored sparse, else ''."""
    for what, attribute in (("grad", "_grad_stype"), ("weight", "_stype")):
        stype = getattr(param, attribute, "default")
        if isinstance(stype, str) and stype != "default":
            return f"{param.name} ({what} {stype})"
    return ""
