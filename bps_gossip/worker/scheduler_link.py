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

from .. import fields
from ..config import Config
from ..errors import (
    BpsGossipError,
    CommTimeoutError,
    ConfigError,
    JobEndedError,
    JobFailedError,
    PeerLostError,
)
from ..futures import Future, complete, fail
from ..liveness import start_ticks
from ..transport import recv_message, send_message
from ..transport.receive import DropLog, drain
from ..transport.security import HandshakeWatch, make_socket
from ..transport.startup import StartupWait


@dataclasses.dataclass(frozen=True)
class Book:
    """The address book: what the scheduler told this worker at rendezvous."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    generation: int
    servers: list[str]
    workers: list[dict[str, Any]]
    restore: bool = False  # elastic: roll back to the last commit (something crashed)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> Book:
        """The book of a scheduler's ``book`` message."""
        book = msg["book"]
        rank = int(msg["rank"])
        me = book["workers"][rank]
        return cls(rank=rank, size=len(book["workers"]), local_rank=me["local_rank"],
                   local_size=me["local_size"], generation=int(book["generation"]),
                   servers=list(book["servers"]), workers=list(book["workers"]),
                   restore=bool(msg.get("restore", False)))


class Listener(Protocol):
    """What the scheduler link tells the rest of the worker (the engine implements it)."""

    def on_book(self, book: Book) -> None: ...
    def on_node_gone(self, msg: dict[str, Any], lost: bool, why: str) -> None: ...
    def on_changed(self, generation: int, why: str, restore: bool) -> None: ...
    def on_broken(self, error: BpsGossipError) -> None: ...


