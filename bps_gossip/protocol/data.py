"""The messages that carry tensors: a worker's push and a server's replies, and gossip between
workers. See :mod:`bps_gossip.server` and :mod:`bps_gossip.worker.peers`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import fields
from ..compression.pipeline import MAX_HEADER_FIELDS as MAX_CODEC_ENTRIES
from ..errors import ProtocolError
from .base import (
    MAX_RANK,
    MAX_WHY,
    Message,
    Op,
    custom,
    flag,
    integer,
    integers,
    message,
    number,
    optional_flag,
    optional_integer,
    optional_text,
    strings,
    text,
)
from .control import MAX_NODES

MAX_GENERATION = 1 << 40
MAX_ELEMENTS = 1 << 40
MAX_ARRAYS = 1024  # arrays in one gossip message
ERROR_KINDS = ("mismatch", "lost", "timeout", "protocol", "changed")
SMALL_PUSH_BYTES = 65536  # pushes up to this size are not acknowledged (and use no credit)
STORE_OPS = ("init", "add")  # a push to the servers' stored weights (asynchronous training)
MAX_STORE_INSTANCE = 1 << 31


def describe_signature(sig: Mapping[str, Any]) -> str:
    """'float32 (3, 4) sum' style text for error messages (a push's signature)."""
    return f"{sig['dtype']} {tuple(sig['shape'])} {sig['kind']}"


def partitions(count: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into (offset, length) pieces of at most ``partition_bytes``: what one
    push carries of a tensor (BYTEPS_PARTITION_BYTES).

    A zero-size tensor still has one (empty) partition, so every rank takes part in the
    round and a shape mismatch is still detected.
    """
    per_part = max(1, partition_bytes // itemsize)
    if count == 0:
        return [(0, 0)]
    return [(start, min(per_part, count - start)) for start in range(0, count, per_part)]


_KNOWN_DTYPES = {np.dtype(t).str: np.dtype(t) for t in
                 ("float16", "float32", "float64", "uint8", "uint16", "uint32", "uint64", "int8", "int32", "int64")}


def held_bytes(push: Push) -> int:
    """What holding a push's header costs in memory, at most (its payload not counted)."""
    texts = len(push.name) + len(push.kind) + len(push.shm or "") + len(push.wire) + len(push.dtype)
    codec = 2 * MAX_CODEC_TEXT * MAX_CODEC_ENTRIES if push.codec is not None else 0
    return HEADER_BYTES + 4 * texts + 8 * len(push.shape) + codec  # 4: a character's worst case


def wire_dtype(name: str, what: str = "wire dtype") -> np.dtype:
    """The numpy dtype a message names, if it is one tensors travel as (float, int, uint, bool)."""
    dtype = _KNOWN_DTYPES.get(name)  # every push names one: parsing it each time costs ~3 us
    if dtype is not None:
        return dtype
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        raise ProtocolError(f"{what} {name[:32]!r} is no dtype") from None
    if dtype.kind not in "fiub":
        raise ProtocolError(f"unsupported {what} {dtype}")
    return dtype


MAX_CODEC_TEXT = 64  # characters of a codec map's key or text value
HEADER_BYTES = 512  # what a push's header costs to hold beyond its texts and shape (a bound)


def _codec_spec(msg: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """The codec map, bounded in size before anything holds it: short text keys, scalar values.
    Its fields are read by compression.codec_from_header, which builds the codec."""
    spec = msg.get(key)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ProtocolError(f"field {key!r} must be a map")
    if len(spec) > MAX_CODEC_ENTRIES:
        raise ProtocolError(f"field {key!r} has {len(spec)} entries, more than {MAX_CODEC_ENTRIES}")
    for name, value in spec.items():
        if not isinstance(name, str) or len(name) > MAX_CODEC_TEXT:
            raise ProtocolError(f"field {key!r}: its keys must be texts of at most {MAX_CODEC_TEXT} characters")
        if isinstance(value, str) and len(value) > MAX_CODEC_TEXT:
            raise ProtocolError(f"field {key!r}.{name}: a text of {len(value)} characters, more than {MAX_CODEC_TEXT}")
        if value is not None and not isinstance(value, (str, bool, int, float)):
            raise ProtocolError(f"field {key!r}.{name} must be a number, flag or text")
    return spec


@message(Op.PUSH)
class Push(Message):
    """One partition of a worker's tensor for one round; the payload is the one frame that
    follows, or (``shm``) a region of the worker's own shared-memory segment on this host.
    A small push (``ack`` false) gets no acknowledgement: its result is the answer."""

    req: int = integer()  # the worker's request id, echoed in every reply
    gen: int = integer(0, MAX_GENERATION)
    key: int = integer()
    part: int = integer(0, 1 << 32)
    seq: int = integer()  # the round number of this tensor on this worker
    name: str = text(1024)
    count: int = integer(0, MAX_ELEMENTS)  # elements of the wire dtype
    wire: str = text(16)  # the dtype on the wire
    dtype: str = text(16)  # the tensor's own dtype, shape and operation: every rank must agree
    shape: list[int] = integers(32)
    kind: str = text(1024)
    ack: bool = flag(True)
    codec: dict[str, Any] | None = custom(_codec_spec, None)  # compressed: the codec's parameters
    shm: str | None = optional_text(256)  # the worker's segment holding the payload
    offset: int | None = optional_integer(0, MAX_ELEMENTS)  # byte offset of the payload in it
    hosted: bool = flag(False)  # a host leader's sum (bps_gossip.host_groups)
    rows: bool = flag(False)  # one row per worker: the server keeps of a push only its sender's row
    root: int | None = optional_integer(0, MAX_NODES)  # a broadcast pushed to a server: it takes only this rank's payload
    # Asynchronous training (bps_gossip.server.async_store): 'init' starts the stored weights of this
    # partition (instance ``instance``) from the payload, 'add' adds the payload to them; either way
    # the reply is the stored weights, at once, with no round.
    store: str | None = optional_text(8)
    instance: int = integer(0, MAX_STORE_INSTANCE, 0)

    def __post_init__(self) -> None:
        dtype = wire_dtype(self.wire)
        if self.store is not None:
            self._check(self.store in STORE_OPS, f"store={self.store!r} is none of {STORE_OPS}")
            self._check(self.codec is None and not self.hosted and not self.rows and self.root is None,
                        "a push to the stored weights is not compressed, not a host's sum, not rows, no broadcast")
            self._check(dtype.kind == "f", f"the stored weights are floats, not {dtype}")
        if self.root is not None:
            self._check(self.codec is None and not self.hosted and not self.rows,
                        "a broadcast is not compressed, not a host's sum, not a rows push")
        if self.rows:  # bps_gossip.collectives.gather_rows: the whole tensor in one partition, pushed as is
            self._check(self.codec is None and not self.hosted and self.part == 0 and len(self.shape) == 2
                        and self.count == self.shape[0] * self.shape[1], "a rows push is one whole 2-d tensor, "
                        "not compressed, not a host's sum")
        self.__dict__["wire"] = dtype.str  # one spelling per dtype: rounds compare it
        if self.shm is not None and self.offset is None:  # (tests first: every push comes here)
            self._check(False, "a shared-memory push needs an offset")
        if self.codec is not None:
            self._check(self.shm is None and dtype == np.uint8, "compressed pushes come as uint8 frames")
            self._check(not self.hosted, "a host's sum is never compressed")

    @staticmethod
    def header(**values: Any) -> dict[str, Any]:
        """A push's header without building the message: the worker sends one per partition, and
        a frozen message costs ten times the dict (the server decodes, so checks, every one)."""
        return {"op": Op.PUSH.value, **values}

    @property
    def signature(self) -> dict[str, Any]:
        """What every rank's push of this round must agree on (besides wire and count)."""
        return {"dtype": self.dtype, "shape": self.shape, "kind": self.kind}

    @property
    def nbytes(self) -> int:
        """Bytes of the payload."""
        return self.count * wire_dtype(self.wire).itemsize

    def check_payload(self, frames: list[Any]) -> None:
        """A push over TCP carries exactly its payload in one frame."""
        size = len(frames[0]) if frames else 0
        if self.shm is None and size != self.nbytes:
            raise ProtocolError(f"push: payload of {size} bytes does not hold {self.count} x {self.wire}")


@message(Op.ACK)
class Ack(Message):
    """A server received push ``req`` (the worker's credit comes back)."""

    req: int = integer()


@message(Op.RESULT)
class Result(Message):
    """The sum of push ``req``'s round: in the frame that follows, or (``shm``) in the worker's
    own shared-memory region of the push."""

    req: int = integer()
    shm: bool | None = optional_flag()


@message(Op.ERROR)
class Error(Message):
    """Push ``req`` failed: ``kind`` is one of ERROR_KINDS (the worker raises the matching error)."""

    req: int = integer()
    kind: str = text(16)
    why: str = text(MAX_WHY, "")


def _parts(msg: Mapping[str, Any], key: str) -> dict[str, list[int]] | None:
    value = msg.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 1 << 20:
        raise ProtocolError(f"field {key!r} must be a map of at most {1 << 20} tensors")
    parts = {}
    for name in value:
        if not isinstance(name, str) or len(name) > 32:
            raise ProtocolError(f"field {key!r} has a key that is no tensor key")
        parts[name] = fields.integers(value, name, 1 << 20, 0, 1 << 32)
    return parts


@message(Op.STATS)
class Stats(Message):
    """A worker asks a server what it has seen (tests and tools), and the server's answer
    (the same op, with every field set): its rank, the partitions it saw per key, rounds, and
    the pushes it took by rank with the payload bytes that came over sockets."""

    req: int = integer()
    rank: int | None = optional_integer(0, MAX_RANK)
    parts: dict[str, list[int]] | None = custom(_parts, None)
    rounds_done: int | None = optional_integer()
    open_rounds: int | None = optional_integer()
    pushes: list[int] | None = integers(MAX_NODES, 0, fields.MAX_INT, optional=True)  # by rank of the book
    socket_bytes: int | None = optional_integer()

    def reply(self) -> dict[str, Any]:
        """The answer's fields but op and req (what a worker's stats() returns per server)."""
        return {"rank": self.rank, "parts": self.parts, "rounds_done": self.rounds_done,
                "open_rounds": self.open_rounds, "pushes": self.pushes, "socket_bytes": self.socket_bytes}


@message(Op.GOSSIP)
class Gossip(Message):
    """One round of one gossip (``tag``) from a peer: arrays in the frames that follow, or (``shm``)
    at ``offsets`` in the sender's own shared-memory segment. ``keys`` name the arrays and
    ``weight`` is push-sum's weight share (the gossip cores read them); ``sent`` the sender's
    wall clock when it sent (routing sums it both ways over a pair: the clocks' offset cancels)."""

    tag: str = text(256)
    round: int = integer(0, 1 << 62)
    dtypes: list[str] = strings(MAX_ARRAYS, 16)
    counts: list[int] = integers(MAX_ARRAYS, 0, MAX_ELEMENTS)
    gen: int = integer(0, fields.MAX_INT, 0)
    keys: list[str] | None = strings(MAX_ARRAYS, 1024, optional=True)
    weight: float | None = number(optional=True)
    shm: str | None = optional_text(256)
    offsets: list[int] | None = integers(MAX_ARRAYS, 0, MAX_ELEMENTS, optional=True)
    sent: float | None = number(optional=True)

    def __post_init__(self) -> None:
        self._check(len(self.dtypes) == len(self.counts), f"{len(self.dtypes)} dtypes but {len(self.counts)} counts")
        self._check(self.keys is None or len(self.keys) == len(self.dtypes),
                    f"{len(self.keys or ())} keys but {len(self.dtypes)} arrays")
        self._check(self.shm is None or (self.offsets is not None and len(self.offsets) == len(self.dtypes)),
                    "a shared-memory gossip message needs one offset per array")
        for name in self.dtypes:
            wire_dtype(name, "gossip dtype")


@message(Op.GOSSIP_ACK)
class GossipAck(Message):
    """A peer read our shared-memory segment ``shm``: it may be reused."""

    shm: str = text(256)
    gen: int = integer(0, fields.MAX_INT, 0)


WAITING_KINDS = ("gossip", "collective", "none")
MAX_WAITED = 1e9  # seconds: no wait of this job lasts longer


@message(Op.GOSSIP_WAITING)
class GossipWaiting(Message):
    """Where the sender's training has been blocked for ``waited`` seconds: kind 'gossip', in round
    ``seq`` of gossip ``name``, missing the messages of the ranks ``waits_for``; 'collective', in
    push_pull ``name``, its ``seq``-th use of the name (from 0); 'none': no longer there.
    ``behind`` and ``behind_seq`` (gossip): the receiver's collective that the sender has not
    reached and, blocked, cannot: the ranks are out of step. Advisory (bps_gossip.worker.peers)."""

    kind: str = text(16)
    name: str = text(1024)
    seq: int = integer(0, 1 << 62)
    waited: float = number(0.0)
    gen: int = integer(0, MAX_GENERATION, 0)
    waits_for: list[int] | None = integers(MAX_NODES, 0, MAX_RANK, optional=True)
    behind: str | None = optional_text(1024)
    behind_seq: int | None = optional_integer(0, 1 << 62)

    def __post_init__(self) -> None:
        self._check(self.kind in WAITING_KINDS, f"kind {self.kind!r} is none of {WAITING_KINDS}")
        self._check(0.0 <= self.waited <= MAX_WAITED, f"waited={self.waited} is outside [0, {MAX_WAITED:g}] s")
        self._check((self.behind is None) == (self.behind_seq is None), "behind and behind_seq come together")
        self._check(self.behind is None or self.kind == "gossip", "only a gossip wait is behind a collective")
        self._check(self.waits_for is None or self.kind == "gossip", "only a gossip wait waits for ranks")
