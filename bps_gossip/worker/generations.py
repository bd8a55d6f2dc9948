"""The worker engine's side of membership: rendezvous, address books, generations.

A mixin of :class:`~bps_gossip.worker.engine.Engine` (it shares the engine's state and
runs on its thread): registering with the scheduler, taking an address book (at init
and, in an elastic job, at every new generation), the scheduler's notices (a node lost
or left, a generation that ended, a commit check's answer, a failed job), messages of
peers that are already in the next generation, and leaving the job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import zmq

from .. import fields
from ..errors import (
    CommTimeoutError,
    ConfigError,
    JobEndedError,
    JobFailedError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    WorkersChangedError,
)
from ..liveness import start_ticks
from ..transport import MAX_HEADER_BYTES, bind_random_port, recv_message, send_message
from ..transport.security import HandshakeWatch, make_socket
from ..transport.startup import StartupWait
from .handle import Handle
from .peers import LEFT_GRACE, PeerChannel

CHANGE_GRACE = 1.0  # seconds pending work may still complete after a graceful change
MAX_EARLY = 1024  # peer messages of the next generation kept until its book arrives


@dataclasses.dataclass
class Book:
    """What the scheduler told this worker at rendezvous."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    generation: int
    servers: list[str]
    workers: list[dict[str, Any]]
    restore: bool = False  # elastic: roll back to the last commit (something crashed)


