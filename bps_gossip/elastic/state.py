"""What an elastic job keeps across membership changes: save, restore, sync, commit.

The job is reached through a :class:`~.comm.Comm` given as ``comm=`` (the default comm
when None, see :mod:`.comm`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import HostsUpdatedInterrupt, WorkersChangedError
from . import encoding
from .comm import Comm, resolve


def broadcast_object(obj: Any, name: str, root_rank: int = 0, comm: Comm | None = None) -> Any:
    """Return root_rank's ``obj`` on every rank, sent as bytes through the servers.

    Encoded with :mod:`bps_gossip.elastic.encoding` (msgpack, numpy arrays, tuples), never
    pickled: bytes that come through the servers are data, not code. A value it cannot
    encode is a TypeError on every rank naming its type (one worker alone checks it too).
    """
    comm = resolve(comm)
    if comm.size() == 1:
        encoding.encode(obj)  # what a job of several workers refuses, one refuses too
        return obj
    payload, failed = b"", False
    if comm.rank() == root_rank:
        try:
            payload = encoding.encode(obj)
        except TypeError as exc:  # the other ranks are told (a negative length), so all raise
            payload, failed = str(exc)[:500].encode("utf-8"), True
    told = -len(payload) if failed else len(payload)
    length = int(comm.broadcast(np.array([told], dtype=np.int64), f"{name}.length", root_rank)[0])
    data = np.frombuffer(payload, dtype=np.uint8) if payload else np.zeros(abs(length), dtype=np.uint8)
    data = comm.broadcast(data, f"{name}.bytes", root_rank)
    if length < 0:
        raise TypeError(f"broadcast_object({name!r}): root rank {root_rank} could not send its object: "
                        f"{data.tobytes().decode('utf-8', 'replace')} [on rank {comm.rank()}]")
    return encoding.decode(data.tobytes())


class State:
    """The base of everything an elastic job keeps; subclasses say how to save, restore and sync.

    ``commit()`` saves and then asks whether workers wait to join (a barrier on every
    rank, so all ranks decide alike); if so it raises HostsUpdatedInterrupt, which
    :func:`run` handles by resetting without rollback. The save becomes the commit point
    only once every rank has passed that barrier: when the job changes during it, the
    previous commit point stays (otherwise a rank that ran ahead, as ranks do in gossip
    mode, would keep a point the others never reached, and their steps since the last
    common commit would count as done). Subclasses keep what ``save()`` copies in
    attributes named ``_saved...``, each assigned anew by every save. ``comm``: the job
    (:class:`~.comm.Comm`); None uses the default comm.
    """

    def __init__(self, *, comm: Comm | None = None) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._comm = comm

    def _job(self) -> Comm:
        return resolve(self._comm)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call these after every reset (e.g. to scale the learning rate with the new size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called by :func:`run` once the new generation is in)."""
        for callback in self._reset_callbacks:
            callback()

    def save(self) -> None:
        """Keep a copy of the current state in memory (the commit point)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (after a reset, and when a run starts)."""
        raise NotImplementedError

    def commit(self) -> None:
        """Save, then raise HostsUpdatedInterrupt if workers are waiting to join; if the job
        changes before every rank got here, the previous commit point stays."""
        previous = {key: value for key, value in vars(self).items() if key.startswith("_saved")}
        self.save()
        try:
            self.check_host_updates()
        except HostsUpdatedInterrupt:
            raise  # every rank passed the barrier: this save is the commit point
        except WorkersChangedError:
            vars(self).update(previous)
            raise

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt when workers wait to join (same answer on every rank)."""
        comm = self._job()
        if comm.is_initialized() and comm.is_elastic() and comm.commit_check():
            raise HostsUpdatedInterrupt(f"workers are joining the job [on rank {comm.rank()}]")


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class ObjectState(State):
    """Plain Python values as attributes: ``state = ObjectState(epoch=0, batch=0)``.

    Values with ``state_dict()``/``load_state_dict()`` (an :class:`ElasticSampler`) are
    saved and synced through those, in place, so that a DataLoader holding them sees the
    change; their ``on_sync()`` runs after every sync. The keyword ``comm`` is not a value:
    it is the job (see :class:`State`).
    """

    def __init__(self, *, comm: Comm | None = None, **kwargs: Any) -> None:
        super().__init__(comm=comm)
        self._names = list(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def _snapshot(self) -> dict[str, Any]:
        out = {}
        for key in self._names:
            value = getattr(self, key)
            out[key] = copy.deepcopy(value.state_dict() if _stateful(value) else value)
        return out

    def _load(self, snapshot: dict[str, Any]) -> None:
        for key, value in snapshot.items():
            current = getattr(self, key)
            if _stateful(current):
                current.load_state_dict(copy.deepcopy(value))
            else:
                setattr(self, key, copy.deepcopy(value))

    def save(self) -> None:
        """Deep-copy every attribute given to the constructor."""
        self._saved = self._snapshot()

    def restore(self) -> None:
        """Put the saved copies back."""
        self._load(self._saved)

    def sync(self) -> None:
        """Take rank 0's values and make them the saved copy too."""
        comm = self._job()
        if comm.is_initialized() and comm.size() > 1:
            self._load(broadcast_object(self._snapshot(), "elastic.object_state", comm=comm))
        for key in self._names:
            on_sync = getattr(getattr(self, key), "on_sync", None)
            if callable(on_sync):
                on_sync()
        self.save()
