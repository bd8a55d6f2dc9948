"""The weights a server stores for asynchronous training (BytePS's BYTEPS_ENABLE_ASYNC).

The servers hold the model: each partition of each tensor (a worker's push names its key and
partition) has one stored array here. A worker's ``init`` push starts it from the payload (the
model every rank holds after the first-step broadcast: whichever rank comes first creates it,
the others get the stored value back); an ``add`` push adds the payload (the change the worker's
local optimizer made) at once, with no round and no wait for other workers. Either way the reply
is the stored array as it is right after the push.

An entry belongs to one ``instance`` of its name: an init of a larger instance (a new model
trained under the same names) replaces every stored partition of that name; pushes of another
instance are refused. Only members of the job (the caller checks the sender's connection against
the address book) reach this table; every push must match the entry's dtype, shape, operation
and size, and carry finite values only. What the table holds is counted per name and in total,
and bounded.

A stored array is never changed in place: an add makes a new one. A reply still being sent
(ZeroMQ sends frames later, without a copy) keeps the array it was given.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from ..protocol.data import describe_signature

MAX_STORE_BYTES = 8 << 30  # what one server stores for asynchronous training, in all
MAX_STORE_ENTRIES = 1 << 16  # stored partitions


class StoreRefused(Exception):
    """A push the store does not take: ``kind`` is an error kind of the protocol (ERROR_KINDS)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@dataclasses.dataclass
class StoredWeights:
    """One partition's stored array, with what every push to it must match."""

    name: str
    instance: int
    sig: dict[str, Any]  # dtype, shape and operation of the whole tensor
    wire: str
    value: np.ndarray  # flat, wire dtype; replaced, never written into
    created_by: int  # the rank whose init created it
    adds: int = 0

    def mismatch(self, sig: dict[str, Any], wire: str, count: int) -> str | None:
        """Why a push of ``sig``, ``wire`` and ``count`` elements does not fit this entry, or None."""
        if sig != self.sig or wire != self.wire or count != self.value.size:
            return (f"stored as {describe_signature(self.sig)}, {self.value.size} x {self.wire} (rank "
                    f"{self.created_by} created it), pushed as {describe_signature(sig)}, {count} x {wire}")
        return None


class AsyncStore:
    """Every stored partition of one server, by (key, partition)."""

    def __init__(self, max_bytes: int = MAX_STORE_BYTES, max_entries: int = MAX_STORE_ENTRIES) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.entries: dict[tuple[int, int], StoredWeights] = {}
        self.parts: dict[int, set[int]] = {}  # key -> its stored partitions (pruned together)
        self.bytes_by_key: collections.Counter[int] = collections.Counter()
        self.bytes = 0
        self.pushes = 0

    def push(self, rank: int, init: bool, key: int, part: int, name: str, instance: int, sig: dict[str, Any],
             wire: str, data: Any, count: int) -> np.ndarray:
        """Apply member ``rank``'s push (an init, else an add; ``data``: the payload, a buffer or an
        array of ``count`` x ``wire``) and return the stored array after it. StoreRefused says why
        a push is not taken; the store is then as it was."""
        values = np.frombuffer(data, dtype=np.dtype(wire), count=count)
        where = f"tensor {name!r} partition {part}"
        if not np.isfinite(values).all():
            raise StoreRefused("protocol", f"{where}: rank {rank} pushed non-finite values to the stored weights")
        entry = self.entries.get((key, part))
        if init:
            entry = self._init(rank, key, part, name, instance, sig, wire, values, entry)
        elif entry is None:
            raise StoreRefused("protocol", f"{where}: rank {rank} added to stored weights that no rank "
                                           "initialized on this server")
        else:
            self._check(entry, rank, where, instance, sig, wire, count)
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
                total = entry.value + values
            if not np.isfinite(total).all():
                raise StoreRefused("protocol", f"{where}: rank {rank}'s change makes the stored weights non-finite")
            entry.value = total
            entry.adds += 1
        self.pushes += 1
        return entry.value

    def _init(self, rank: int, key: int, part: int, name: str, instance: int, sig: dict[str, Any], wire: str,
              values: np.ndarray, entry: StoredWeights | None) -> StoredWeights:
        if entry is not None and entry.instance >= instance:
            self._check(entry, rank, f"tensor {name!r} partition {part}", instance, sig, wire, values.size)
            return entry  # another rank created it: this one gets the stored weights
        if entry is not None or key in self.parts:
            self._prune(key, instance)  # a new instance of the name: the old one goes, every partition
        nbytes = values.nbytes
        if len(self.entries) >= self.max_entries:
            raise StoreRefused("protocol", f"tensor {name!r}: this server stores {len(self.entries)} partitions "
                                           "for asynchronous training already, the most it keeps")
        if self.bytes + nbytes > self.max_bytes:
            raise StoreRefused("protocol", f"tensor {name!r}: this server stores {self.bytes} bytes for "
                                           f"asynchronous training; {nbytes} more would pass its {self.max_bytes}")
        entry = StoredWeights(name, instance, sig, wire, values.copy(), rank)
        self.entries[(key, part)] = entry
        self.parts.setdefault(key, set()).add(part)
        self.bytes_by_key[key] += nbytes
        self.bytes += nbytes
        return entry

    @staticmethod
    def _check(entry: StoredWeights, rank: int, where: str, instance: int, sig: dict[str, Any], wire: str,
               count: int) -> None:
        if instance != entry.instance:
            raise StoreRefused("mismatch", f"{where}: rank {rank} pushed to instance {instance} of the stored "
                                           f"weights, the server holds instance {entry.instance}")
        why = entry.mismatch(sig, wire, count)
        if why is not None:
            raise StoreRefused("mismatch", f"{where}: rank {rank}'s push does not match the stored weights: {why}")

    def _prune(self, key: int, below: int) -> None:
        """Drop every stored partition of ``key`` older than instance ``below``."""
        for part in list(self.parts.get(key, ())):
            entry = self.entries[(key, part)]
            if entry.instance < below:
                del self.entries[(key, part)]
                self.parts[key].discard(part)
                self.bytes_by_key[key] -= entry.value.nbytes
                self.bytes -= entry.value.nbytes
        if not self.parts.get(key):
            self.parts.pop(key, None)
            self.bytes_by_key.pop(key, None)

    def clear(self) -> None:
        """Forget everything (the server closes)."""
        self.entries.clear()
        self.parts.clear()
        self.bytes_by_key.clear()
        self.bytes = 0