class GenerationHandling:
    """Membership methods of the engine (see the module docstring)."""

    def _register(self) -> None:
        cfg = self.config
        self.sched = make_socket(self.ctx, zmq.DEALER, cfg.keys, serve=False)
        self.sched.setsockopt(zmq.LINGER, 0)
        self.sched.setsockopt(zmq.IDENTITY, self.uid)
        watch = HandshakeWatch(self.sched)
        try:
            self.sched.connect(cfg.scheduler_address)
            self._await_admission(watch)
        finally:
            watch.close()

    def _await_admission(self, watch: HandshakeWatch) -> None:
        cfg = self.config
        self.peer = make_socket(self.ctx, zmq.ROUTER, cfg.keys, serve=True)  # gossip peer channel
        self.peer.setsockopt(zmq.LINGER, 0)
        self.peer.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes + MAX_HEADER_BYTES)
        peer_addr = bind_random_port(self.peer, cfg.bind_host, advertise=cfg.node_host)
        send_message(self.sched, {
            "op": "register", "role": "worker", "host": cfg.node_host, "pid": os.getpid(), "start_ticks": start_ticks(),
            "worker_id": cfg.worker_id, "local_rank": cfg.local_rank, "local_size": cfg.local_size,
            "peer_addr": peer_addr, "DMLC_NUM_WORKER": cfg.num_worker, "DMLC_NUM_SERVER": cfg.num_server,
        })
        # The scheduler may start after this worker, and the rest of the job later still: see
        # bps_gossip.transport.startup. An elastic joiner the running job told to wait has
        # BPS_GOSSIP_ELASTIC_TIMEOUT + BPS_GOSSIP_TIMEOUT to be admitted.
        wait = StartupWait(watch, cfg, f"worker pid {os.getpid()}", self.log)
        admit_by: float | None = None
        while True:
            wait.check()
            if admit_by is not None and time.monotonic() > admit_by:
                raise CommTimeoutError(
                    f"worker pid {os.getpid()}: the running job at {cfg.scheduler_address} did not admit "
                    f"this worker within {cfg.elastic_timeout + cfg.timeout:.1f} s (it joins at the next "
                    "commit: does the training loop call state.commit()?)")
            if not self.sched.poll(int(min(cfg.heartbeat_interval, 0.5) * 1000)):
                if wait.connected:  # the scheduler answers; before the connection, they would pile up
                    send_message(self.sched, {"op": "heartbeat"})
                continue
            wait.heard_from()
            _, msg, _ = recv_message(self.sched, routed=False)
            if msg["op"] == "refused":
                raise ConfigError(f"the scheduler refused this worker: {msg.get('why')}")
            if msg["op"] == "job_failed":
                raise JobFailedError(f"the job failed: {msg.get('why')}")
            if msg["op"] == "job_over":
                raise JobEndedError(f"the job finished before this worker was admitted ({msg.get('why')})")
            if msg["op"] == "wait" and admit_by is None:
                admit_by = time.monotonic() + cfg.elastic_timeout + cfg.timeout
                self.log.info("waiting to join the running job: %s", msg.get("why"))
            if msg["op"] == "book":
                break
        self.has_state = admit_by is None  # a joiner gets the job's state from rank 0 later
        self._apply_book(msg)

    def _apply_book(self, msg: dict[str, Any]) -> None:
        """Take an address book (at init, and in an elastic job at every new generation)."""
        cfg = self.config
        book = msg["book"]
        rank = int(msg["rank"])
        me = book["workers"][rank]
        old = self.book
        self.book = Book(rank=rank, size=len(book["workers"]), local_rank=me["local_rank"],
                         local_size=me["local_size"], generation=book["generation"],
                         servers=list(book["servers"]), workers=list(book["workers"]),
                         restore=bool(msg.get("restore", False)))
        if old is None or old.servers != self.book.servers:
            for sock in self.servers:
                sock.close(linger=0)
            self.servers = []
            self.shm_servers = set()
            for index, addr in enumerate(self.book.servers):
                if self.segments is not None and addr.rsplit(":", 1)[0] == f"tcp://{cfg.node_host}":
                    self.shm_servers.add(index)
                sock = make_socket(self.ctx, zmq.DEALER, cfg.keys, serve=False)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, self.uid)
                # No high-water mark: a full queue would block this thread (no heartbeats, no
                # replies read) on send; credit bounds large partitions, the caller's arrays the rest.
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.connect(addr)
                self.servers.append(sock)
            self._sockets_changed = True
        if self.channel is not None:
            self.channel.close()
        self.channel = PeerChannel(self.ctx, self.uid, rank, self.book.workers, cfg.timeout, self.log,
                                   self.book.generation, cfg.keys)
        self.channel.pool = self.segments
        with self._seq_lock:
            self._seqs.clear()  # every rank numbers each name's rounds from 0 in a new generation
        self._barrier_seq = 0
        self._commit_seq = 0
        self._lost_servers.clear()
        self._heard.clear()
        self._stale = None
        self._last_sched = time.monotonic()
        early, self._early_peer = self._early_peer, []
        for route, peer_msg, frames in early:
            try:
                self._on_peer(route, peer_msg, frames)
            except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                self.log.warning("dropped a malformed peer message: %s", exc)

    def _on_peer(self, route: bytes, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        generation = fields.integer(msg, "gen", 0, fields.MAX_INT, 0)
        if generation > self.book.generation:  # the sender has its new book already
            if generation > max(self.book.generation, self._target_gen) + 1 or len(self._early_peer) >= MAX_EARLY:
                raise ProtocolError(f"gossip for generation {generation} while this worker is in "
                                    f"{self.book.generation}: dropped")
            self._early_peer.append((route, msg, frames))
        elif generation == self.book.generation:
            self.channel.on_message(route, msg, frames)
        # else: a round of a generation that ended; nobody waits for it

    def _on_scheduler(self, msg: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        self._last_sched = time.monotonic()
        op = msg["op"]
        if op == "barrier_done":
            handle = self._barriers.pop(int(msg["seq"]), None)
            if handle is not None:
                handle.set_result(None)
        elif op == "barrier_failed":
            handle = self._barriers.pop(int(msg["seq"]), None)
            if handle is not None:
                handle.set_error(PeerLostError(f"barrier: {msg.get('why')} [on rank {self.book.rank}]"))
        elif op in ("node_lost", "node_left"):
            how = "was lost" if op == "node_lost" else "left the job"
            why = f"{msg.get('role')} rank {msg.get('rank')} (pid {msg.get('pid')} on {msg.get('host')}) {how}: {msg.get('why')}"
            # A graceful leave is normal at the end of a job; only a loss deserves a warning.
            self.log.log(logging.WARNING if op == "node_lost" else logging.INFO, why)
            if msg.get("role") == "worker":
                self.channel.on_worker_gone(int(msg["rank"]), "lost" if op == "node_lost" else "left", why)
            if msg.get("role") == "server":
                index = int(msg["rank"])
                self._lost_servers[index] = why
                for req, server in list(self._unacked.items()):
                    if server == index:
                        del self._unacked[req]
                nservers = len(self.servers)
                for pending in list(self._pending):
                    if any((pending.key + i) % nservers == index for i in range(len(pending.parts))):
                        self._fail(pending, PeerLostError(f"push_pull {pending.name!r}: {why}"))
        elif op == "refused":
            self._fail_everything(PeerLostError(f"the scheduler no longer knows this worker: {msg.get('why')}"))
        elif op == "changed":
            self._on_changed(msg)
        elif op == "book":
            self._apply_book(msg)
            if self._rejoin is not None:
                self._rejoin.set_result(self.book)
                self._rejoin = None
        elif op == "commit_done":
            handle = self._commits.pop(int(msg["seq"]), None)
            if handle is not None:
                handle.set_result(bool(msg["changed"]))
        elif op in ("job_failed", "job_over"):
            error = JobFailedError(f"the elastic job failed: {msg.get('why')} [on rank {self.book.rank}]") \
                if op == "job_failed" else JobEndedError(f"the job finished before this worker got its state "
                                                         f"({msg.get('why')})")
            self._fail_everything(error)
            if self._rejoin is not None:
                self._rejoin.set_error(self._broken)
                self._rejoin = None

    def _await_peer_reads(self) -> None:
        """Before leaving, give peers on this host a moment to read the last gossip we left in
        shared memory: unlinked before they map it, it would be lost (TCP messages linger)."""
        deadline = time.monotonic() + LEFT_GRACE
        while self.channel is not None and self.channel.unread() and not self._sched_silent:
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.info("leaving with %d gossip message(s) not read by peers", self.channel.unread())
                return
            if self.peer.poll(int(left * 1000) + 1):
                self._drain_peers()

    def _on_changed(self, msg: dict[str, Any]) -> None:
        """Elastic: the generation ended. Fail what is pending; rejoin when asked (reset())."""
        generation = int(msg["generation"])
        if generation <= max(self.book.generation, self._target_gen):
            return
        self._target_gen = generation
        self._stale = WorkersChangedError(
            f"the job's workers changed (generation {self.book.generation} -> {generation}): {msg.get('why')} "
            f"[on rank {self.book.rank}]", restore=bool(msg.get("restore", True)))
        if self._stale.restore or self._rejoin is not None:
            self._fail_pending(self._stale)  # a crash: everything rolls back, no need to wait
        else:
            # A graceful leave or a join: results that servers and peers sent before they heard
            # of it are on their way (a worker that left got its result, so ours was sent too).
            # New work fails at once; pending work gets a moment to complete.
            self._fail_control(self._stale)
            self._stale_grace = time.monotonic() + CHANGE_GRACE
        if self._rejoin is not None:
            send_message(self.sched, {"op": "rejoin", "generation": generation, "has_state": self.has_state})

    def _leave(self, handle: Handle) -> None:
        self._await_peer_reads()
        self._fail_everything(NotInitializedError("bps_gossip was shut down while this operation was pending"))
        send_message(self.sched, {"op": "leave", "crashed": self._crashed})
        # A scheduler that stopped answering will not say bye either: do not wait for it.
        deadline = time.monotonic() + (0.0 if self._sched_silent else min(5.0, self.config.timeout))
        while time.monotonic() < deadline and self.sched.poll(int((deadline - time.monotonic()) * 1000) + 1):
            _, msg, _ = recv_message(self.sched, routed=False)
            if msg["op"] in ("bye", "refused"):
                break
        self._running = False
        handle.set_result(None)
