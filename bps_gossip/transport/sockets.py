"""Every socket of every role is made here: its kind, CURVE side, queue limits, frame limit,
linger and identity in one place (the reasons beside each).

    sock = open_socket(ctx, SocketRole.SERVER, config)                  # then bind
    link = open_socket(ctx, SocketRole.TO_SCHEDULER, config, identity)  # then connect

Bound sockets (ROUTERs) serve CURVE with the job's keys, connecting ones (DEALERs) present
them (:mod:`bps_gossip.transport.security`); without BPS_GOSSIP_SECRET they are plain.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import zmq

from ..config import Config
from .framing import MAX_HEADER_BYTES
from .security import make_socket

MAX_CONTROL_BYTES = 4 * MAX_HEADER_BYTES  # the largest message the scheduler accepts
MIN_MAX_FRAME = 64 << 20  # a server's frame limit is at least this
# A bound socket closes a connection that has not completed its handshake by then (ZeroMQ's
# default is 30 s): idle connections from anyone would otherwise hold a descriptor each.
HANDSHAKE_MS = 5000
MAX_QUEUED_REPLIES = 2 << 16  # a server's send mark a connection (see SocketRole.SERVER below)


class SocketRole(enum.Enum):
    """What a socket is for."""

    SCHEDULER = "scheduler"  # the scheduler's ROUTER: every server and worker registers on it
    SERVER = "server"  # a server's ROUTER: workers push to it
    TO_SCHEDULER = "to_scheduler"  # a server's or worker's DEALER to the scheduler
    TO_SERVER = "to_server"  # a worker's DEALER to one server
    PEER = "peer"  # a worker's ROUTER for gossip from its peers
    TO_PEER = "to_peer"  # a worker's DEALER to one peer


@dataclasses.dataclass(frozen=True)
class _Spec:
    kind: int
    serve: bool  # binds (CURVE server) rather than connects
    linger_ms: int
    unbounded: bool = False  # no high-water marks (see below)
    unbounded_send: bool = False  # no send high-water mark
    send_limit: int | None = None  # the send high-water mark, in messages a connection
    mandatory: bool = False  # ROUTER_MANDATORY: a send to a full or unknown peer raises
    needs_identity: bool = False  # the receiver knows the sender by its routing id
    max_frame: Callable[[Config], int] | None = None  # a larger frame drops the connection


_SPECS: dict[SocketRole, _Spec] = {
    # Only small control messages: a larger one drops its sender's connection before anything
    # is allocated for it.
    # No ROUTER_HANDOVER on any socket: with it, a new connection that presents a member's routing id
    # (every member reads them in the address book) took that id over, and with it the member's
    # rank. Without it, a ROUTER refuses a connection whose id is in use.
    SocketRole.SCHEDULER: _Spec(zmq.ROUTER, True, 1000, max_frame=lambda _c: MAX_CONTROL_BYTES),
    # Replies: a worker's DEALER reads everything that arrives (no receive mark), so what queues
    # here for one connection is what the link has not carried yet, or what a member that stopped
    # reading left behind. ROUTER_MANDATORY makes a full queue an error the server handles
    # (bps_gossip.server.outbox: the reply is dropped and counted) where a ROUTER would drop it
    # silently; sends never block. MAX_QUEUED_REPLIES is as many replies as a worker can have
    # waiting (an Ack and a Result for each of the 65,536 rounds a server keeps open for it).
    # Inbound, ZeroMQ's default mark (1,000 messages a connection) holds: a full queue stops reading
    # that connection (TCP pushes back, its sender queues on its own side) and drops nothing, so a
    # sender faster than the server cannot grow the server's memory without end.
    SocketRole.SERVER: _Spec(zmq.ROUTER, True, 0, send_limit=MAX_QUEUED_REPLIES, mandatory=True,
                             max_frame=lambda c: server_frame_limit(c)),
    # Lingers a moment so that a server's last message (a leave) still goes out.
    SocketRole.TO_SCHEDULER: _Spec(zmq.DEALER, False, 1000, needs_identity=True),
    # No high-water mark: a full queue would block the worker's engine thread (no heartbeats,
    # no replies read) on send; credit bounds large partitions, the caller's arrays the rest.
    SocketRole.TO_SERVER: _Spec(zmq.DEALER, False, 0, unbounded=True, needs_identity=True),
    # A ROUTER drops what exceeds its send high-water mark: a host leader's answers to its locals'
    # pushes (worker.host_reduce) are bounded by what they pushed, like a server's.
    # It lingers so that a leader's last answers still reach its locals after it shut down.
    SocketRole.PEER: _Spec(zmq.ROUTER, True, 1000, unbounded_send=True,
                           max_frame=lambda c: c.max_message_bytes + MAX_HEADER_BYTES),
    # Lingers so that the last gossip round reaches its peers after shutdown.
    SocketRole.TO_PEER: _Spec(zmq.DEALER, False, 2000, needs_identity=True),
}


def server_frame_limit(config: Config) -> int:
    """The largest payload a server takes, as a frame or in shared memory."""
    return max(2 * config.partition_bytes, MIN_MAX_FRAME)


def open_socket(ctx: zmq.Context, role: SocketRole, config: Config, identity: bytes | None = None) -> zmq.Socket:
    """A new socket for ``role``, set up before bind/connect; ``identity`` (the routing id others
    know this process by) is required for the DEALERs."""
    spec = _SPECS[role]
    if spec.needs_identity and not identity:
        raise ValueError(f"a {role.value} socket needs an identity")
    sock = make_socket(ctx, spec.kind, config.keys, serve=spec.serve)
    sock.setsockopt(zmq.LINGER, spec.linger_ms)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if spec.unbounded:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    if spec.unbounded_send:
        sock.setsockopt(zmq.SNDHWM, 0)
    if spec.send_limit is not None:
        sock.setsockopt(zmq.SNDHWM, spec.send_limit)
    if spec.mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if spec.max_frame is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, spec.max_frame(config))
    if spec.serve:
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    return sock
