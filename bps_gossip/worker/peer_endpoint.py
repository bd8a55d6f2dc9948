"""The worker's endpoint for gossip: the ROUTER other workers send to, bound once for the
whole job (its address is in every address book), and the channel of the current
generation (:class:`~bps_gossip.worker.peers.PeerChannel`). Runs on the engine thread.

A peer that already has the next generation's address book may gossip before this worker
has it: such messages are kept (bounded) and handed to the new channel when the book
arrives. Aggregations of generations that ended are dropped; nobody waits for them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from ..config import Config
from ..errors import ProtocolError
from ..protocol import Gossip, GossipAck, GossipWaiting, Push, handlers
from ..transport import bind_random_port
from ..transport.receive import MALFORMED, DropLog, drain
from ..transport.shm import SegmentPool
from ..transport.sockets import SocketRole, open_socket
from .commands import PeerAck, PeerBlocked, PeerExpect, PeerSend
from .peers import LEFT_GRACE, PeerChannel
from .scheduler_link import Book

MAX_EARLY = 1024  # peer messages of the next generation kept until its book arrives
MAX_EARLY_BYTES = 1 << 30  # and their payload bytes


class PeerEndpoint:
    """The bound peer socket and the generation's channel (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, config: Config, uid: bytes, log: logging.Logger,
                 segments: SegmentPool | None, on_push: Callable[[bytes, Push], None] | None = None,
                 entered: Callable[[str], int] | None = None) -> None:
        self.ctx = ctx
        self.config = config
        self.uid = uid
        self.log = log
        self.segments = segments
        self.sock = open_socket(ctx, SocketRole.PEER, config)
        self.address = bind_random_port(self.sock, config.bind_host, advertise=config.node_host)
        self.channel: PeerChannel | None = None
        self.generation = 0
        self.next_generation = 0  # announced by the scheduler, book not here yet
        self._early: list[tuple[bytes, Gossip, list[zmq.Frame]]] = []
        self._drops = DropLog(log, "peer message")
        # A host leader's locals push to this socket too (worker.host_reduce); the engine routes them.
        self.on_push: Callable[[bytes, Push], None] = on_push or self._no_push
        # operations this rank started on a name (the engine counts them): a peer's collective
        # this rank has not entered means the ranks are out of step
        self.entered: Callable[[str], int] = entered or (lambda _name: 0)
        self._handlers = handlers({Gossip: self._on_gossip, GossipAck: self._on_ack, GossipWaiting: self._on_waiting,
                                   Push: lambda route, msg, _frames: self.on_push(route, msg)})

    def new_generation(self, book: Book) -> None:
        """Open the channel of ``book``'s generation and hand it what came early."""
        kept = {}
        if self.channel is not None:
            kept = self.channel.connections()  # the same peers keep their connections
            self.channel.close()
        addresses = {w.addr for w in book.workers}
        for addr in [a for a in kept if a not in addresses]:  # peers no longer in the job
            kept.pop(addr).close()
        self.channel = PeerChannel(self.ctx, self.uid, book.rank, book.workers, self.config, self.log,
                                   book.generation, kept, self.entered, self.segments)
        self.generation = book.generation
        early, self._early = self._early, []
        for route, msg, frames in early:
            try:
                self._on_gossip(route, msg, frames)
            except MALFORMED as exc:
                self._drops.dropped(exc)

    def drain(self) -> None:
        """Handle waiting peer messages (bounded: servers and the inbox go on)."""
        drain(self.sock, True, self._handlers, self._drops, 256)

    def _on_gossip(self, route: bytes, msg: Gossip, frames: list[zmq.Frame]) -> None:
        generation = msg.gen
        if generation > self.generation:  # the sender has its new book already
            size = sum(len(frame) for frame in frames)
            held = sum(len(frame) for _, _, early in self._early for frame in early)
            if generation > max(self.generation, self.next_generation) + 1 or len(self._early) >= MAX_EARLY \
                    or held + size > MAX_EARLY_BYTES:
                raise ProtocolError(f"gossip for generation {generation} while this worker is in "
                                    f"{self.generation} ({len(self._early)} messages, {held} bytes held): dropped")
            self._early.append((route, msg, frames))
        elif generation == self.generation:
            self.channel.on_message(route, msg, frames)

    @staticmethod
    def _no_push(route: bytes, _msg: Push) -> None:
        raise ProtocolError(f"a push from {route[:64]!r} to a worker that reduces nothing by host")

    def _on_ack(self, route: bytes, msg: GossipAck, _frames: list[zmq.Frame]) -> None:
        if msg.gen == self.generation:
            self.channel.on_ack(route, msg)

    def _on_waiting(self, route: bytes, msg: GossipWaiting, _frames: list[zmq.Frame]) -> None:
        if msg.gen == self.generation:  # advisory: another generation's is dropped, never kept
            self.channel.notices.on_waiting(self.channel.sender(route), msg)

    # -- commands from the training thread -----------------------------------------
    def send(self, command: PeerSend) -> None:
        """Send a gossip message."""
        try:
            self.channel.send(command.dst, command.header, command.arrays, command.staged)
        except ValueError as exc:
            self.log.error("%s", exc)

    def ack(self, command: PeerAck) -> None:
        """Acknowledge a peer's shared-memory message."""
        self.channel.ack(command.dst, command.segment)

    def expect(self, command: PeerExpect) -> None:
        """Wait for a round's messages."""
        self.channel.expect(command.tag, command.rnd, command.sources, command.future)

    def blocked(self, command: PeerBlocked) -> None:
        """Training is blocked in a gossip round or a collective (or no longer): tell the peers."""
        self.channel.notices.blocked(command.kind, command.name, command.seq, command.since, command.verdict)

    # -- failures and leaving -------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        """Fail waits whose peers are gone or silent for too long."""
        if self.channel is not None:
            self.channel.check_deadlines(now)

    def fail_all(self, error: BaseException) -> None:
        """Fail every wait of the current channel."""
        if self.channel is not None:
            self.channel.fail_all(error)

    def await_reads(self, scheduler_silent: bool) -> None:
        """Before leaving, give peers on this host a moment to read the last gossip we left in
        shared memory: unlinked before they map it, it would be lost (TCP messages linger)."""
        deadline = time.monotonic() + LEFT_GRACE
        while self.channel is not None and self.channel.unread() and not scheduler_silent:
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.info("leaving with %d gossip message(s) not read by peers", self.channel.unread())
                return
            if self.sock.poll(int(left * 1000) + 1):
                self.drain()

    def close(self) -> None:
        """Close the channel and the bound socket."""
        if self.channel is not None:
            self.channel.close()
        self.sock.close()  # lingers: a host leader's last answers to its locals go out
