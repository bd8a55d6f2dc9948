"""BytePS's communication trace: BYTEPS_TRACE_ON=1 writes <dir>/<local_rank>/comm.json.

The file is Chrome's trace-event format, as BytePS writes it (``{"traceEvents": [...],
"displayTimeUnit": "ms"}``; chrome://tracing and Perfetto open it). For each traced
push_pull one process row ``Comm.<tensor>`` holds a ``total`` event (submitted to
finished) and, per partition (``tid`` = the partition's number), the stages ours has:

- COMPRESS: momentum, error feedback and compression on the worker (compressed tensors);
- QUEUE: waiting for its turn (priority, credit) on the worker;
- PUSH_PULL: sent to the server until the sum (or the merged compressed sum) is back;
  the server's summation is inside it;
- DECOMPRESS: the merged result decompressed (compressed tensors; whole tensor).

Gossip rounds are traced too, one row ``Comm.gossip.<tag>`` (``gossip.trainer`` for
DistributedTrainer) with a ``total`` event per round and its stages: SEND (the shares
scaled and handed over) and MIX (waiting for the peers' shares and adding them); a round is a
step, counted like a tensor's push_pulls. Compressed gossip has the ``total`` event only.

A tensor's steps are its push_pulls, counted from 1: BYTEPS_TRACE_START_STEP (default
10) to BYTEPS_TRACE_END_STEP (default 20) are traced. DistributedTrainer's start broadcast is
step 1 of each ``parameter_<name>`` (once per parameter), so START_STEP=2 leaves it out. The file is written when a tensor
finishes its last traced step and again at shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator


def now_us() -> float:
    """Microseconds since the epoch, the trace's time base."""
    return time.time() * 1e6


class Tracer:
    """Collects trace events from the API and engine threads; writes them as comm.json."""

    def __init__(self, directory: str, local_rank: int, start: int, end: int) -> None:
        self.path = Path(directory) / str(local_rank) / "comm.json"
        self.start, self.end = start, end
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def traced(self, seq: int) -> bool:
        """Whether a tensor's push_pull number ``seq`` (from 0) is in the traced steps."""
        return self.start <= seq + 1 <= self.end

    def event(self, tensor: str, stage: str, tid: str | int, begin: float, finish: float) -> None:
        """One complete ('X') event of ``stage`` from ``begin`` to ``finish`` (microseconds)."""
        row = f"Comm.{tensor}"
        with self.lock:
            self.events.append({"name": row if stage == "total" else f"{row}.{stage}", "ph": "X",
                                "ts": begin, "dur": max(0.0, finish - begin), "pid": row, "tid": tid,
                                "cat": "Comm", "args": {"name": row}})

    @contextlib.contextmanager
    def span(self, tensor: str, stage: str, tid: str | int = "total") -> Iterator[None]:
        """An event of ``stage`` around the ``with`` block."""
        begin = now_us()
        try:
            yield
        finally:
            self.event(tensor, stage, tid, begin, now_us())

    def finished(self, seq: int) -> None:
        """A traced push_pull finished: write the file after a tensor's last traced step."""
        if seq + 1 == self.end:
            self.write()

    def write(self) -> None:
        """Write what was collected (atomically: a reader never sees half a file)."""
        with self.lock:
            if not self.events:
                return
            body = json.dumps({"traceEvents": sorted(self.events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".json.{os.getpid()}.tmp")
        partial.write_text(body)
        os.replace(partial, self.path)