class SchedulerLink:
    """The DEALER to the scheduler and everything said over it (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, config: Config, uid: bytes, log: logging.Logger) -> None:
        self.config = config
        self.log = log
        self.sock = make_socket(ctx, zmq.DEALER, config.keys, serve=False)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, uid)
        self.listener: Listener | None = None
        self.book: Book | None = None
        self.last_heard = time.monotonic()
        self.silent = False  # the scheduler stopped answering: leaving does not wait for it
        self._next_beat = 0.0
        self._barriers: dict[int, Future] = {}
        self._barrier_seq = 0
        self._commits: dict[int, Future] = {}
        self._commit_seq = 0
        self._drops = DropLog(log, "message from the scheduler")
        self._handlers = {
            "hb_ack": self._on_nothing, "wait": self._on_nothing, "bye": self._on_nothing,
            "terminate": self._on_nothing,
            "barrier_done": self._on_barrier_done, "barrier_failed": self._on_barrier_failed,
            "commit_done": self._on_commit_done, "node_lost": self._on_node_lost, "node_left": self._on_node_left,
            "changed": self._on_changed, "book": self._on_book, "refused": self._on_refused,
            "job_failed": self._on_job_failed, "job_over": self._on_job_over,
        }

    # -- registration ---------------------------------------------------------------
    def register(self, peer_addr: str) -> tuple[Book, bool]:
        """Register and wait to be admitted; return the address book and whether this worker
        started with the job (False: it joined a running elastic job and has no state yet)."""
        cfg = self.config
        watch = HandshakeWatch(self.sock)
        try:
            self.sock.connect(cfg.scheduler_address)
            send_message(self.sock, {
                "op": "register", "role": "worker", "host": cfg.node_host, "pid": os.getpid(),
                "start_ticks": start_ticks(), "worker_id": cfg.worker_id, "local_rank": cfg.local_rank,
                "local_size": cfg.local_size, "peer_addr": peer_addr, "DMLC_NUM_WORKER": cfg.num_worker,
                "DMLC_NUM_SERVER": cfg.num_server,
            })
            msg, joined = self._await_book(watch)
        finally:
            watch.close()
        self.book = Book.from_message(msg)
        self.last_heard = time.monotonic()
        return self.book, not joined

    def _await_book(self, watch: HandshakeWatch) -> tuple[dict[str, Any], bool]:
        """The scheduler may start after this worker, and the rest of the job later still (see
        bps_gossip.transport.startup). An elastic joiner the running job told to wait has
        BPS_GOSSIP_ELASTIC_TIMEOUT + BPS_GOSSIP_TIMEOUT to be admitted."""
        cfg = self.config
        wait = StartupWait(watch, cfg, f"worker pid {os.getpid()}", self.log)
        admit_by: float | None = None
        while True:
            wait.check()
            if admit_by is not None and time.monotonic() > admit_by:
                raise CommTimeoutError(
                    f"worker pid {os.getpid()}: the running job at {cfg.scheduler_address} did not admit "
                    f"this worker within {cfg.elastic_timeout + cfg.timeout:.1f} s (it joins at the next "
                    "commit: does the training loop call state.commit()?)")
            if not self.sock.poll(int(min(cfg.heartbeat_interval, 0.5) * 1000)):
                if wait.connected:  # the scheduler answers; before the connection, they would pile up
                    send_message(self.sock, {"op": "heartbeat"})
                continue
            wait.heard_from()
            _, msg, _ = recv_message(self.sock, routed=False)
            self._refuse_admission(msg)
            if msg["op"] == "wait" and admit_by is None:
                admit_by = time.monotonic() + cfg.elastic_timeout + cfg.timeout
                self.log.info("waiting to join the running job: %s", msg.get("why"))
            if msg["op"] == "book":
                return msg, admit_by is not None

    @staticmethod
    def _refuse_admission(msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "refused":
            raise ConfigError(f"the scheduler refused this worker: {msg.get('why')}")
        if op == "job_failed":
            raise JobFailedError(f"the job failed: {msg.get('why')}")
        if op == "job_over":
            raise JobEndedError(f"the job finished before this worker was admitted ({msg.get('why')})")

    # -- engine loop ----------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Heart-beat when it is time; True when it was (the caller checks deadlines then)."""
        if now < self._next_beat:
            return False
        send_message(self.sock, {"op": "heartbeat"})
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
        send_message(self.sock, {"op": "barrier", "seq": self._barrier_seq})

    def commit(self, future: Future) -> None:
        """Elastic commit check; ``future`` completes with True when workers wait to join."""
        self._commit_seq += 1
        self._commits[self._commit_seq] = future
        send_message(self.sock, {"op": "commit", "seq": self._commit_seq})

    def rejoin(self, generation: int, has_state: bool) -> None:
        """Elastic: ask to join generation ``generation``."""
        send_message(self.sock, {"op": "rejoin", "generation": generation, "has_state": has_state})

    def finished(self) -> None:
        """Elastic: this worker finished training."""
        send_message(self.sock, {"op": "finished"})

    def stalled(self, ranks: list[int], why: str) -> None:
        """Elastic: report ranks this worker has waited on for too long."""
        send_message(self.sock, {"op": "stalled", "ranks": ranks, "generation": self.book.generation, "why": why})

    def leave(self, crashed: bool) -> None:
        """Say goodbye and wait briefly for the answer (not at all if the scheduler went silent)."""
        send_message(self.sock, {"op": "leave", "crashed": crashed})
        deadline = time.monotonic() + (0.0 if self.silent else min(5.0, self.config.timeout))
        while time.monotonic() < deadline and self.sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
            _, msg, _ = recv_message(self.sock, routed=False)
            if msg["op"] in ("bye", "refused"):
                return

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

    def _on_nothing(self, _route: Any, _msg: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        self.last_heard = time.monotonic()

    def _on_barrier_done(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        complete(self._barriers.pop(fields.integer(msg, "seq"), None), None)

    def _on_barrier_failed(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        fail(self._barriers.pop(fields.integer(msg, "seq"), None),
             PeerLostError(f"barrier: {msg.get('why')} [on rank {self._rank()}]"))

    def _on_commit_done(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        complete(self._commits.pop(fields.integer(msg, "seq"), None), fields.flag(msg, "changed"))

    def _on_node_lost(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._node_gone(msg, lost=True)

    def _on_node_left(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._node_gone(msg, lost=False)

    def _node_gone(self, msg: dict[str, Any], lost: bool) -> None:
        self.last_heard = time.monotonic()
        how = "was lost" if lost else "left the job"
        why = f"{msg.get('role')} rank {msg.get('rank')} (pid {msg.get('pid')} on {msg.get('host')}) {how}: {msg.get('why')}"
        # A graceful leave is normal at the end of a job; only a loss deserves a warning.
        self.log.log(logging.WARNING if lost else logging.INFO, why)
        self.listener.on_node_gone(msg, lost, why)

    def _on_changed(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        self.listener.on_changed(fields.integer(msg, "generation"), str(msg.get("why")),
                                 bool(msg.get("restore", True)))

    def _on_book(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        self.book = Book.from_message(msg)
        self.new_generation()
        self.listener.on_book(self.book)

    def _on_refused(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        self.listener.on_broken(PeerLostError(f"the scheduler no longer knows this worker: {msg.get('why')}"))

    def _on_job_failed(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        self.listener.on_broken(JobFailedError(f"the elastic job failed: {msg.get('why')} [on rank {self._rank()}]"))

    def _on_job_over(self, route: Any, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._on_nothing(route, msg, frames)
        self.listener.on_broken(JobEndedError(f"the job finished before this worker got its state ({msg.get('why')})"))
