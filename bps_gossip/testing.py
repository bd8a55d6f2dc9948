"""A running worker's insides, for tests and tools that must look at them or act as a member.

Not the training API: what these return is the engine's own state and may change with it.
Each raises NotInitializedError outside a job (after ``init()``, before ``shutdown()``).
"""

from __future__ import annotations

from . import runtime
from .errors import NotInitializedError
from .transport.shm import SegmentPool
from .worker.engine import Engine
from .worker.host_reduce import HostLink
from .worker.scheduler_link import Book
from .worker.server_links import ServerLinks


def engine(where: str = "bps_gossip.testing") -> Engine:
    """This worker's engine (its thread, sockets and parts); NotInitializedError alone or outside a job."""
    found = runtime.current(where).engine
    if found is None:
        raise NotInitializedError(f"{where}: this worker runs alone (no job, no engine)")
    return found


def address_book() -> Book:
    """The address book of this worker's generation."""
    return engine("address_book()").book


def server_links() -> ServerLinks:
    """The engine's links to the servers (their sockets, routes and what is in flight)."""
    return engine("server_links()").servers


def host_link() -> HostLink:
    """Where this worker's partitions go when the job reduces by host (its group, its leader)."""
    return engine("host_link()").servers.hosts


def segment_pool() -> SegmentPool | None:
    """This worker's shared-memory segments (None where shared memory is off)."""
    return engine("segment_pool()").segments
