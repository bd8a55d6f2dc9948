"""The worker's links to the servers: one DEALER per server, credit, dispatch, replies and
deadlines. Runs on the engine thread, holding ``lock`` (``stage`` excepted: the caller's thread;
and ``push_now``, the caller's thread holding ``lock``).

Small push_pulls are sent from their caller's thread (worker.caller_sends).

Tensors are split into partitions spread over the servers (worker.server_choice)
and sent in priority order (BytePS: larger priority first) with at most
BYTEPS_SCHEDULING_CREDIT large partitions not yet acknowledged; each partition's sum is
copied into the output as it arrives, and the operation's future completes when the last
one is in. Servers acknowledge a large push on receipt, so credit measures data in
transit, not rounds waiting for slower workers: two workers that enqueue tensors in
different orders can never deadlock each other. Servers on this host get payloads through
shared memory (``stage`` copies them in on the caller's thread). A job that reduces by host
sends partitions through this worker's host leader or as its host's sum (worker.host_reduce).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq

from ..config import Config
from ..errors import PeerLostError, error_for
from ..futures import Future, complete, fail
from ..protocol import Ack, Error, Push, Result, Stats, handlers, send
from ..protocol.data import SMALL_PUSH_BYTES
from ..transport import endpoint_host
from ..transport.data_path import Route
from ..transport.receive import DropLog, drain
from ..transport.shm import SegmentPool
from ..transport.sockets import SocketRole, open_socket
from .caller_sends import CallerSends
from .host_reduce import HostLink, Way
from .link_failures import LEADER, LinkFailures
from .operation import Operation
from .scheduler_link import Book
from .server_choice import server_of
from .trace import Tracer, now_us

PUSH = Push.header()["op"]
DISPATCH_BATCH = 256  # partitions sent per pass of the engine loop


class ServerLinks(LinkFailures, CallerSends):
    """Every connection to a server and the partitions in flight on them (module docstring)."""

    def __init__(self, ctx: zmq.Context, config: Config, uid: bytes, log: logging.Logger,
                 segments: SegmentPool | None, tracer: Tracer | None, peer_sock: zmq.Socket | None = None) -> None:
        self.ctx = ctx
        self.config = config
        self.uid = uid
        self.log = log
        self.segments = segments
        self.tracer = tracer
        self.lock = threading.Lock()  # held by whichever thread uses the server sockets (module docstring)
        self.sockets: list[zmq.Socket] = []
        self.routes: list[Route] = []  # how payloads reach each server (transport.data_path)
        self._fds: list[int] = []  # each server socket's ZMQ_FD, what the engine polls
        self._leader_fd = -1  # the host leader socket's ZMQ_FD (a local of a host group)
        self._look = False  # a reply may wait unseen on some server socket: read them all
        self._sent = False  # the engine thread sent on server sockets since it last looked
        # The engine completes finished operations just before it polls (flush): a caller woken
        # earlier would only wait again, for the interpreter lock the engine thread still holds.
        self.deferred: list[Operation] | None = None
        self.addresses: list[str] = []
        self.shm_servers: frozenset[int] = frozenset()  # servers on this host (replaced, never mutated)
        self.rank = -1
        self.generation = 0
        self._drops = DropLog(log, "message from a server")
        self._handlers: list[dict[str, Callable[..., None]]] = []
        self._order = itertools.count()
        self._req_ids = itertools.count(1)
        self._heap: list[tuple[int, int, Operation, int]] = []
        self._reqs: dict[int, tuple[Operation, int, int]] = {}  # req -> (operation, partition, target)
        self._unacked: dict[int, int] = {}  # req -> server index (or LEADER)
        self.pending: set[Operation] = set()
        self._stats: dict[int, tuple[Future, list[Any]]] = {}
        self._lost: dict[int, str] = {}
        self._heard: dict[int, float] = {}  # server index (or LEADER) -> when it last sent anything
        self.hosts = HostLink(ctx, config, uid, self.pending, self._push_hosted, self.fail_op, self._poison, peer_sock)
        self._leader_table = self._table(LEADER)

    # -- connections ----------------------------------------------------------------
    def connect(self, book: Book) -> bool:
        """Take a new address book; reconnect if its servers differ. True if the sockets changed."""
        self.rank, self.generation = book.rank, book.generation
        self._lost.clear()
        self._heard.clear()
        host_changed = self.hosts.connect(book)
        self._leader_fd = self.hosts.sock.get(zmq.FD) if self.hosts.sock is not None else -1
        if self.addresses == book.servers:
            return host_changed
        # A server that stays keeps its connection: a new one would present this worker's routing
        # id while the server may still hold the old connection, and a ROUTER drops a connection
        # whose id is in use (no handover: issue 22), with what was sent on it.
        kept = dict(zip(self.addresses, self.sockets))
        self.sockets, self._handlers = [], []
        here = f"tcp://{self.config.node_host}"
        self.shm_servers = frozenset(index for index, addr in enumerate(book.servers)
                                     if self.segments is not None and endpoint_host(addr) == here)
        for index, addr in enumerate(book.servers):
            sock = kept.pop(addr, None)
            if sock is None:
                sock = open_socket(self.ctx, SocketRole.TO_SERVER, self.config, self.uid)
                sock.connect(addr)
            self.sockets.append(sock)
            self._handlers.append(self._table(index))
        for sock in kept.values():  # servers no longer in the job
            sock.close(linger=0)
        self.addresses = list(book.servers)
        self.routes = [Route(sock, index in self.shm_servers) for index, sock in enumerate(self.sockets)]
        self._fds = [sock.get(zmq.FD) for sock in self.sockets]
        self._look = True
        return True

    def _table(self, index: int) -> dict[str, Callable[..., None]]:
        def heard(handler: Callable[..., None]) -> Callable[..., None]:
            def handle(_route: Any, msg: Any, frames: list[zmq.Frame]) -> None:
                self._heard[index] = time.monotonic()
                handler(index, msg, frames)
            return handle

        return handlers({Ack: heard(self._on_ack), Result: heard(self._on_result), Error: heard(self._on_error),
                         Stats: heard(self._on_stats)})

    @property
    def poll_sockets(self) -> list[zmq.Socket | int]:
        """What the engine polls for this part: the ZMQ_FDs of the servers' sockets and the host
        leader's (never the sockets: a caller may send on them meanwhile, see the module docstring)."""
        fds = [*self._fds, self.hosts.threads.fileno()]
        return fds if self._leader_fd < 0 else [*fds, self._leader_fd]

    def drain(self, events: dict[Any, int]) -> None:
        """Read the replies of every server (and host leader) that has some (bounded per server)."""
        look, self._look = self._look, False
        for index, sock in enumerate(self.sockets):
            if look or self._fds[index] in events or sock in events:
                self._look |= drain(sock, False, self._handlers[index], self._drops, 1024)  # True: more left
        if self.hosts.threads.fileno() in events:
            self.hosts.threads.finished()
        if self.hosts.sock is not None and (look or self._leader_fd in events):
            self.read_leader()

    def read_leader(self) -> None:
        """Read what this local's host leader answered (bounded)."""
        self._look |= drain(self.hosts.sock, False, self._leader_table, self._drops, 1024)

    def close(self) -> None:
        """Close every server socket and the host leader link."""
        self.hosts.close()
        self._close_servers()

    def _close_servers(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets, self._handlers, self.addresses, self.routes = [], [], [], []
        self.shm_servers = frozenset()

    # -- sending --------------------------------------------------------------------
    def stage(self, op: Operation) -> None:
        """Copy ``op``'s payload into shared memory if any of its partitions goes to a server
        on this host (runs in the caller's thread, so the engine thread stays free)."""
        local, nservers = self.shm_servers, len(self.addresses)
        if not self.hosts.needs_segment(op) and (not local or op.codecs is not None
                                                 or not op.servers(nservers) & local):
            return  # compressed payloads go as frames
        op.stage_in(self.segments)

    def enqueue(self, op: Operation) -> None:
        """Queue every partition of ``op`` by priority."""
        self._track(op)
        for index in range(len(op.parts)):
            heapq.heappush(self._heap, (-op.priority, next(self._order), op, index))

    def _track(self, op: Operation) -> None:
        op.remaining = len(op.parts)
        if op.traced:
            op.stamps = dict.fromkeys(range(len(op.parts)), now_us())
        op.deadline = time.monotonic() + self.op_timeout()
        self.pending.add(op)

    def dispatch(self) -> bool:
        """Send partitions in priority order while credit lasts; True if some are still ready.

        Small pushes use no credit, so a pass sends at most DISPATCH_BATCH of them: the loop
        in between reads replies and keeps heart-beating however many partitions are queued.
        """
        credit = self.config.scheduling_credit
        for _ in range(DISPATCH_BATCH):
            if not self._heap or len(self._unacked) >= credit:
                return False
            _, _, op, index = heapq.heappop(self._heap)
            if not op.failed:
                self._send(op, index)
        return bool(self._heap) and len(self._unacked) < credit

    def _send(self, op: Operation, index: int) -> None:
        way = self.hosts.way(op)
        if way in (Way.TO_LEADER, Way.HOST_ROUND) and op.segment is None:
            op.stage_in(self.segments)  # the address book changed after the caller staged it
        refusal = self.hosts.refusal(op) if way is Way.TO_LEADER else None
        if refusal is not None:
            self.fail_op(op, refusal)
        elif way is Way.HOST_ROUND:
            self.hosts.rounds.own(op, index)  # pushed once the host's locals are in (_push_hosted)
        else:
            self._push(op, index, way)

    def _push_hosted(self, op: Operation, index: int) -> None:
        """The host's sum of a partition is in the leader's segment: push it to the servers, or,
        where this host holds every worker of the job, it is the result already."""
        if not self.hosts.whole_job:
            self._push(op, index, Way.HOSTED)
            return
        if op.traced:  # queued until the locals were in; its push_pull is the sum and the copies out
            self._queued(op, index)
        self._stored(op, index)  # HostAggregations put the sum in the output and the locals' regions

    def _queued(self, op: Operation, index: int) -> None:
        """A traced partition leaves the queue now (BYTEPS_TRACE_ON's QUEUE stage)."""
        sent = now_us()
        self.tracer.event(op.name, "QUEUE", index, op.stamps[index], sent)
        op.stamps[index] = sent

    def _poison(self, rid: tuple[int, int, int, int], name: str, sig: dict[str, Any], why: str,
                gathered: bool = False) -> None:
        """A host round failed on a mismatch: push, for this host, an empty partition that no
        rank's can match, so the server fails the round for every host at once (``gathered``: the
        round's other ranks gather rows at the servers, also where this host is the whole job)."""
        _, key, part, seq = rid
        server = server_of(key, part, len(self.sockets))
        if server in self._lost or (self.hosts.whole_job and not gathered):  # no other host waits on a server
            return
        header = Push.header(req=next(self._req_ids), key=key, name=name, part=part, seq=seq, count=0,
                             wire="|u1", dtype=sig["dtype"], shape=sig["shape"],
                             kind=f"{sig['kind']} (on the host of rank {self.rank}, {why})"[:1024],
                             ack=False, gen=self.generation, hosted=True)
        self.routes[server].send(header, (b"",))
        self._sent = True

    def _push(self, op: Operation, index: int, way: Way) -> None:
        server = server_of(op.key, index, len(self.sockets))
        target = LEADER if way is Way.TO_LEADER else server
        if target in self._lost:
            self.fail_op(op, PeerLostError(f"push_pull {op.name!r}: {self._lost[server]}"))
            return
        offset, count = op.parts[index]
        req = next(self._req_ids)
        self._reqs[req] = (op, index, target)
        # Small partitions neither use credit nor get an acknowledgement: credit limits
        # bytes in transit, and one message less per push is most of a small push_pull.
        small = count * op.send.dtype.itemsize <= SMALL_PUSH_BYTES
        if not small:
            self._unacked[req] = target
        op.reqs.add(req)
        if op.traced:
            self._queued(op, index)
        sig = op.sig
        header = {"op": PUSH, "req": req, "key": op.key, "name": op.name, "part": index, "seq": op.seq,
                  "count": count, "wire": op.send.dtype.str, "dtype": sig["dtype"], "shape": sig["shape"],
                  "kind": sig["kind"], "ack": not small, "gen": self.generation}  # Push.header, inlined
        if op.codecs is not None:
            header["codec"] = op.codecs[index]
        if way is Way.HOSTED:
            header["hosted"] = True
        if op.rows:
            header["rows"] = True
        if op.root is not None and way is not Way.HOSTED:  # a host's sum holds every local's push
            header["root"] = op.root
        if op.store is not None:
            header["store"], header["instance"] = op.store, op.instance
        self._sent = True
        route = self.hosts.route if target == LEADER else self.routes[server]
        where = op.in_segment(offset)
        route.send(header, () if route.by_name(where) else (op.payload(offset, count),), where)
        if op.rows and self.hosts.rounds is not None:  # a leader's gather: a local's sum under its name fails now
            self.hosts.rounds.went_direct(op)  # (after the push: a poison must not reach the server first)

    def stats(self, future: Future) -> None:
        """Ask every server for its counters; ``future`` completes with the list of replies."""
        req = next(self._req_ids)
        self._stats[req] = (future, [None] * len(self.sockets))
        for sock in self.sockets:
            send(sock, Stats(req=req))
        self._sent = True

    # -- replies --------------------------------------------------------------------
    def _take(self, req: int) -> tuple[Operation, int, int] | None:
        """The operation and partition a reply is for (None if it already failed); a result or an
        error also acknowledges the push."""
        self._unacked.pop(req, None)
        entry = self._reqs.pop(req, None)
        if entry is not None:
            entry[0].reqs.discard(req)
        return entry

    def _on_ack(self, _index: int, msg: Ack, _frames: list[zmq.Frame]) -> None:
        self._unacked.pop(msg.req, None)

    def _on_result(self, _index: int, msg: Result, frames: list[zmq.Frame]) -> None:
        entry = self._take(msg.req)
        if entry is not None:
            self._store(entry[0], entry[1], msg, frames)

    def _on_error(self, _index: int, msg: Error, _frames: list[zmq.Frame]) -> None:
        entry = self._take(msg.req)
        if entry is not None:
            self.fail_op(entry[0], error_for(msg.kind, f"{msg.why} [on rank {self.rank}]"))

    def _store(self, op: Operation, part: int, msg: Result, frames: list[zmq.Frame]) -> None:
        offset, count = op.parts[part] if op.out_parts is None else op.out_parts[part]
        if count and msg.shm:
            if not op.leased:  # a leased segment is op.out itself: the sum is in place
                op.out[offset:offset + count] = op.region(offset, count)
        elif count:
            op.out[offset:offset + count] = np.frombuffer(frames[0].buffer, dtype=op.out.dtype, count=count)
        self._stored(op, part)

    def _stored(self, op: Operation, part: int) -> None:
        """Partition ``part``'s sum is in ``op.out``: hand it on, and finish ``op`` after its last."""
        if op.traced:
            self.tracer.event(op.name, "PUSH_PULL", part, op.stamps[part], now_us())
        if op.host_rounds and self.hosts.rounds is not None:  # a leader: the locals get the sum too
            self.hosts.rounds.result(op, part)
        op.remaining -= 1
        op.deadline = time.monotonic() + self.op_timeout()
        if op.remaining == 0:
            self._finish(op)

    def _finish(self, op: Operation) -> None:
        self.pending.discard(op)
        if op.segment is not None and not op.leased:
            self.segments.release(op.name, op.segment)
        try:
            if op.finish is not None:
                op.finish()
        except Exception as exc:  # noqa: BLE001 - reported through the future
            fail(op.future, exc)
            return
        if op.traced:
            self.tracer.event(op.name, "total", "total", op.submitted, now_us())
            self.tracer.finished(op.seq)
        if self.deferred is not None:
            self.deferred.append(op)
        else:
            complete(op.future, op.result)

    def flush(self) -> None:
        """Complete the operations that finished while ``deferred`` held them."""
        done, self.deferred = self.deferred, []
        for op in done:
            complete(op.future, op.result)

    def _on_stats(self, index: int, msg: Stats, _frames: list[zmq.Frame]) -> None:
        entry = self._stats.get(msg.req)
        if entry is None:
            return
        future, replies = entry
        replies[index] = msg.reply()
        if all(r is not None for r in replies):
            del self._stats[msg.req]
            complete(future, replies)
