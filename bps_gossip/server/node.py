"""A server process: its sockets, registration, and the loop that serves pushes until the
scheduler says terminate (or stops answering)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import zmq

from ..config import Config, load_config, warn_if_no_secret
from ..errors import LEFT_BEFORE_ROUND, BpsGossipError, PeerLostError, ProtocolError
from ..local_processes import raise_open_files_limit, start_ticks
from ..logs import get_logger
from ..protocol import (
    AddressBook,
    Changed,
    HbAck,
    Heartbeat,
    Message,
    NodeLeft,
    NodeLost,
    Push,
    Refused,
    Register,
    Stats,
    Terminate,
    handlers,
    send,
)
from ..rendezvous import join
from ..transport import bind_random_port
from ..transport.connection_gate import ConnectionGate
from ..transport.receive import DropLog, drain
from ..transport.security import FailedHandshakes, routing_id, set_admission
from ..transport.sockets import SocketRole, open_socket
from .aggregation import Contribution
from .outbox import Outbox
from .pool import SumPool
from .rounds import Aggregations


class Server:
    """A server process: registration, the push/sum/reply loop, and its shutdown."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = get_logger("server", config.log_level)
        warn_if_no_secret(config, self.log)
        # Connections are spread over the I/O threads: with CURVE, each worker's traffic is
        # encrypted and decrypted on its own (4 MiB TCP push_pull, 2 workers: 17 -> 12 ms).
        self.ctx = zmq.Context.instance(io_threads=config.server_io_threads)
        self.sock = open_socket(self.ctx, SocketRole.SERVER, config)
        self.addr = bind_random_port(self.sock, config.bind_host, config.port, config.node_host)
        self.knocks = FailedHandshakes(self.sock, self.log) if config.keys is not None else None
        self.gate = None  # which connections complete the handshake (with a secret only)
        if self.knocks is not None:
            self.gate = ConnectionGate(self.knocks, self.log)
            set_admission(self.ctx, self.gate.admit)
        self.curve = bool(self.sock.getsockopt(zmq.CURVE_SERVER))  # asked once, not on every wake
        self.outbox = Outbox(self.sock, self.log)
        self.sched = open_socket(self.ctx, SocketRole.TO_SCHEDULER, config, routing_id("server", config.keys))
        self.pool = SumPool(config.server_engine_threads)
        self.rounds = Aggregations(config, self.addr, self._reply, self.pool)
        self.rank = -1
        self.running = True
        self.last_ack = time.monotonic()
        self.handlers = handlers({Push: self.rounds.on_push,
                                  Stats: self._on_stats},
                                 malformed={Push: self.rounds.malformed})
        self.scheduler_handlers = handlers({
            Terminate: self._on_terminate, NodeLost: self._on_node_gone, NodeLeft: self._on_node_gone,
            Changed: self._on_changed, AddressBook: self._on_book,
            HbAck: self._on_alive, Refused: self._on_alive})
        self.drops = DropLog(self.log, "message")

    # -- registration -------------------------------------------------------------
    def register(self) -> None:
        """Register with the scheduler and wait for the address book (:func:`bps_gossip.rendezvous.join`).

        Pushes of workers that got the book first are held meanwhile.
        """
        cfg = self.config
        me = Register(role="server", addr=self.addr, host=cfg.node_host, pid=os.getpid(), start_ticks=start_ticks(),
                      num_worker=cfg.num_worker, num_server=cfg.num_server)
        admitted = join(self.sched, me, cfg, f"server {self.addr}", self.log, also=[(self.sock, self._drain_socket)])
        self._take_book(admitted.book)
        self.log.info("server %d of the job at %s serves %d workers", self.rank, self.addr, self.rounds.size)
        self.last_ack = time.monotonic()

    def _take_book(self, book: AddressBook) -> None:
        self.rank = book.rank
        self.rounds.take_book(book)
        if self.gate is not None:
            self.gate.set_members(self.rounds.ranks)

    # -- replies ------------------------------------------------------------------
    def _reply(self, who: Contribution, msg: Message, payloads: tuple = ()) -> None:
        try:
            self.outbox.send(who.route, msg, payloads, f"rank {who.rank}", member=who.route in self.rounds.ranks)
        except zmq.ZMQError as exc:
            self.log.warning("reply to rank %d failed: %s", who.rank, exc)

    def _on_stats(self, route: bytes, msg: Stats, _frames: list) -> None:
        rounds = self.rounds
        if route not in rounds.ranks:
            raise ProtocolError("stats asked by a connection that is no worker of this job")
        self.outbox.send(route, Stats(req=msg.req, rank=self.rank,
                                      parts={str(k): sorted(v) for k, v in rounds.names.parts.items()},
                                      rounds_done=rounds.rounds_done, open_rounds=len(rounds.rounds),
                                      pushes=list(rounds.pushes_by_rank), socket_bytes=rounds.socket_bytes),
                         who=f"rank {rounds.ranks[route]}")

    # -- the scheduler's notices --------------------------------------------------
    def _on_alive(self, _route: Any, _msg: Message, _frames: list) -> None:
        self.last_ack = time.monotonic()

    def _on_terminate(self, _route: Any, msg: Terminate, _frames: list) -> None:
        self.last_ack = time.monotonic()
        self.log.info("terminating: %s", msg.why)
        self.running = False

    def _on_node_gone(self, _route: Any, msg: NodeLost | NodeLeft, _frames: list) -> None:
        self.last_ack = time.monotonic()
        if msg.role == "worker":
            how = "was lost" if isinstance(msg, NodeLost) else LEFT_BEFORE_ROUND
            self.rounds.worker_gone(msg.describe(how), msg.rank)

    def _on_changed(self, _route: Any, msg: Changed, _frames: list) -> None:
        self.last_ack = time.monotonic()
        self.rounds.new_generation(msg.generation, msg.why)

    def _on_book(self, _route: Any, msg: AddressBook, _frames: list) -> None:
        self.last_ack = time.monotonic()
        self._take_book(msg)

    # -- loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Serve pushes until the scheduler says terminate (or stops answering).

        The loop polls the sockets' ZMQ_FDs, not the sockets (zmq_poll asks each socket for its
        events before and after it waits: two system calls a socket per wake, the server wakes once
        or twice a round) and reads both sockets on every wake. A descriptor only says that a
        socket's state may have changed, and a send can take that news in: the loop reads after
        its last send of a pass, and looks again at once after a heartbeat or a bounded read.
        """
        poller = zmq.Poller()
        pool = self.pool.fileno()
        for fd in (self.sock.getsockopt(zmq.FD), self.sched.getsockopt(zmq.FD), pool):
            poller.register(fd, zmq.POLLIN)
        next_beat = time.monotonic()
        look = True  # something may wait unannounced: do not sleep
        try:
            while self.running:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    if not self._beat(now):
                        return
                    look = True
                wait_ms = 0 if look else max(1, int((next_beat - time.monotonic()) * 1000))
                events = dict(poller.poll(wait_ms))
                if pool in events:
                    for rid, error in self.pool.finished():
                        self.rounds.pool_done(rid, error)
                look = drain(self.sched, False, self.scheduler_handlers, self.drops, 1024)
                look = self._drain_socket() or look
        finally:
            self.close()

    def _beat(self, now: float) -> bool:
        """Heart-beat, expire rounds, report stalls; False once the scheduler is gone."""
        send(self.sched, Heartbeat())
        self.outbox.prune()
        if self.knocks is not None:
            self.knocks.check()
        if self.gate is not None:
            self.gate.report()
        for stall in self.rounds.expire(now):
            send(self.sched, stall)
        if now - self.last_ack > self.config.heartbeat_timeout:
            self.log.error("scheduler %s stopped answering for %.1f s; exiting",
                           self.config.scheduler_address, now - self.last_ack)
            return False
        return True

    def _drain_socket(self) -> bool:
        # bounded, so the scheduler and the pool are served too; True: more may wait
        return drain(self.sock, True, self.handlers, self.drops, 256, self.curve)

    def close(self) -> None:
        """Stop the pool and close the sockets."""
        self.pool.close()
        self.rounds.close()
        if self.gate is not None:
            set_admission(self.ctx, None)
        if self.knocks is not None:
            self.knocks.close()
        self.sock.close(linger=0)
        self.sched.close(linger=500)


def main() -> int:
    """Entry point: run one server from the environment."""
    try:
        config = load_config()
        raise_open_files_limit()
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
