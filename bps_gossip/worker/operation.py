"""One push_pull in flight, as the engine's server links see it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..futures import Future
from ..transport.shm import OwnedSegment, SegmentPool
from .server_choice import server_of


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same items in the same memory (an in-place push_pull)."""
    return (a.dtype == b.dtype and a.size == b.size
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


@dataclasses.dataclass(eq=False)
class Operation:
    """What to send, where the sum goes, and what is left (see worker.server_links)."""

    future: Future
    name: str
    key: int
    seq: int
    sig: dict[str, Any]
    send: np.ndarray  # flat, contiguous, wire dtype
    out: np.ndarray  # flat view of the result, wire dtype
    result: Any  # what the future returns
    parts: list[tuple[int, int]]
    priority: int
    finish: Callable[[], None] | None = None  # run on the engine thread after the last partition
    remaining: int = 0
    failed: bool = False
    deadline: float = 0.0
    reqs: set[int] = dataclasses.field(default_factory=set)
    segment: OwnedSegment | None = None  # holds a copy of `send` for servers on this host
    segment_base: int = 0  # byte offset of `send` in `segment` (a leased segment: `send` lies in it)
    leased: bool = False  # `segment` is memory the caller holds (SegmentPool.lease): no copies, not released
    codecs: list[dict[str, Any]] | None = None  # compressed: each partition's codec, for the server
    out_parts: list[tuple[int, int]] | None = None  # where each partition's reply goes in `out`, if not `parts`
    traced: bool = False  # BYTEPS_TRACE_ON and a traced step: stamps[part] is when its stage began
    submitted: float = 0.0
    stamps: dict[int, float] = dataclasses.field(default_factory=dict)
    host_rounds: dict[int, Any] | None = None  # a host leader: its partitions' host rounds (worker.host_reduce)
    rows: bool = False  # gather_rows: one row per worker, each kept by the server from its own sender
    root: int | None = None  # a broadcast's root: the server takes only its payload
    store: str | None = None  # asynchronous training: 'init' or 'add' to the servers' stored weights
    instance: int = 0  # which stored weights of the name (bps_gossip.server.async_store)

    def stage_in(self, segments: SegmentPool) -> None:
        """Put the payload in shared memory: sent in place from a leased buffer that is also the
        output, else copied into a segment of ``segments``."""
        lease = segments.leased(self.send)
        if lease is not None and same_memory(self.send, self.out):
            self.segment, self.segment_base = lease
            self.leased = True
            return
        self.segment = segments.acquire(self.name, self.send.nbytes)
        if self.send.size:
            self.segment.view(self.send.dtype, self.send.size)[:] = self.send

    def region(self, offset: int, count: int) -> np.ndarray:
        """The shared-memory view of ``count`` items of the payload from item ``offset``."""
        itemsize = self.send.dtype.itemsize
        return self.segment.view(self.send.dtype, count, self.segment_base + offset * itemsize)

    def payload(self, offset: int, count: int) -> np.ndarray:
        """``count`` items of what this worker pushes from item ``offset``: from its segment once it
        has one (a host leader's sum is there, not in ``send``), else from ``send``."""
        return self.send[offset:offset + count] if self.segment is None else self.region(offset, count)

    def in_segment(self, offset: int) -> dict[str, Any] | None:
        """The header fields that name the payload from item ``offset`` in this worker's segment
        (for a destination that reads shared memory), or None without a segment."""
        if self.segment is None:
            return None
        return {"shm": self.segment.name, "offset": self.segment_base + offset * self.send.dtype.itemsize}

    def servers(self, nservers: int) -> set[int]:
        """The servers this operation's partitions go to (worker.server_choice)."""
        return {server_of(self.key, index, nservers) for index in range(len(self.parts))}
