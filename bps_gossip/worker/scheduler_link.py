"""The worker's link to the scheduler: registration, address books, heartbeats, barriers,
commit checks, notices and leaving. It owns the worker's one socket to the scheduler and
runs on the engine thread.

What the scheduler announces that concerns other parts of the worker (a new address book,
a node lost or gone, a generation that ended, a job that failed or was refused) goes to a
:class:`Listener` (the engine), which tells the server links and the peer endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Protocol

import zmq

from ..config import Config
from ..errors import BpsGossipError, JobEndedError, JobFailedError, PeerLostError
from ..futures import Future, complete, fail
from ..host_groups import same_host
from ..local_processes import start_ticks
from ..protocol import (
    AddressBook,
    Barrier,
    BarrierDone,
    BarrierFailed,
    BookEntry,
    Bye,
    Changed,
    Commit,
    CommitDone,
    Finished,
    HbAck,
    Heartbeat,
    JobFailed,
    JobOver,
    Leave,
    NodeLeft,
    NodeLost,
    Refused,
    Register,
    Rejoin,
    Stalled,
    Terminate,
    Wait,
    decode,
    handlers,
    send,
)
from ..rendezvous import join
from ..transport import recv_message
from ..transport.receive import MALFORMED, DropLog, drain
from ..transport.sockets import SocketRole, open_socket

CRASHED_LEAVE_WAIT = 0.5  # seconds a crashing worker waits for the scheduler's Bye


@dataclasses.dataclass(frozen=True)
class Book:
    """The address book: what the scheduler told this worker at rendezvous."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    generation: int
    servers: list[str]
    workers: list[BookEntry]  # in rank order
    restore: bool = False  # elastic: roll back to the last commit (something crashed)

    def same_host(self, rank: int) -> bool:
        """Whether worker ``rank`` runs on this worker's machine (its gossip endpoint's host)."""
        return same_host(self.workers[rank], self.workers[self.rank])

    @classmethod
    def of(cls, book: AddressBook) -> Book:
        """This worker's view of a (validated) address book message."""
        me = book.workers[book.rank]
        return cls(rank=book.rank, size=len(book.workers), local_rank=me.local_rank, local_size=me.local_size,
                   generation=book.generation, servers=list(book.servers),
                   workers=list(book.workers), restore=book.restore)


class Listener(Protocol):
    """What the scheduler link tells the rest of the worker (the engine implements it)."""

    def on_book(self, book: Book) -> None: ...
    def on_node_gone(self, role: str, rank: int, lost: bool, why: str) -> None: ...
    def on_changed(self, generation: int, why: str, restore: bool) -> None: ...
    def on_broken(self, error: BpsGossipError) -> None: ...


