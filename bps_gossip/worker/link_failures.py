"""How the worker's server links fail operations: one at a time, all at once, when a server or a
worker goes, and when servers say nothing for too long. A part of
:class:`~bps_gossip.worker.server_links.ServerLinks` (its state, its thread and lock)."""

from __future__ import annotations

import heapq
import math
from typing import Any

from ..errors import CommTimeoutError, PeerLostError
from ..futures import fail
from .operation import Operation

LEADER = -1  # the target of a local's pushes: its host leader, not a server


class LinkFailures:
    """The failure paths of ServerLinks, which provides every attribute used here."""

    pending: set[Operation]
    hosts: Any
    segments: Any
    sockets: list[Any]
    addresses: list[str]
    config: Any
    rank: int
    _reqs: dict[int, tuple[Operation, int, int]]
    _heap: list[Any]
    _unacked: dict[int, int]
    _stats: dict[int, Any]
    _lost: dict[int, str]
    _heard: dict[int, float]
    read_leader: Any

    def op_timeout(self) -> float:
        """How long an operation may wait for a server that says nothing at all. Servers
        report rounds that stay incomplete after BPS_GOSSIP_TIMEOUT with the missing ranks;
        this backstop only fires when a server itself does not answer."""
        return self.config.timeout + 2 * self.config.heartbeat_interval + 1.0

    def fail_op(self, op: Operation, error: BaseException) -> None:
        """Fail one operation; its shared-memory segment is never reused (a late write)."""
        op.failed = True
        self.pending.discard(op)
        if op.host_rounds and self.hosts.rounds is not None:
            self.hosts.rounds.op_failed(op, error)
        if op.leased:
            self.segments.revoke(op.segment)
        elif op.segment is not None:
            self.segments.release(op.name, op.segment, reusable=False)
        op.segment = None
        for req in op.reqs:
            self._reqs.pop(req, None)
        op.reqs.clear()
        fail(op.future, error)

    def fail_all(self, error: BaseException, keep_stores: bool = False) -> None:
        """Fail every operation in flight or queued, and every stats request. ``keep_stores``: an
        elastic change that rolls nothing back leaves the stored-weights operations (asynchronous
        training) alone: they wait for no other worker, so a worker that left changes nothing for them."""
        for op in list(self.pending):
            if not (keep_stores and op.store is not None):
                self.fail_op(op, error)
        self._heap[:] = [entry for entry in self._heap if entry[2] in self.pending]
        heapq.heapify(self._heap)
        for req in [req for req, (op, _, _) in self._reqs.items() if op not in self.pending]:
            del self._reqs[req]
        for req in [req for req in self._unacked if req not in self._reqs]:
            del self._unacked[req]
        self.fail_stats(error)

    def fail_stats(self, error: BaseException) -> None:
        """Fail the stats requests not yet answered."""
        for future, _ in self._stats.values():
            fail(future, error)
        self._stats.clear()

    def server_gone(self, index: int, why: str) -> None:
        """Server ``index`` was lost or left: fail what needs it, send it nothing more."""
        self._lost[index] = why
        for req, server in list(self._unacked.items()):
            if server == index:
                del self._unacked[req]
        nservers = len(self.sockets)
        for op in list(self.pending):
            if index in op.servers(nservers):
                self.fail_op(op, PeerLostError(f"push_pull {op.name!r}: {why}"))

    def worker_gone(self, rank: int, lost: bool, why: str) -> None:
        """A worker was lost or left: what waits on it through this host fails, once what it
        answered before it went was read (a mismatch it found is the error to report, and its
        reply may wait behind the scheduler's word of its exit)."""
        if rank == self.hosts.leader and self.hosts.sock is not None:
            self.read_leader()
        self.hosts.worker_gone(rank, lost, why)

    def check_deadlines(self, now: float) -> None:
        """Fail operations whose servers (or host leader) said nothing for too long."""
        self.hosts.expire(now)
        limit = self.op_timeout()
        for op in list(self.pending):
            if now <= op.deadline:
                continue
            servers = sorted({self._reqs[r][2] for r in op.reqs if r in self._reqs})
            # A server that keeps answering is busy (a backlog of partitions), not gone:
            # wait while the servers this op waits on (any, if it is still queued) speak.
            watched = servers or range(len(self.sockets))
            if any(now - self._heard.get(s, -math.inf) < limit for s in watched):
                continue
            addrs = [self.addresses[s] if s != LEADER else f"host leader rank {self.hosts.leader}" for s in servers]
            waiting = f"servers {servers} ({', '.join(addrs)})" if servers else "its turn to be sent"
            self.fail_op(op, CommTimeoutError(
                f"push_pull {op.name!r} on rank {self.rank}: no answer from {waiting} "
                f"within {limit:.1f} s (BPS_GOSSIP_TIMEOUT={self.config.timeout})"))
