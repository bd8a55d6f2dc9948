"""Message framing: one small msgpack header frame, then zero-copy payload frames.

On a ROUTER socket the peer's routing id comes first. Anything that does not parse
as a header map is reported as :class:`ProtocolError`; callers drop it and log, so a
malformed message never takes a server or the scheduler down.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from zmq.backend import Socket as _Backend

from ..errors import ProtocolError
from .security import route_matches_key

MAX_HEADER_BYTES = 1 << 20  # an address book for thousands of nodes still fits
# pyzmq's Python layer (send_multipart, recv_multipart, getsockopt) turns every flag into an enum
# and back: ~2 us a frame, most of what a small message costs here. Its compiled methods with
# plain int flags do the same work.
_send, _recv = _Backend.send, _Backend.recv
_SNDMORE = int(zmq.SNDMORE)
_packers = threading.local()  # msgpack.packb builds a Packer per call (~1 us): one per thread, reused


def pack_header(header: dict[str, Any]) -> bytes:
    """``header`` as msgpack bytes (what :func:`send_message` sends as the header frame)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


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
    head = pack_header(header)
    for index, payload in enumerate(payloads):  # before the first frame goes: never half a message
        if not isinstance(payload, (bytes, memoryview, zmq.Frame)):
            try:
                memoryview(payload)
            except TypeError:
                raise TypeError(f"payload {index} ({type(payload).__name__}) does not support the buffer "
                                "interface") from None
    flags = int(flags)
    more = flags | _SNDMORE
    if route is not None:
        _send(sock, route, more, False, track)
    if not payloads:
        return _send(sock, head, flags, False, track)
    _send(sock, head, more, False, track)
    last = len(payloads) - 1
    for index, payload in enumerate(payloads):
        tracker = _send(sock, payload, more if index < last else flags, False, track)
    return tracker


def recv_message(sock: zmq.Socket, routed: bool,
                 identified: bool = False) -> tuple[bytes | None, dict[str, Any], list[zmq.Frame]]:
    """Receive one message: (routing id or None, header, payload frames). ``identified``: a
    CURVE ROUTER, whose senders' routing ids must be their keys' (transport.security).

    Raises ProtocolError for a message that is not ours; the caller decides to drop it.
    """
    route = None
    head = _recv(sock, 0, False)
    if routed:
        if not head.more:
            raise ProtocolError("message without a header frame")
        route = head.bytes
        head = _recv(sock, 0, False)
    frames = []
    more = head.more
    while more:  # a frame's own flag: getsockopt(RCVMORE) costs ten times as much
        frame = _recv(sock, 0, False)
        frames.append(frame)
        more = frame.more
    if identified and not route_matches_key(route, head.get("User-Id")):
        raise ProtocolError(f"routing id {route[:64]!r} is not the one of the key its connection "
                            "authenticated with (a member presenting another's id?)")
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head.buffer, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header is not a map with an 'op' string")
    return route, header, frames


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
