"""The worker's communication engine: one background thread owns every socket.

API calls (any thread) put work in an inbox and wake the engine through a pipe; they
get a :class:`Handle` back. The engine splits tensors into partitions, spreads them
over the servers ((key + partition) mod servers), sends them in priority order
(BytePS: larger priority first) with at most BYTEPS_SCHEDULING_CREDIT partitions
not yet acknowledged, copies each partition's sum into the output as it arrives,
and completes the handle when the last one is in.

Servers acknowledge a push on receipt, so credits measure data in transit, not
rounds waiting for slower workers: two workers that enqueue tensors in different
orders can never deadlock each other.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import queue
import threading
import time
import uuid
from typing import Any

import numpy as np
import zmq

from .. import fields
from ..aggregation import SMALL_PUSH_BYTES
from ..config import Config
from ..errors import (
    BpsGossipError,
    CommTimeoutError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    TensorMismatchError,
    WorkersChangedError,
)
from ..logs import get_logger
from ..transport import send_message
from ..transport.receive import DropLog, drain
from ..transport.shm import OwnedSegment, SegmentPool, shm_available
from .generations import Book, GenerationHandling
from .handle import Handle
from .peers import PeerChannel
from .trace import Tracer, now_us

_ERROR_KINDS: dict[str, type[BpsGossipError]] = {
    "mismatch": TensorMismatchError,
    "lost": PeerLostError,
    "timeout": CommTimeoutError,
    "protocol": ProtocolError,
    "changed": WorkersChangedError,
}
DISPATCH_BATCH = 256  # partitions sent per pass of the engine loop


@dataclasses.dataclass(eq=False)
class Operation:
    """One push_pull in flight: what to send, where the sum goes, and what is left."""

    handle: Handle
    name: str
    key: int
    seq: int
    sig: dict[str, Any]
    send: np.ndarray  # flat, contiguous, wire dtype
    out: np.ndarray  # flat view of the result, wire dtype
    result: Any  # what the handle returns
    parts: list[tuple[int, int]]
    priority: int
    finish: Any = None  # callable run on the engine thread after the last partition
    remaining: int = 0
    failed: bool = False
    deadline: float = 0.0
    reqs: set[int] = dataclasses.field(default_factory=set)
    segment: OwnedSegment | None = None  # holds a copy of `send` for servers on this host
    codecs: list[dict[str, Any]] | None = None  # compressed: each partition's codec, for the server
    traced: bool = False  # BYTEPS_TRACE_ON and a traced step: stamps[part] is when its stage began
    submitted: float = 0.0
    stamps: dict[int, float] = dataclasses.field(default_factory=dict)


SCHEDULER_OPS = ("hb_ack", "refused", "wait", "book", "barrier_done", "barrier_failed", "node_lost", "node_left",
                 "changed", "commit_done", "job_failed", "job_over", "bye", "terminate")  # what the scheduler sends a worker
SERVER_OPS = ("ack", "result", "error", "stats")  # what a server answers


class Engine(GenerationHandling):
    """Owns the worker's sockets on a background thread; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = get_logger("worker", config.log_level)
        # The routing id on every connection: servers and peers know this worker's rank by it
        # (from the address book), so it must not be guessable.
        self.uid = f"worker-{os.getpid()}-{uuid.uuid4().hex}".encode()
        self._drops = DropLog(self.log, "message")
        self._scheduler_handlers = dict.fromkeys(SCHEDULER_OPS, lambda _route, msg, frames: self._on_scheduler(msg, frames))
        self._peer_handlers = {"gossip": self._on_peer, "gossip_ack": self._on_gossip_ack}
        self._server_tables: list[dict[str, Any]] = []
        self.tracer = Tracer(config.trace_dir, config.local_rank, config.trace_start, config.trace_end) \
            if config.trace_on else None
        self.book: Book | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._broken: BpsGossipError | None = None
        self._dead: BpsGossipError | None = None  # set once the engine thread has ended
        self._sched_silent = False
        self._seqs: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self._order = itertools.count()
        self._req_ids = itertools.count(1)
        self._heap: list[tuple[int, int, Operation, int]] = []
        self._reqs: dict[int, tuple[Operation, int]] = {}
        self._unacked: dict[int, int] = {}  # req -> server index
        self._pending: set[Operation] = set()
        self._barriers: dict[int, Handle] = {}
        self._barrier_seq = 0
        self._stats: dict[int, tuple[Handle, list[Any]]] = {}
        # Elastic: the error of a generation that ended, the one announced, who waits for it.
        self._stale: WorkersChangedError | None = None
        self._target_gen = 0
        self._rejoin: Handle | None = None
        self._commits: dict[int, Handle] = {}
        self._commit_seq = 0
        self._early_peer: list[tuple[bytes, dict[str, Any], list[zmq.Frame]]] = []
        self._sockets_changed = False
        self._stale_grace = 0.0  # graceful change: when pending work of the old generation fails
        self._crashed = False  # told to the scheduler when leaving: a crash rolls an elastic job back
        # Elastic: this worker holds the job's state (it started with the job, or synced it after
        # joining). Told to the scheduler on rejoin: a job that finished drops those that do not.
        self.has_state = False
        self._lost_servers: dict[int, str] = {}
        self._heard: dict[int, float] = {}  # server index -> when it last sent anything
        self.channel: PeerChannel | None = None
        self.segments = SegmentPool(config.job_id) if config.shm and shm_available() else None
        self.shm_servers: set[int] = set()  # servers on this host: payloads go through shared memory
        self._running = True
        self._thread = threading.Thread(target=self._main, name="bps-gossip-engine", daemon=True)

    # ------------------------------------------------------------------ API side
    def start(self) -> Book:
        """Start the engine thread, register, and return the address book (blocks)."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join(timeout=5)
            self._running = False
            os.close(self._wake_r)  # an init() that is retried must not leak two descriptors each time
            os.close(self._wake_w)
            raise self._init_error
        assert self.book is not None
        return self.book

    def stage(self, op: Operation) -> None:
        """Copy ``op``'s payload into shared memory if any of its partitions goes to a server
        on this host (runs in the caller's thread, so the engine thread stays free)."""
        if not self.shm_servers or op.codecs is not None:  # compressed payloads go as frames
            return
        nservers = len(self.book.servers)
        if not any((op.key + i) % nservers in self.shm_servers for i in range(len(op.parts))):
            return
        op.segment = self.segments.acquire(op.name, op.send.nbytes)
        if op.send.size:
            op.segment.view(op.send.dtype, op.send.size)[:] = op.send

    def next_seq(self, name: str) -> int:
        """The round number of this rank's next operation on ``name``."""
        with self._seq_lock:
            seq = self._seqs.get(name, 0)
            self._seqs[name] = seq + 1
            return seq

    def submit(self, kind: str, payload: Any) -> None:
        """Hand work to the engine thread."""
        if not self._running:
            raise NotInitializedError("bps_gossip was shut down; call init() again first")
        if self._dead is not None:  # nobody reads the inbox any more: fail at once, never hang
            self._fail_item(kind, payload, self._dead)
            return
        self._inbox.put((kind, payload))
        os.write(self._wake_w, b".")
        if self._dead is not None:  # the thread ended meanwhile and may have missed this item
            self._fail_inbox()

    @staticmethod
    def _fail_item(kind: str, payload: Any, error: BaseException) -> None:
        """Complete the handle of an inbox item that will never run (a stop has nothing left to do)."""
        if kind == "stop":
            payload.set_result(None)
            return
        if kind == "op":
            handle = payload.handle
        elif kind == "peer_expect":
            handle = payload[-1]
        elif kind in ("barrier", "stats", "rejoin", "commit"):
            handle = payload
        else:
            return  # peer_send, peer_ack: nothing waits for them
        handle.set_error(error)

    def _fail_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._fail_item(kind, payload, self._dead)

    def stop(self, timeout: float = 5.0, crashed: bool = False) -> None:
        """Leave the job (``crashed``: because of an uncaught exception) and stop the engine thread."""
        if not self._running:
            return
        self._crashed = crashed
        handle = Handle("shutdown")
        self.submit("stop", handle)
        try:
            handle.wait(timeout)
        except BpsGossipError as exc:
            self.log.warning("shutdown: %s", exc)
        self._running = False
        self._thread.join(timeout)
        if self.tracer is not None:
            self.tracer.write()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        self.ctx = zmq.Context.instance()
        self.servers: list[zmq.Socket] = []
        try:
            self._register()
        except BaseException as exc:  # reported to start()'s caller
            self._init_error = exc
            self._close_sockets()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:
            self.log.exception("engine thread crashed")
            self._fail_everything(PeerLostError(f"bps_gossip engine crashed: {exc!r}"))
        finally:
            self._close_sockets()
            self._dead = self._broken or NotInitializedError("bps_gossip was shut down")
            self._fail_inbox()

    def _close_sockets(self) -> None:
        if self.segments is not None:
            self.segments.close()
        if self.channel is not None:
            self.channel.close()
        for sock in [*self.servers, getattr(self, "sched", None), getattr(self, "peer", None)]:
            if sock is not None:
                sock.close(linger=0)

    def _loop(self) -> None:
        poller = self._poller()
        interval = self.config.heartbeat_interval
        next_beat = 0.0
        more = False  # partitions ready to go: do not sleep in poll
        while self._running:
            if self._sockets_changed:  # a new generation brought other servers
                poller = self._poller()
            now = time.monotonic()
            if now >= next_beat:
                send_message(self.sched, {"op": "heartbeat"})
                next_beat = now + interval
                self._check_deadlines(now)
            wait_ms = 0 if more else max(0, int((next_beat - time.monotonic()) * 1000))
            events = dict(poller.poll(min(wait_ms, 200)))
            if self._wake_r in events:
                self._drain_inbox()
            if self.sched in events:  # bounded, so a backlog never delays a heartbeat for long
                drain(self.sched, False, self._scheduler_handlers, self._drops, 1024)
            if self.peer in events:
                self._drain_peers()
            for index, sock in enumerate(self.servers):
                if sock in events:
                    drain(sock, False, self._server_handlers[index], self._drops, 1024)
            more = self._dispatch()

    def _poller(self) -> zmq.Poller:
        self._sockets_changed = False
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.sched, zmq.POLLIN)
        poller.register(self.peer, zmq.POLLIN)
        for sock in self.servers:
            poller.register(sock, zmq.POLLIN)
        return poller

    @property
    def _server_handlers(self) -> list[dict[str, Any]]:
        if len(self._server_tables) != len(self.servers):
            self._server_tables = [dict.fromkeys(SERVER_OPS, lambda _route, msg, frames, i=index:
                                                 self._on_server(i, msg, frames)) for index in range(len(self.servers))]
        return self._server_tables

    def _drain_peers(self) -> None:
        drain(self.peer, True, self._peer_handlers, self._drops, 256)  # bounded: servers and the inbox go on

    def _on_gossip_ack(self, route: bytes, msg: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        if fields.integer(msg, "gen", 0, fields.MAX_INT, -1) == self.channel.generation:
            self.channel.on_ack(route, msg)

    # ------------------------------------------------------------------ inbox
    def _drain_inbox(self) -> None:
        try:
            os.read(self._wake_r, 65536)
        except BlockingIOError:
            pass
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "stop":
                self._leave(payload)
                return
            if kind == "finished":
                if self._broken is None:
                    send_message(self.sched, {"op": "finished"})
                continue
            if self._broken is not None:
                self._fail_item(kind, payload, self._broken)
                continue
            if kind == "rejoin":
                self._rejoin = payload
                if self._stale is not None:
                    self._fail_pending(self._stale)
                    send_message(self.sched, {"op": "rejoin", "generation": self._target_gen,
                                              "has_state": self.has_state})
                continue  # else the 'changed' notice is on its way (a server told us first)
            if self._stale is not None:
                if kind not in ("peer_send", "peer_ack"):
                    self._fail_item(kind, payload, self._stale)
                continue
            if kind == "op":
                self._enqueue(payload)
            elif kind == "barrier":
                self._barrier_seq += 1
                self._barriers[self._barrier_seq] = payload
                send_message(self.sched, {"op": "barrier", "seq": self._barrier_seq})
            elif kind == "peer_send":
                dst, header, arrays, staged = payload
                try:
                    self.channel.send(dst, header, arrays, staged)
                except ValueError as exc:
                    self.log.error("%s", exc)
            elif kind == "peer_ack":
                self.channel.ack(*payload)
            elif kind == "peer_expect":
                tag, rnd, sources, handle = payload
                self.channel.expect(tag, rnd, sources, handle)
            elif kind == "commit":
                self._commit_seq += 1
                self._commits[self._commit_seq] = payload
                send_message(self.sched, {"op": "commit", "seq": self._commit_seq})
            elif kind == "stats":
                req = next(self._req_ids)
                self._stats[req] = (payload, [None] * len(self.servers))
                for sock in self.servers:
                    send_message(sock, {"op": "stats", "req": req})

    def _enqueue(self, op: Operation) -> None:
        op.remaining = len(op.parts)
        if op.traced:
            op.stamps = dict.fromkeys(range(len(op.parts)), now_us())
        op.deadline = time.monotonic() + self._op_timeout()
        self._pending.add(op)
        for index in range(len(op.parts)):
            heapq.heappush(self._heap, (-op.priority, next(self._order), op, index))

    def _op_timeout(self) -> float:
        # The server reports rounds that stay incomplete after BPS_GOSSIP_TIMEOUT with the
        # missing ranks; this backstop only fires when a server itself does not answer.
        return self.config.timeout + 2 * self.config.heartbeat_interval + 1.0

    def _dispatch(self) -> bool:
        """Send partitions in priority order while credit lasts; True if some are still ready.

        Small pushes use no credit, so a pass sends at most DISPATCH_BATCH of them: the loop
        in between reads replies and keeps heart-beating however many partitions are queued.
        """
        credit = self.config.scheduling_credit
        for _ in range(DISPATCH_BATCH):
            if not self._heap or len(self._unacked) >= credit:
                return False
            _, _, op, index = heapq.heappop(self._heap)
            if op.failed:
                continue
            server = (op.key + index) % len(self.servers)
            if server in self._lost_servers:
                self._fail(op, PeerLostError(f"push_pull {op.name!r}: {self._lost_servers[server]}"))
                continue
            offset, count = op.parts[index]
            req = next(self._req_ids)
            self._reqs[req] = (op, index)
            # Small partitions neither use credit nor get an acknowledgement: credit limits
            # bytes in transit, and one message less per push is most of a small push_pull.
            small = count * op.send.dtype.itemsize <= SMALL_PUSH_BYTES
            if not small:
                self._unacked[req] = server
            op.reqs.add(req)
            if op.traced:
                sent = now_us()
                self.tracer.event(op.name, "QUEUE", index, op.stamps[index], sent)
                op.stamps[index] = sent
            header = {
                "op": "push", "req": req, "key": op.key, "name": op.name,
                "part": index, "seq": op.seq, "count": count, "wire": op.send.dtype.str,
                "dtype": op.sig["dtype"], "shape": op.sig["shape"], "kind": op.sig["kind"], "ack": not small,
                "gen": self.book.generation,
            }
            if op.codecs is not None:
                header["codec"] = op.codecs[index]
            if op.segment is not None and server in self.shm_servers:
                header["shm"] = op.segment.name
                header["offset"] = offset * op.send.dtype.itemsize
                send_message(self.servers[server], header)
            else:
                send_message(self.servers[server], header, (op.send[offset:offset + count],))
        return bool(self._heap) and len(self._unacked) < credit

    # ------------------------------------------------------------------ replies
    def _on_server(self, index: int, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._heard[index] = time.monotonic()
        op_name = msg["op"]
        req = int(msg.get("req") or 0)
        if op_name == "stats":
            self._on_stats(index, req, msg)
            return
        self._unacked.pop(req, None)  # a result or an error also acknowledges the push
        if op_name == "ack":
            return
        entry = self._reqs.pop(req, None)
        if entry is None:
            return  # a reply for an operation that already failed
        op, part = entry
        op.reqs.discard(req)
        if op_name == "error":
            kind = _ERROR_KINDS.get(msg.get("kind"), BpsGossipError)
            self._fail(op, kind(f"{msg.get('why')} [on rank {self.book.rank}]"))
            return
        if op_name != "result":
            raise ProtocolError(f"unknown reply {op_name!r} from server {index}")
        offset, count = op.parts[part]
        if op.traced:
            self.tracer.event(op.name, "PUSH_PULL", part, op.stamps[part], now_us())
        if count and msg.get("shm"):
            op.out[offset:offset + count] = op.segment.view(op.out.dtype, count, offset * op.out.dtype.itemsize)
        elif count:
            op.out[offset:offset + count] = np.frombuffer(frames[0].buffer, dtype=op.out.dtype, count=count)
        op.remaining -= 1
        op.deadline = time.monotonic() + self._op_timeout()
        if op.remaining == 0:
            self._pending.discard(op)
            if op.segment is not None:
                self.segments.release(op.name, op.segment)
            try:
                if op.finish is not None:
                    op.finish()
            except Exception as exc:  # noqa: BLE001 - reported through the handle
                op.handle.set_error(exc)
                return
            if op.traced:
                self.tracer.event(op.name, "total", "total", op.submitted, now_us())
                self.tracer.finished(op.seq)
            op.handle.set_result(op.result)

    def _on_stats(self, index: int, req: int, msg: dict[str, Any]) -> None:
        entry = self._stats.get(req)
        if entry is None:
            return
        handle, replies = entry
        replies[index] = {k: v for k, v in msg.items() if k not in ("op", "req")}
        if all(r is not None for r in replies):
            del self._stats[req]
            handle.set_result(replies)

    def _server_of(self, op: Operation, req: int) -> int:
        entry = self._reqs.get(req)
        return -1 if entry is None else (op.key + entry[1]) % len(self.servers)

    # ------------------------------------------------------------------ failures
    def _fail(self, op: Operation, error: BaseException) -> None:
        op.failed = True
        self._pending.discard(op)
        if op.segment is not None:
            self.segments.release(op.name, op.segment, reusable=False)
            op.segment = None
        for req in op.reqs:
            self._reqs.pop(req, None)
        op.reqs.clear()
        op.handle.set_error(error)

    def _fail_everything(self, error: BpsGossipError) -> None:
        self._broken = error
        self._fail_pending(error)

    def _fail_pending(self, error: BpsGossipError) -> None:
        self._stale_grace = 0.0
        for op in list(self._pending):
            self._fail(op, error)
        self._heap.clear()
        self._unacked.clear()
        self._reqs.clear()
        if self.channel is not None:
            self.channel.fail_all(error)
        self._fail_control(error)

    def _fail_control(self, error: BpsGossipError) -> None:
        """Fail the waits the scheduler answers (barriers, commit checks) and stats requests."""
        for handle in self._barriers.values():
            handle.set_error(error)
        self._barriers.clear()
        for handle, _ in self._stats.values():
            handle.set_error(error)
        self._stats.clear()
        for handle in self._commits.values():
            handle.set_error(error)
        self._commits.clear()

    def _check_deadlines(self, now: float) -> None:
        silent = now - self._last_sched
        if self._broken is None and silent > self.config.heartbeat_timeout:
            self._sched_silent = True
            self._fail_everything(PeerLostError(
                f"the scheduler at {self.config.scheduler_address} stopped answering "
                f"({silent:.1f} s without a message) [on rank {self.book.rank}]"))
            return
        if self._stale is not None and self._stale_grace and now > self._stale_grace:
            self._fail_pending(self._stale)  # what the old generation could still finish has arrived
        self.channel.check_deadlines(now)
        if self.config.elastic and self.config.stall_timeout and self._stale is None:
            for ranks, why in self.channel.overdue(now, self.config.stall_timeout):
                send_message(self.sched, {"op": "stalled", "ranks": ranks, "generation": self.book.generation,
                                          "why": why})
        for op in list(self._pending):
            if now > op.deadline:
                servers = sorted({self._server_of(op, r) for r in op.reqs} - {-1})
                # A server that keeps answering is busy (a backlog of partitions), not gone:
                # wait while the servers this op waits on (any, if it is still queued) speak.
                watched = servers or range(len(self.servers))
                if any(now - self._heard.get(s, -math.inf) < self._op_timeout() for s in watched):
                    continue
                addrs = [self.book.servers[s] for s in servers]
                waiting = f"servers {servers} ({', '.join(addrs)})" if servers else "its turn to be sent"
                self._fail(op, CommTimeoutError(
                    f"push_pull {op.name!r} on rank {self.book.rank}: no answer from {waiting} "
                    f"within {self._op_timeout():.1f} s (BPS_GOSSIP_TIMEOUT={self.config.timeout})"))
