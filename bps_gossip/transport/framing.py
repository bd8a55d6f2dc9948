"""Message framing: one small msgpack header frame, then zero-copy payload frames.

On a ROUTER socket the peer's routing id comes first. Anything that does not parse
as a header map is reported as :class:`ProtocolError`; callers drop it and log, so a
malformed message never takes a server or the scheduler down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from ..errors import ProtocolError
from .security import route_matches_key

MAX_HEADER_BYTES = 1 << 20  # an address book for thousands of nodes still fits


def send_message(
    sock: zmq.Socket,
    header: dict[str, Any],
    payloads: Sequence[Any] = (),
    route: bytes | None = None,
    flags: int = 0,
    track: bool = False,
) -> zmq.MessageTracker | None:
    """Send ``header`` and ``payloads`` (buffers, sent without copying) on ``sock`` with ZeroMQ's
    send ``flags``; with ``track``, return the tracker that says when ZeroMQ is done with them."""
    frames: list[Any] = [] if route is None else [route]
    frames.append(msgpack.packb(header, use_bin_type=True))
    frames.extend(payloads)
    return sock.send_multipart(frames, flags, copy=False, track=track)


def recv_message(sock: zmq.Socket, routed: bool,
                 identified: bool = False) -> tuple[bytes | None, dict[str, Any], list[zmq.Frame]]:
    """Receive one message: (routing id or None, header, payload frames). ``identified``: a
    CURVE ROUTER, whose senders' routing ids must be their keys' (transport.security).

    Raises ProtocolError for a message that is not ours; the caller decides to drop it.
    """
    frames = sock.recv_multipart(copy=False)
    route = None
    if routed:
        if len(frames) < 2:
            raise ProtocolError("message without a header frame")
        route = frames[0].bytes
        frames = frames[1:]
        if identified and not route_matches_key(route, frames[0].get("User-Id")):
            raise ProtocolError(f"routing id {route[:64]!r} is not the one of the key its connection "
                                "authenticated with (a member presenting another's id?)")
    head = frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head.buffer, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header is not a map with an 'op' string")
    return route, header, frames[1:]


def endpoint_host(endpoint: str) -> str:
    """'tcp://host' of 'tcp://host:port': endpoints with the same one are on the same machine."""
    return endpoint.rsplit(":", 1)[0]


def bind_random_port(sock: zmq.Socket, host: str, port: int = 0, advertise: str | None = None) -> str:
    """Bind ``sock`` on ``host`` (a free port when ``port`` is 0); return the endpoint others
    connect to, on ``advertise`` when given (a socket bound on 0.0.0.0 is reached at this
    host's own address), else on ``host``."""
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{advertise or host}:{port}"
