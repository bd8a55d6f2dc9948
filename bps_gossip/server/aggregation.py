"""The server's aggregation rounds: one buffer per (key, partition, round number).

The first push of a round fixes its signature (dtype, full shape, operation) and its
byte size; a push that disagrees fails the round for every participant with a
message naming the tensor, the ranks and both signatures. Summation itself is
plain numpy (it releases the GIL, so a thread pool runs several at once).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Tuple

import numpy as np

from ..compression import Codec
from ..protocol.data import describe_signature

RoundId = Tuple[int, int, int, int]  # (generation, key, partition, round number)


@dataclasses.dataclass
class Contribution:
    """One worker's push in a round: who (rank, connection), its request id, and where its
    result goes."""

    rank: int
    route: bytes
    req: int
    region: np.ndarray | None = None  # the worker's shared-memory region: the sum goes back there


class Aggregation:
    """Accumulates the pushes of one partition of one tensor for one round."""

    def __init__(
        self, rid: RoundId, name: str, sig: dict[str, Any], wire: str, count: int, expected: int,
        codec: Codec | None = None, merge: tuple[bool, int | None] = (False, None),
    ) -> None:
        self.rid = rid
        self.codec = codec  # compressed pushes: decompressed into a float32 sum, compressed once at the end
        self.merge = merge  # the codec's (error feedback, seed) on the server
        self.expected = expected
        self.name = name
        self.sig = sig
        self.wire = np.dtype(wire)
        self.wire_str = wire  # what a push names: compared as text first (parsing a dtype costs more)
        self.count = count
        self.pushes: dict[int, Contribution] = {}  # by rank
        self.acc: np.ndarray | None = None
        self.acc_in_region = False  # the sum lives in the first pusher's shared-memory region
        self.added = 0
        self.error: str | None = None
        self.lock = threading.Lock()
        self.created = time.monotonic()
        self.stall_reported = False  # elastic: the missing ranks were reported to the scheduler
        self.hosted = False  # pushed by host leaders, one sum per host (bps_gossip.host_groups)
        self.opened_by = -1  # the rank charged for what the server holds for this round, and how much
        self.held = 0
        self.rows = False  # one row per worker (gather_rows): each push keeps only its sender's row
        self.root: int | None = None  # a broadcast's root: every other rank's payload is left out
        self.row = 0  # elements of one row

    def own_row(self, payload: memoryview | bytes | np.ndarray, rank: int) -> memoryview:
        """Of a rows push, only the sender's row (the rest zero): what any one sender writes into
        the others' rows never reaches them."""
        data = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=self.wire, count=self.count)
        kept = np.zeros(self.count, dtype=self.wire)
        span = slice(rank * self.row, (rank + 1) * self.row)
        kept[span] = data[span]
        return memoryview(kept)

    @property
    def nbytes(self) -> int:
        """Bytes of this partition's payload."""
        return self.count * self.wire.itemsize

    def mismatch(self, rank: int, sig: dict[str, Any], wire: str, count: int) -> str | None:
        """The error text if a push from ``rank`` disagrees with the round, else None."""
        if sig == self.sig and count == self.count and (wire == self.wire_str or np.dtype(wire) == self.wire):
            return None
        first = min(self.pushes) if self.pushes else "?"
        return (
            f"tensor {self.name!r}: rank {first} pushed {describe_signature(self.sig)} but rank {rank} "
            f"pushed {describe_signature(sig)}; every rank must push the same shape, dtype and operation"
        )

    def add(self, payload: memoryview | bytes | np.ndarray) -> bool:
        """Add one payload into the accumulator; return True when this was the last one."""
        region = isinstance(payload, np.ndarray)  # a worker's shared-memory region (frames come as buffers)
        data = payload if region else np.frombuffer(payload, dtype=self.wire, count=self.count)
        if self.codec is not None:
            data, region = self.codec.decompress(data), False
        with self.lock:
            if self.acc is None:
                # The first pusher's own region becomes the sum: its worker waits for the result
                # and reads it from there anyway, so no copy (one memory pass less per round).
                self.acc = data if region else data.copy()
                self.acc_in_region = region
            else:
                np.add(self.acc, data, out=self.acc)
            self.added += 1
            return self.added == self.expected

    def skip(self) -> bool:
        """Count a push whose payload is left out (a broadcast's non-root); True when it was the last."""
        with self.lock:
            self.added += 1
            return self.added == self.expected

    def write_back(self) -> None:
        """Copy the sum into the shared-memory region of every worker that pushed through one."""
        for push in self.pushes.values():
            if push.region is not None and self.acc is not None and push.region is not self.acc:
                np.copyto(push.region, self.acc)

