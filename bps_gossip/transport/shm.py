"""POSIX shared memory for payloads between processes on the same host.

A worker owns its segments (one per tensor name and in-flight operation, reused from
round to round); a server attaches to them by name. Only small control messages go
over ZeroMQ: the server reads every worker's region, sums in place and writes the sum
back into each region, so a push_pull costs each worker one copy in and one copy out.

Cleanup on every exit path, without Python's resource tracker: the owner unlinks at
shutdown (and at exit). Names carry the job's prefix and the owner's pid, so what a
killed owner leaves is removed by whoever sees it die on this host: the process that
started it (bpslaunch's supervisor, or bps_gossip.launch.remote on an ssh host) as soon as it
exits, the scheduler (a lost worker on its host), and bpslaunch again at the end of a
job. No segment is on the resource tracker: the tracker would unlink a killed owner's
segments too, but it reports each as "leaked shared_memory objects", which reads as a
leak on every elastic restart; and an attaching process must not let its tracker unlink
what it does not own (NOTES: Python 3.11 otherwise unlinks on exit).
"""

from __future__ import annotations

import _posixshmem
import ctypes
import functools
import os
import threading
import uuid
from collections.abc import Mapping
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProtocolError

PREFIX = "bpsg"
SHM_DIR = Path("/dev/shm")


def segment_name(job: str) -> str:
    """A fresh segment name: prefix, job id, owner pid, random suffix."""
    return f"{PREFIX}_{job}_{os.getpid()}_{uuid.uuid4().hex[:10]}"


def _start_tracker_here() -> None:
    """Start this process's resource tracker now, from the thread that sets up a pool.

    SharedMemory registers every segment with the tracker (we take it off again at once),
    and the first registration starts the tracker process. Started later from one of
    MXNet's custom-operator threads (a push_pull inside the engine), that fork runs MXNet's
    fork handlers there, which join the engine's threads from one of them and abort the
    process ("Resource deadlock avoided") on Python 3.8 and 3.9, which fork without vfork."""
    resource_tracker.ensure_running()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Take a segment off this process's resource tracker (see the module docstring)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001


@functools.lru_cache(maxsize=4096)  # a server asks for every push; names come from workers: bounded
def owner_pid(name: str) -> int | None:
    """The owner's pid written into a segment name by :func:`segment_name`, or None."""
    parts = name.split("_")
    if len(parts) != 4 or parts[0] != PREFIX or not parts[2].isdigit() or len(parts[2]) > 10:
        return None
    return int(parts[2])


