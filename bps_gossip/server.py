"""The summation server.

One ROUTER socket receives pushes from every worker; the IO thread acknowledges each
push at once (the worker's credit), checks it against its round, and sums it, inline
for small partitions and on a thread pool (BYTEPS_SERVER_ENGINE_THREAD) for large
ones. When all workers of the generation have pushed, each gets the sum back.

A push's rank is the worker whose connection it came on (its routing id is in the
scheduler's address book), a round's size is the book's, and the generation is the
scheduler's: nothing of that is taken from the message. A push for a generation whose
book has not reached this server yet is held (bounded) until it has.

A push that disagrees with its round, a worker that died or left, and a round that
stays incomplete past BPS_GOSSIP_TIMEOUT all end in an error reply to every
participant: never a silent hang.

Run it with ``DMLC_ROLE=server bpslaunch`` or ``python -m bps_gossip.server``.
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from . import fields
from .aggregation import Push, Round, RoundId, validate_push
from .compat import shutdown_dropping_queued
from .compression import PartitionState, codec_from_header, merge_on_server, rng_for
from .config import Config, load_config
from .errors import BpsGossipError, JobFailedError, PeerLostError, ProtocolError
from .liveness import start_ticks
from .logs import get_logger
from .transport import bind_random_port, recv_message, send_message
from .transport.receive import DropLog, drain
from .transport.security import HandshakeWatch, make_socket
from .transport.shm import AttachedSegments, owner_pid
from .transport.startup import StartupWait

MAX_ATTACHED = 4096  # segments mapped at once; the oldest are unmapped past this
MAX_GENERATION = 1 << 40
MIN_MAX_FRAME = 64 << 20  # the socket's frame limit is at least this (see __init__)
MAX_EARLY_PUSHES = 16384  # pushes held until this server has the address book they belong to
MAX_EARLY_BYTES = 512 << 20

INLINE_BYTES = 256 * 1024  # below this, handing a sum to the pool costs more than it saves


class Server:
    """A server process: registration, the push/sum/reply loop, and its shutdown."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = get_logger("server", config.log_level)
        self.ctx = zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.ROUTER, config.keys, serve=True)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A ROUTER drops what exceeds its high-water mark: a worker with thousands of small
        # partitions in flight would lose results and hang. Every reply answers a push, so
        # the queue is bounded by what the workers sent.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        # A frame above this drops its sender's connection before anything is allocated for it:
        # workers send partitions of at most BYTEPS_PARTITION_BYTES (headers are small).
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(2 * config.partition_bytes, MIN_MAX_FRAME))
        self.addr = bind_random_port(self.sock, config.bind_host, config.port, config.node_host)
        self.sched = make_socket(self.ctx, zmq.DEALER, config.keys, serve=False)
        self.sched.setsockopt(zmq.LINGER, 1000)
        self.sched.setsockopt(zmq.IDENTITY, f"server-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
        self.watch = HandshakeWatch(self.sched)
        self.sched.connect(config.scheduler_address)
        self.pool = ThreadPoolExecutor(config.server_engine_threads, thread_name_prefix="bps-sum")
        self.done_r, self.done_w = os.pipe()
        os.set_blocking(self.done_r, False)
        self.done: queue.SimpleQueue[tuple[RoundId, str | None]] = queue.SimpleQueue()
        self.rounds: dict[RoundId, Round] = {}
        self.names: dict[int, str] = {}
        self.feedback: dict[tuple[int, int], PartitionState] = {}  # compressed tensors' server-side error
        self.gone: dict[int, str] = {}  # worker rank -> why it is no longer in the job
        self.parts_seen: dict[int, set[int]] = {}
        self.rounds_done = 0
        self.segments = AttachedSegments(MAX_ATTACHED)
        self.size = 0
        self.ranks: dict[bytes, int] = {}  # a worker's routing id -> its rank, from the address book
        self.pids: list[int] = []  # by rank: a worker's shared-memory segments carry its pid
        self.book_generation = 0  # the generation of the last address book
        self.early: collections.deque[tuple[float, bytes, dict[str, Any], list[zmq.Frame]]] = collections.deque()
        self.early_bytes = 0
        self.generation = 0  # elastic: rounds of older generations are failed and dropped
        self.rank = -1
        self.running = True
        self.last_ack = time.monotonic()
        self.handlers = {"push": self._on_push, "stats": self._on_stats}
        self.scheduler_handlers = dict.fromkeys(
            ("terminate", "node_lost", "node_left", "changed", "book", "hb_ack", "refused"),
            lambda _route, msg, _frames: self._on_scheduler(msg))
        self.drops = DropLog(self.log, "message")

    # -- registration -------------------------------------------------------------
    def register(self) -> None:
        """Register with the scheduler and wait for the address book.

        The scheduler may start later than this server, and the workers much later (pods
        minutes apart, slow imports): see :mod:`bps_gossip.transport.startup` for how long
        this waits (BPS_GOSSIP_START_TIMEOUT for a connection, then as long as the scheduler
        answers heartbeats).
        """
        send_message(self.sched, {
            "op": "register", "role": "server", "addr": self.addr, "host": self.config.node_host,
            "pid": os.getpid(), "start_ticks": start_ticks(), "DMLC_NUM_WORKER": self.config.num_worker,
            "DMLC_NUM_SERVER": self.config.num_server,
        })
        interval = self.config.heartbeat_interval
        wait = StartupWait(self.watch, self.config, f"server {self.addr}", self.log)
        poller = zmq.Poller()
        poller.register(self.sched, zmq.POLLIN)
        poller.register(self.sock, zmq.POLLIN)
        while True:
            wait.check()
            events = dict(poller.poll(int(min(interval, 0.5) * 1000)))
            if self.sock in events:  # pushes of workers that have their book already: held
                self._drain_socket()
            if self.sched not in events:
                if wait.connected:  # before that, heartbeats would only pile up in the queue
                    send_message(self.sched, {"op": "heartbeat"})
                continue
            _, msg, _ = recv_message(self.sched, routed=False)
            wait.heard_from()
            if msg["op"] == "refused":
                raise ProtocolError(f"scheduler refused this server: {msg.get('why')}")
            if msg["op"] == "terminate":
                raise JobFailedError(f"server {self.addr}: the job ended before it started: {msg.get('why')}")
            if msg["op"] == "book":
                self.watch.close()
                self._take_book(msg)
                self.log.info("server %d of the job at %s serves %d workers", self.rank, self.addr, self.size)
                self.last_ack = time.monotonic()
                return

    def _take_book(self, msg: dict[str, Any]) -> None:
        """An address book from the scheduler: who the workers are, and a new generation."""
        book = msg["book"]
        self.rank = int(msg["rank"])
        self.size = len(book["workers"])
        self.ranks = {bytes.fromhex(w["uid"]): index for index, w in enumerate(book["workers"])}
        self.pids = [w["pid"] for w in book["workers"]]
        self.book_generation = int(book["generation"])
        self._new_generation(self.book_generation, "a new generation began")
        early, self.early, self.early_bytes = self.early, collections.deque(), 0
        for _, route, push_msg, frames in early:
            self._on_push(route, push_msg, frames)

    def _hold(self, route: bytes, msg: dict[str, Any], frames: list[zmq.Frame], generation: int) -> None:
        """Keep a push until the address book of its generation arrives (bounded)."""
        nbytes = sum(len(frame) for frame in frames)
        if len(self.early) >= MAX_EARLY_PUSHES or self.early_bytes + nbytes > MAX_EARLY_BYTES:
            self._reply(Push(-1, route, msg["req"]), {
                "op": "error", "kind": "protocol",
                "why": f"server {self.addr} holds {len(self.early)} pushes ({self.early_bytes} bytes) for generations "
                       f"whose address book it has not received; generation {generation} push dropped"})
            return
        self.early.append((time.monotonic(), route, msg, frames))
        self.early_bytes += nbytes

    # -- replies ------------------------------------------------------------------
    def _reply(self, push: Push, header: dict[str, Any], payloads: tuple = ()) -> None:
        header["req"] = push.req
        try:
            send_message(self.sock, header, payloads, route=push.route)
        except zmq.ZMQError as exc:
            self.log.warning("reply to rank %d failed: %s", push.rank, exc)

    def _fail_round(self, rnd: Round, kind: str, why: str) -> None:
        rnd.error = why
        for push in rnd.pushes.values():
            self._reply(push, {"op": "error", "kind": kind, "why": why})
        if len(rnd.pushes) >= rnd.expected:
            self.rounds.pop(rnd.rid, None)

    def _finish(self, rnd: Round) -> None:
        self.rounds.pop(rnd.rid, None)
        if rnd.error is not None:
            return
        if rnd.codec is not None:  # one compression of the sum; every worker gets the same bytes
            ef, seed = rnd.merge
            _, key, part, seq = rnd.rid
            state = self.feedback.setdefault((key, part), PartitionState())
            result = merge_on_server(ef, rnd.codec, rnd.acc, state, rng_for(seed, part, seq, 1))
            for push in rnd.pushes.values():
                self._reply(push, {"op": "result"}, (result,))
            self.rounds_done += 1
            return
        for push in rnd.pushes.values():
            if push.region is not None:  # the sum is already in its region (write_back)
                self._reply(push, {"op": "result", "shm": True})
            else:
                self._reply(push, {"op": "result"}, (rnd.acc,))
        self.rounds_done += 1

    def _region(self, rank: int, msg: dict[str, Any], wire: str, count: int) -> Any:
        """The region of worker ``rank``'s own shared-memory segment named in its push."""
        name = fields.text(msg, "shm", 256)
        if owner_pid(name) != self.pids[rank]:
            raise ProtocolError(f"rank {rank} named segment {name!r}, which is not its own")
        return self.segments.view(name, wire, count, fields.integer(msg, "offset", 0, 1 << 40))

    # -- handlers -----------------------------------------------------------------
    def _on_push(self, route: bytes, msg: dict[str, Any], frames: list[zmq.Frame]) -> None:
        push = Push(rank=-1, route=route, req=0)
        payload: Any = frames[0] if frames else None
        try:
            push.req = fields.integer(msg, "req")
            generation = fields.integer(msg, "gen", 0, MAX_GENERATION)
        except ProtocolError as exc:
            self._reply(push, {"op": "error", "kind": "protocol", "why": f"malformed push: {exc}"})
            return
        if generation > self.book_generation:  # the worker has its new book, this server not yet
            self._hold(route, msg, frames, generation)
            return
        try:
            if "shm" in msg:
                wire = np.dtype(fields.text(msg, "wire", 16))
                shm_count = fields.integer(msg, "count", 0, 1 << 40)
                sig, wire_str, count = validate_push(msg, shm_count * wire.itemsize)
            else:
                sig, wire_str, count = validate_push(msg, len(payload) if payload is not None else 0)
            key, part = fields.integer(msg, "key"), fields.integer(msg, "part", 0, 1 << 32)
            seq, name = fields.integer(msg, "seq"), fields.text(msg, "name", 1024)
            codec = None
            if "codec" in msg:
                if "shm" in msg or np.dtype(wire_str) != np.uint8:
                    raise ProtocolError("compressed pushes come as uint8 frames")
                codec, ef, seed = codec_from_header(msg, count)
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            self._reply(push, {"op": "error", "kind": "protocol", "why": f"malformed push: {exc}"})
            return
        rank = self.ranks.get(route)
        if rank is None:  # before anything of the message is acted on
            self._reply(push, {"op": "error", "kind": "protocol",
                               "why": f"server {self.addr}: the sender is no worker of generation "
                                      f"{self.book_generation} of this job"})
            return
        push.rank, size = rank, self.size
        if "shm" in msg:  # only a registered worker's own segment is mapped
            try:
                payload = push.region = self._region(rank, msg, wire_str, count)
            except (OSError, ValueError, ProtocolError) as exc:
                self._reply(push, {"op": "error", "kind": "protocol", "why": f"malformed push: {exc}"})
                return
        known = self.names.setdefault(key, name)
        if known != name:
            self._reply(push, {"op": "error", "kind": "protocol",
                               "why": f"tensor names {known!r} and {name!r} hash to the same key {key}; rename one"})
            return
        if self.gone:
            why = "; ".join(self.gone.values())
            self._reply(push, {"op": "error", "kind": "lost",
                               "why": f"tensor {name!r}: {why}; this job is not elastic, so it cannot go on"})
            return
        if generation < self.generation:
            self._reply(push, {"op": "error", "kind": "changed",
                               "why": f"tensor {name!r}: generation {generation} of the job has ended"})
            return
        rid = (generation, key, part, seq)
        rnd = self.rounds.get(rid)
        if rnd is None:
            rnd = self.rounds[rid] = Round(rid, name, sig, wire_str, count, size, codec,
                                           (ef, seed) if codec is not None else (False, None))
        elif push.rank in rnd.pushes:
            self._reply(push, {"op": "error", "kind": "protocol",
                               "why": f"tensor {name!r}: rank {push.rank} pushed partition {part} of round {seq} twice"})
            return
        if rnd.error is None:
            rnd.error = rnd.mismatch(push.rank, sig, wire_str, count)
            rnd.pushes[push.rank] = push
            if rnd.error is not None:
                self._fail_round(rnd, "mismatch", rnd.error)
                return
        else:
            rnd.pushes[push.rank] = push
            self._reply(push, {"op": "error", "kind": "mismatch", "why": rnd.error})
            if len(rnd.pushes) >= rnd.expected:
                self.rounds.pop(rid, None)
            return
        self.parts_seen.setdefault(key, set()).add(part)
        if rnd.nbytes <= INLINE_BYTES:
            if rnd.add(payload if push.region is not None else payload.buffer):
                rnd.write_back()
                self._finish(rnd)  # the result doubles as this push's acknowledgement
                return
        else:
            self.pool.submit(self._add_on_pool, rnd, payload)
        if msg.get("ack", True):
            self._reply(push, {"op": "ack"})

    def _add_on_pool(self, rnd: Round, payload: Any) -> None:
        try:
            if rnd.add(payload if isinstance(payload, np.ndarray) else payload.buffer):
                rnd.write_back()
                self.done.put((rnd.rid, None))
                os.write(self.done_w, b".")
        except Exception as exc:  # report on the IO thread instead of dying silently
            self.done.put((rnd.rid, f"summation failed: {exc!r}"))
            os.write(self.done_w, b".")

    def _drain_done(self) -> None:
        try:
            os.read(self.done_r, 65536)
        except BlockingIOError:
            pass
        while True:
            try:
                rid, error = self.done.get_nowait()
            except queue.Empty:
                return
            rnd = self.rounds.get(rid)
            if rnd is None:
                continue
            if error is not None:
                self._fail_round(rnd, "protocol", f"tensor {rnd.name!r}: {error}")
            else:
                self._finish(rnd)

    def _on_worker_gone(self, msg: dict[str, Any], how: str) -> None:
        rank = int(msg["rank"])
        why = f"worker rank {rank} (pid {msg.get('pid')} on {msg.get('host')}) {how}: {msg.get('why')}"
        self.gone[rank] = why
        # Pushes are refused from now on (the job is not elastic), so no open round can
        # complete, not even one the gone worker already pushed to: fail them all now.
        why = "; ".join(self.gone.values())
        for rnd in list(self.rounds.values()):
            if rnd.error is None:
                self._fail_round(rnd, "lost", f"tensor {rnd.name!r}: {why}")
            self.rounds.pop(rnd.rid, None)

    def _new_generation(self, generation: int, why: str) -> None:
        """Elastic: fail every round of an older generation (its workers are told to reset)."""
        if generation <= self.generation:
            return
        self.generation = generation
        for rnd in list(self.rounds.values()):
            if rnd.rid[0] < generation:
                if rnd.error is None:
                    self._fail_round(rnd, "changed", f"tensor {rnd.name!r}: membership changed: {why}")
                self.rounds.pop(rnd.rid, None)

    def _on_stats(self, route: bytes, msg: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        if route not in self.ranks:
            raise ProtocolError("stats asked by a connection that is no worker of this job")
        send_message(self.sock, {
            "op": "stats", "req": msg.get("req"), "rank": self.rank,
            "parts": {str(k): sorted(v) for k, v in self.parts_seen.items()},
            "rounds_done": self.rounds_done, "open_rounds": len(self.rounds),
        }, route=route)

    def _on_scheduler(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        self.last_ack = time.monotonic()
        if op == "terminate":
            self.log.info("terminating: %s", msg.get("why"))
            self.running = False
        elif op in ("node_lost", "node_left") and msg.get("role") == "worker":
            self._on_worker_gone(msg, "was lost" if op == "node_lost" else "left the job")
        elif op == "changed":
            self._new_generation(int(msg["generation"]), str(msg.get("why")))
        elif op == "book":
            self._take_book(msg)

    def _expire_rounds(self) -> None:
        now = time.monotonic()
        while self.early and now - self.early[0][0] > self.config.timeout:
            _, route, msg, frames = self.early.popleft()
            self.early_bytes -= sum(len(frame) for frame in frames)
            self._reply(Push(-1, route, msg["req"]), {
                "op": "error", "kind": "timeout",
                "why": f"server {self.addr}: no address book of generation {msg['gen']} within "
                       f"{self.config.timeout:.1f} s (BPS_GOSSIP_TIMEOUT)"})
        for rnd in list(self.rounds.values()):
            self._report_stall(rnd, now)
            if rnd.error is None and now - rnd.created > self.config.timeout:
                missing = sorted(set(range(rnd.expected)) - set(rnd.pushes))
                self._fail_round(rnd, "timeout",
                                 f"tensor {rnd.name!r} partition {rnd.rid[2]}: ranks {missing} did not push "
                                 f"within {self.config.timeout:.1f} s (BPS_GOSSIP_TIMEOUT)")
                self.rounds.pop(rnd.rid, None)

    def _report_stall(self, rnd: Round, now: float) -> None:
        """Elastic: ranks that others have waited on for BPS_GOSSIP_STALL_TIMEOUT are reported
        (once per round) to the scheduler, which removes them like lost workers. Only when they are
        no more than those waiting: a majority missing means the pushers are early, not stuck."""
        stall = self.config.stall_timeout
        if not self.config.elastic or not stall or rnd.stall_reported or rnd.error is not None \
                or now - rnd.created <= stall:
            return
        rnd.stall_reported = True
        missing = sorted(set(range(rnd.expected)) - set(rnd.pushes))
        if missing and len(missing) <= len(rnd.pushes):
            send_message(self.sched, {"op": "stalled", "ranks": missing, "generation": rnd.rid[0],
                                      "why": f"pushed nothing of {rnd.name!r} for {now - rnd.created:.1f} s "
                                             f"while ranks {sorted(rnd.pushes)} waited on server {self.addr}"})

    # -- loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Serve pushes until the scheduler says terminate (or stops answering)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.sched, zmq.POLLIN)
        poller.register(self.done_r, zmq.POLLIN)
        interval = self.config.heartbeat_interval
        next_beat = time.monotonic()
        try:
            while self.running:
                now = time.monotonic()
                if now >= next_beat:
                    send_message(self.sched, {"op": "heartbeat"})
                    next_beat = now + interval
                    self._expire_rounds()
                    if now - self.last_ack > self.config.heartbeat_timeout:
                        self.log.error("scheduler %s stopped answering for %.1f s; exiting",
                                       self.config.scheduler_address, now - self.last_ack)
                        return
                events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
                if self.done_r in events:
                    self._drain_done()
                if self.sched in events:
                    drain(self.sched, False, self.scheduler_handlers, self.drops, 1024)
                if self.sock in events:
                    self._drain_socket()
        finally:
            self.close()

    def _drain_socket(self) -> None:
        # bounded, so the scheduler and the pool are served too
        drain(self.sock, True, self.handlers, self.drops, 256)

    def close(self) -> None:
        """Stop the pool and close the sockets."""
        shutdown_dropping_queued(self.pool)
        self.segments.close()
        self.sock.close(linger=0)
        self.sched.close(linger=500)
        os.close(self.done_r)
        os.close(self.done_w)


def main() -> int:
    """Entry point: run one server from the environment."""
    try:
        config = load_config()
        server = Server(config)
        server.register()
        server.run()
    except (BpsGossipError, PeerLostError) as exc:
        print(f"bps_gossip server: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:
        print(f"bps_gossip server: socket error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
