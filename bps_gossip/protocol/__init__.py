"""The wire protocol: every op once (:class:`Op`), a typed message per op, one handler table per role.

A message is one msgpack header map whose ``op`` names its type, followed by payload frames
(:mod:`bps_gossip.transport.framing`). Everything received is untrusted: a role decodes a
header into its message class (:meth:`Message.decode`), which checks every field's type, range
and size through :mod:`bps_gossip.fields` and raises ProtocolError naming the op and the field.

A role's receive loop is a table from Op to handler, made by :func:`handlers`::

    table = handlers({Push: self._on_push, Stats: self._on_stats})
    drain(sock, True, table, drops, 256)   # each handler gets (route, typed message, frames)

A new message type is one class here (``@message(Op.NEW)``, its fields) and one entry in the
table of the role that receives it.
"""

from __future__ import annotations

from .base import MESSAGES, Handler, Message, Op, decode, handlers, message, op_of, send
from .control import (
    AddressBook,
    Barrier,
    BarrierDone,
    BarrierFailed,
    BookEntry,
    Bye,
    Changed,
    Commit,
    CommitDone,
    Finished,
    HbAck,
    Heartbeat,
    JobFailed,
    JobOver,
    Leave,
    NodeLeft,
    NodeLost,
    Refused,
    Register,
    Rejoin,
    Stalled,
    Terminate,
    Wait,
)
from .data import (
    ERROR_KINDS,
    Ack,
    Error,
    Gossip,
    GossipAck,
    GossipWaiting,
    Push,
    Result,
    Stats,
    wire_dtype,
)

__all__ = [
    "ERROR_KINDS", "MESSAGES", "Ack", "AddressBook", "Barrier", "BarrierDone", "BarrierFailed", "BookEntry",
    "Bye", "Changed", "Commit", "CommitDone", "Error", "Finished", "Gossip", "GossipAck", "GossipWaiting",
    "Handler", "HbAck", "Heartbeat", "JobFailed", "JobOver", "Leave", "Message", "NodeLeft", "NodeLost", "Op",
    "Push", "Refused", "Register", "Rejoin", "Result", "Stalled", "Stats", "Terminate", "Wait", "decode",
    "handlers", "message", "op_of", "send", "wire_dtype",
]