class OwnedSegment:
    """A segment this process created; unlink() removes it for everyone."""

    def __init__(self, job: str, size: int) -> None:
        self.shm = shared_memory.SharedMemory(name=segment_name(job), create=True, size=max(size, 1))
        _untrack(self.shm)
        self.name = self.shm.name
        self.size = size

    def view(self, dtype: np.dtype, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view of ``count`` items at byte ``offset``."""
        return np.ndarray((count,), dtype=dtype, buffer=self.shm.buf, offset=offset)

    def unlink(self, keep_mapping: bool = False) -> None:
        """Close and remove the segment (safe to call twice); ``keep_mapping``: remove the name
        only, the memory stays mapped here (arrays outside Python's knowledge point into it)."""
        if self.shm is None:
            return
        try:
            if not keep_mapping:
                self.shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        try:
            # Not SharedMemory.unlink(): it would tell the tracker about a name it never had.
            _posixshmem.shm_unlink(self.shm._name)  # noqa: SLF001
        except FileNotFoundError:
            pass
        self.shm = None


class AttachedSegment:
    """A segment another process owns, mapped here; never unlinked from here."""

    def __init__(self, name: str) -> None:
        if not name.startswith(PREFIX + "_") or "/" in name:
            raise ValueError(f"not a bps_gossip segment name: {name!r}")
        self.shm = shared_memory.SharedMemory(name=name, create=False)
        _untrack(self.shm)  # this process's exit must never unlink the owner's segment
        owner = os.fstat(self.shm._fd).st_uid  # noqa: SLF001
        if owner != os.getuid():  # another user's segment that happens to be readable
            self.shm.close()
            raise ValueError(f"segment {name!r} belongs to user {owner}, not to this job's user")
        self.name = name
        self.size = self.shm.size

    def view(self, dtype: np.dtype, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view of ``count`` items at byte ``offset``; ValueError if it does not fit."""
        dtype = np.dtype(dtype)
        if offset < 0 or count < 0 or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"segment {self.name}: {count} x {dtype} at {offset} exceeds {self.size} bytes")
        return np.ndarray((count,), dtype=dtype, buffer=self.shm.buf, offset=offset)

    def close(self) -> None:
        """Unmap (the owner keeps the segment)."""
        try:
            self.shm.close()
        except BufferError:
            pass


class AttachedSegments:
    """Segments of other processes mapped here, at most ``limit`` at once (the oldest is
    unmapped first), each attached on first use."""

    def __init__(self, limit: int) -> None:
        _start_tracker_here()
        self.limit = limit
        self._segments: dict[str, AttachedSegment] = {}

    def view(self, name: str, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        """A view of ``count`` items at byte ``offset`` of segment ``name``; ValueError or
        OSError if the name is not a segment of ours or the view does not fit."""
        segment = self._segments.get(name)
        if segment is None:
            if len(self._segments) >= self.limit:
                self._segments.pop(next(iter(self._segments))).close()
            segment = self._segments[name] = AttachedSegment(name)
        return segment.view(dtype, count, offset)

    def owned_view(self, sender: str, pid: int, name: str, dtype: Any, count: int, offset: int) -> np.ndarray:
        """:meth:`view` of segment ``name`` if process ``pid`` (``sender``, as error messages name
        it) owns it: a message may name only its sender's own memory. ProtocolError otherwise."""
        if owner_pid(name) != pid:
            raise ProtocolError(f"{sender} named segment {name!r}, which is not its own")
        return self.view(name, dtype, count, offset)

    def close(self) -> None:
        """Unmap every segment."""
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


def sweep(job: str | None = None, pid: int | None = None) -> int:
    """Remove leftover segments of ``job`` (all of it, or one owner ``pid``); return how many."""
    pattern = f"{PREFIX}_{job or '*'}_{pid if pid is not None else '*'}_*"
    removed = 0
    try:
        for path in SHM_DIR.glob(pattern):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    except OSError:  # no descriptor left to list the directory: the next sweep (or bpslaunch's) does it
        pass
    return removed


def sweep_after(pid: int, env: Mapping[str, str]) -> int:
    """Remove what the process ``pid`` left of the job its environment names (DMLC_PS_ROOT_PORT);
    for whoever started a worker and saw it exit, killed or not. Returns how many."""
    port = env.get("DMLC_PS_ROOT_PORT", "")
    return sweep(port, pid) if port.isdigit() else 0


def shm_available() -> bool:
    """True where POSIX shared memory works (Linux: /dev/shm exists)."""
    return SHM_DIR.is_dir()


class SegmentPool:
    """A worker's segments, reused per tensor name; thread-safe (API threads acquire,
    the engine thread releases).

    A segment can also be leased: it becomes memory its holder keeps (MXNet gradients made
    over it, see bps_gossip.shared_buffer), and a push_pull whose payload lies in it sends
    and receives in place, without a copy in or out (:meth:`leased`). Its mapping is never
    closed in this process (the holder's arrays point into it); a lease ends with the pool
    or when an operation on it fails (a server's late write must not land in memory that is
    in use again: :meth:`revoke`), after which push_pulls from it copy as from any memory.
    """

    def __init__(self, job: str) -> None:
        _start_tracker_here()
        self.job = job
        self._free: dict[str, list[OwnedSegment]] = {}
        self._all: set[OwnedSegment] = set()
        self._leases: dict[int, tuple[int, OwnedSegment]] = {}  # start address -> (end address, segment)
        self._leased: set[OwnedSegment] = set()  # every segment ever leased: never unmapped
        self._lock = threading.Lock()

    def lease(self, nbytes: int) -> np.ndarray:
        """A new segment of ``nbytes`` as a uint8 array that stays mapped for the process's life."""
        segment = OwnedSegment(self.job, nbytes)
        memory = segment.view(np.dtype(np.uint8), nbytes)
        # Never unmapped, even when the pool or the interpreter goes: MXNet arrays made over it
        # are freed at times of MXNet's choosing and may still be written to until then.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(segment.shm))
        start = memory.__array_interface__["data"][0]
        with self._lock:
            self._leased.add(segment)
            self._leases[start] = (start + nbytes, segment)
        return memory

    def leased(self, array: np.ndarray) -> tuple[OwnedSegment, int] | None:
        """The leased segment ``array``'s memory lies in, and the byte offset it starts at, or None."""
        if not self._leases or not array.size or not array.flags.c_contiguous:
            return None
        start = array.__array_interface__["data"][0]
        end = start + array.nbytes
        with self._lock:
            for base, (limit, segment) in self._leases.items():
                if base <= start and end <= limit:
                    return segment, start - base
        return None

    def revoke(self, segment: OwnedSegment) -> None:
        """End a lease: the segment's name goes (no server attaches to it again); the memory stays."""
        with self._lock:
            self._leases = {base: entry for base, entry in self._leases.items() if entry[1] is not segment}
        segment.unlink(keep_mapping=True)

    def acquire(self, name: str, nbytes: int) -> OwnedSegment:
        """A segment of at least ``nbytes`` not used by any pending operation."""
        with self._lock:
            free = self._free.get(name, [])
            for index, segment in enumerate(free):
                if segment.size >= nbytes:
                    return free.pop(index)
        segment = OwnedSegment(self.job, nbytes)
        with self._lock:
            self._all.add(segment)
        return segment

    def staged_names(self) -> list[str]:
        """The names of the tensors whose payloads were copied into one of this pool's segments
        (kept for reuse): what a test asks to see that nothing was copied."""
        with self._lock:
            return sorted(self._free)

    def release(self, name: str, segment: OwnedSegment, reusable: bool = True) -> None:
        """Give a segment back; a failed operation's segment is removed instead (a late
        write from a server must never land in a segment that found a new use)."""
        with self._lock:
            if reusable:
                self._free.setdefault(name, []).append(segment)
                return
            self._all.discard(segment)
        segment.unlink()

    def close(self) -> None:
        """Unlink every segment."""
        with self._lock:
            segments, self._all, self._free, self._leases = self._all, set(), {}, {}
            leased = list(self._leased)
        for segment in segments:
            segment.unlink()
        for segment in leased:
            segment.unlink(keep_mapping=True)
