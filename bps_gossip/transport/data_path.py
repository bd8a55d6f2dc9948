"""How a payload reaches one destination, chosen once when the destination is connected.

Two paths exist between processes, and which one a destination takes depends only on where it
runs, never on the message:

- **frames**: the payload follows the header as ZeroMQ frames (zero-copy on the sending side),
  for a destination on another host, or one that cannot map this host's shared memory;
- **shared memory**: the payload already lies in a segment the sender owns, and the header names
  that segment and where in it (``shm``, ``offset``/``offsets``); only the header crosses the socket.

A :class:`Route` is that choice for one destination: the worker's server links hold one per
server and a local one to its host leader, the peer channel one per peer (made at its first
message; the gossip core asks ``is_local`` before it stages a share in a segment), and each sends
every payload through it. A server answers on the path the push came: a sum already written back
into the pusher's region goes as a bare header, any other as frames. The receiving side maps a
named region only if it belongs to the process that sent the message
(:meth:`~bps_gossip.transport.shm.AttachedSegments.owned_view`): the server's rounds, the host
leader's rounds and the peer channel read payloads that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from .framing import send_message


@dataclasses.dataclass(frozen=True)
class Route:
    """The socket to one destination and whether it reads this host's shared memory."""

    sock: zmq.Socket
    shared: bool  # the destination maps segments of this host: payloads in one go by name

    def by_name(self, in_segment: Mapping[str, Any] | None) -> bool:
        """Whether a payload that lies where ``in_segment`` says (None: in no segment) goes by name:
        then the caller need not make its frames."""
        return self.shared and in_segment is not None

    def send(self, header: dict[str, Any], frames: Sequence[Any], in_segment: Mapping[str, Any] | None = None,
             route: bytes | None = None) -> bool:
        """Send ``header`` and its payload: by name (``in_segment``: the header fields that say where
        it lies, for a payload already in this process's segment) where the destination reads shared
        memory, else as ``frames``. True if it went by name."""
        if self.by_name(in_segment):
            header.update(in_segment)
            send_message(self.sock, header, (), route)
            return True
        send_message(self.sock, header, frames, route)
        return False