class SchedulerLink:
    """The DEALER to the scheduler and everything said over it (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, config: Config, uid: bytes, log: logging.Logger,
                 listener: Listener | None = None) -> None:
        self.config = config
        self.log = log
        self.sock = open_socket(ctx, SocketRole.TO_SCHEDULER, config, uid)
        self.listener = listener
        self.book: Book | None = None
        self.last_heard = time.monotonic()
        self.silent = False  # the scheduler stopped answering: leaving does not wait for it
        self._next_beat = 0.0
        self._barriers: dict[int, Future] = {}
        self._barrier_seq = 0
        self._commits: dict[int, Future] = {}
        self._commit_seq = 0
        self._drops = DropLog(log, "message from the scheduler")
        table = {
            HbAck: self._on_nothing, Wait: self._on_nothing, Bye: self._on_nothing, Terminate: self._on_nothing,
            BarrierDone: self._on_barrier_done, BarrierFailed: self._on_barrier_failed,
            CommitDone: self._on_commit_done, NodeLost: self._on_node_lost, NodeLeft: self._on_node_left,
            Changed: self._on_changed, AddressBook: self._on_book, Refused: self._on_refused,
            JobFailed: self._on_job_failed, JobOver: self._on_job_over,
        }
        self._handlers = handlers({cls: self._heard(handle) for cls, handle in table.items()})

    # -- registration ---------------------------------------------------------------
    def register(self, peer_addr: str, host_reduce: str) -> tuple[Book, bool]:
        """Register and wait to be admitted (bps_gossip.rendezvous); return the address book and
        whether this worker started with the job (False: it joined a running elastic job and
        has no state yet). ``host_reduce``: its BPS_GOSSIP_HOST_REDUCE ("off" if it cannot)."""
        cfg = self.config
        me = Register(role="worker", host=cfg.node_host, pid=os.getpid(), start_ticks=start_ticks(),
                      worker_id=cfg.worker_id, local_rank=cfg.local_rank, local_size=cfg.local_size,
                      peer_addr=peer_addr, num_worker=cfg.num_worker, num_server=cfg.num_server,
                      host_reduce=host_reduce)
        admitted = join(self.sock, me, cfg, f"worker pid {os.getpid()}", self.log)
        self.book = Book.of(admitted.book)
        self.last_heard = time.monotonic()
        return self.book, not admitted.waited

    # -- engine loop ----------------------------------------------------------------
    def tick(self, now: float, progress: int) -> bool:
        """Heart-beat when it is time, with the count of operations training started so far;
        True when it was (the caller checks deadlines then)."""
        if now < self._next_beat:
            return False
        send(self.sock, Heartbeat(progress=progress))
        self._next_beat = now + self.config.heartbeat_interval
        return True

    def seconds_to_beat(self, now: float) -> float:
        """How long the loop may sleep before the next heartbeat is due."""
        return max(0.0, self._next_beat - now)

    def drain(self) -> None:
        """Handle what the scheduler sent (bounded, so a backlog never delays a heartbeat for long)."""
        drain(self.sock, False, self._handlers, self._drops, 1024)

    def silence(self, now: float) -> PeerLostError | None:
        """The error to fail everything with once the scheduler is silent for too long."""
        silent = now - self.last_heard
        if silent <= self.config.heartbeat_timeout:
            return None
        self.silent = True
        rank = self.book.rank if self.book is not None else -1
        return PeerLostError(f"the scheduler at {self.config.scheduler_address} stopped answering "
                             f"({silent:.1f} s without a message) [on rank {rank}]")

    # -- requests -------------------------------------------------------------------
    def barrier(self, future: Future) -> None:
        """Ask for a barrier; ``future`` completes when every worker is in."""
        self._barrier_seq += 1
        self._barriers[self._barrier_seq] = future
        send(self.sock, Barrier(seq=self._barrier_seq))

    def commit(self, future: Future) -> None:
        """Elastic commit check; ``future`` completes with True when workers wait to join."""
        self._commit_seq += 1
        self._commits[self._commit_seq] = future
        send(self.sock, Commit(seq=self._commit_seq))

    def rejoin(self, generation: int, has_state: bool) -> None:
        """Elastic: ask to join generation ``generation``."""
        send(self.sock, Rejoin(generation=generation, has_state=has_state))

    def finished(self) -> None:
        """Elastic: this worker finished training."""
        send(self.sock, Finished())

    def stalled(self, ranks: list[int], why: str) -> None:
        """Elastic: report ranks this worker has waited on for too long."""
        send(self.sock, Stalled(ranks=ranks, generation=self.book.generation, why=why))

    def leave(self, crashed: bool) -> None:
        """Say goodbye and wait briefly for the answer (not at all if the scheduler went silent)."""
        send(self.sock, Leave(crashed=crashed))
        # A crash (an uncaught exception, Ctrl-C) waits briefly: the Leave is sent either way, and
        # on Ctrl-C the scheduler is being stopped too, so a Bye rarely comes (the worker lived on
        # until bpslaunch SIGKILLed it at 3 s).
        wait = CRASHED_LEAVE_WAIT if crashed else 5.0
        deadline = time.monotonic() + (0.0 if self.silent else min(wait, self.config.timeout))
        while time.monotonic() < deadline and self.sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
            _, header, _ = recv_message(self.sock, routed=False)
            try:
                if isinstance(decode(header), (Bye, Refused)):
                    return
            except MALFORMED:
                continue

    def fail_waits(self, error: BaseException) -> None:
        """Fail the barriers and commit checks the scheduler has not answered."""
        for future in [*self._barriers.values(), *self._commits.values()]:
            fail(future, error)
        self._barriers.clear()
        self._commits.clear()

    def new_generation(self) -> None:
        """Barriers and commits are numbered from 1 again in a new generation."""
        self._barrier_seq = 0
        self._commit_seq = 0
        self.last_heard = time.monotonic()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close(linger=0)

    # -- what the scheduler says ----------------------------------------------------
    def _rank(self) -> int:
        return self.book.rank if self.book is not None else -1

    def _heard(self, handle: Any) -> Any:
        """``handle`` after noting that the scheduler is alive (any message shows it)."""
        def entry(route: Any, msg: Any, frames: list[zmq.Frame]) -> None:
            self.last_heard = time.monotonic()
            handle(route, msg, frames)
        return entry

    def _on_nothing(self, _route: Any, _msg: Any, _frames: list[zmq.Frame]) -> None:
        pass  # only shows that the scheduler is there

    def _on_barrier_done(self, _route: Any, msg: BarrierDone, _frames: list[zmq.Frame]) -> None:
        complete(self._barriers.pop(msg.seq, None), None)

    def _on_barrier_failed(self, _route: Any, msg: BarrierFailed, _frames: list[zmq.Frame]) -> None:
        fail(self._barriers.pop(msg.seq, None), PeerLostError(f"barrier: {msg.why} [on rank {self._rank()}]"))

    def _on_commit_done(self, _route: Any, msg: CommitDone, _frames: list[zmq.Frame]) -> None:
        complete(self._commits.pop(msg.seq, None), msg.changed)

    def _on_node_lost(self, _route: Any, msg: NodeLost, _frames: list[zmq.Frame]) -> None:
        self._node_gone(msg, lost=True)

    def _on_node_left(self, _route: Any, msg: NodeLeft, _frames: list[zmq.Frame]) -> None:
        self._node_gone(msg, lost=False)

    def _node_gone(self, msg: NodeLost | NodeLeft, lost: bool) -> None:
        why = msg.describe("was lost" if lost else "left the job")
        # A graceful leave is normal at the end of a job; only a loss deserves a warning.
        self.log.log(logging.WARNING if lost else logging.INFO, why)
        self.listener.on_node_gone(msg.role, msg.rank, lost, why)

    def _on_changed(self, _route: Any, msg: Changed, _frames: list[zmq.Frame]) -> None:
        self.listener.on_changed(msg.generation, msg.why, msg.restore)

    def _on_book(self, _route: Any, msg: AddressBook, _frames: list[zmq.Frame]) -> None:
        self.book = Book.of(msg)
        self.new_generation()
        self.listener.on_book(self.book)

    def _on_refused(self, _route: Any, msg: Refused, _frames: list[zmq.Frame]) -> None:
        self.listener.on_broken(PeerLostError(f"the scheduler no longer knows this worker: {msg.why}"))

    def _on_job_failed(self, _route: Any, msg: JobFailed, _frames: list[zmq.Frame]) -> None:
        self.listener.on_broken(JobFailedError(f"the elastic job failed: {msg.why} [on rank {self._rank()}]"))

    def _on_job_over(self, _route: Any, msg: JobOver, _frames: list[zmq.Frame]) -> None:
        self.listener.on_broken(JobEndedError(f"the job finished before this worker got its state ({msg.why})"))
