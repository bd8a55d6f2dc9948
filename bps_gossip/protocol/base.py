"""What every message is: an op, typed fields read through :mod:`bps_gossip.fields`, a table entry.

A message class is a frozen dataclass whose fields say how they are read from the wire
(``integer(0, 100)``, ``text(256)``, ...). ``decode`` reads a received header field by field
(decoding is validating: a wrong type, a value out of range, a non-finite number, a string or
list too long all raise :class:`~bps_gossip.errors.ProtocolError` naming the op and the field);
``encode`` gives the header dict to send. Unknown fields are ignored, so either side may add
one without breaking the other.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Dict, List, TypeVar

from .. import fields
from ..errors import ProtocolError
from ..transport.framing import send_message

_REQUIRED = object()
MAX_WHY = 1 << 16  # characters of an explanation ('why')
MAX_RANK = 1 << 20
Reader = Callable[[Dict[str, Any], str], Any]  # (header, field) -> value


class Op(str, enum.Enum):
    """Every op any role sends. A member is its own wire string: ``Op.PUSH == "push"``, a table
    keyed by ``Op.PUSH`` finds ``"push"`` and vice versa, and msgpack packs it as that string."""

    # a server or worker to the scheduler
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    LEAVE = "leave"
    BARRIER = "barrier"
    COMMIT = "commit"
    REJOIN = "rejoin"
    FINISHED = "finished"
    STALLED = "stalled"
    # the scheduler to a server or worker
    HB_ACK = "hb_ack"
    REFUSED = "refused"
    WAIT = "wait"
    BOOK = "book"
    BYE = "bye"
    BARRIER_DONE = "barrier_done"
    BARRIER_FAILED = "barrier_failed"
    COMMIT_DONE = "commit_done"
    CHANGED = "changed"
    NODE_LOST = "node_lost"
    NODE_LEFT = "node_left"
    JOB_FAILED = "job_failed"
    JOB_OVER = "job_over"
    TERMINATE = "terminate"
    # a worker and a server
    PUSH = "push"
    ACK = "ack"
    RESULT = "result"
    ERROR = "error"
    STATS = "stats"
    # worker to worker
    GOSSIP = "gossip"
    GOSSIP_ACK = "gossip_ack"
    GOSSIP_WAITING = "gossip_waiting"

    def __str__(self) -> str:
        return self.value


def _field(read: Reader, default: Any, wire: str | None, fast: tuple[Any, ...] | None = None) -> Any:
    """``fast``: the check the generated decoder inlines (see _compile_decoder); any value it
    does not accept goes to ``read``, which returns a default or raises the error."""
    extra = {} if default is _REQUIRED else {"default": default}
    return dataclasses.field(metadata={"read": read, "wire": wire, "fast": fast}, **extra)


def integer(low: int = 0, high: int = fields.MAX_INT, default: Any = _REQUIRED, wire: str | None = None) -> Any:
    """An int field in [low, high] (required unless ``default`` is given)."""
    extra = () if default is _REQUIRED else (default,)

    def read(msg: Mapping[str, Any], key: str) -> int:
        value = msg.get(key)
        if type(value) is int and low <= value <= high:  # a push has a dozen: spare the call
            return value
        return fields.integer(msg, key, low, high, *extra)  # a default, or the error naming the field
    return _field(read, default, wire, ("int", low, high))


def optional_integer(low: int = 0, high: int = fields.MAX_INT, wire: str | None = None) -> Any:
    """An int field in [low, high], or None (absent or nil)."""
    return _field(lambda m, k: fields.optional_integer(m, k, low, high), None, wire, ("int?", low, high))


def text(max_chars: int = 256, default: Any = _REQUIRED, wire: str | None = None) -> Any:
    """A str field of at most ``max_chars`` characters."""
    extra = () if default is _REQUIRED else (default,)

    def read(msg: Mapping[str, Any], key: str) -> str:
        value = msg.get(key)
        if type(value) is str and len(value) <= max_chars:
            return value
        return fields.text(msg, key, max_chars, *extra)
    return _field(read, default, wire, ("str", max_chars))


def optional_text(max_chars: int = 256) -> Any:
    """A str field of at most ``max_chars`` characters, or None (absent or nil)."""
    return _field(lambda m, k: None if m.get(k) is None else fields.text(m, k, max_chars), None, None,
                  ("str?", max_chars))


def flag(default: Any = _REQUIRED) -> Any:
    """A bool field."""
    if default is _REQUIRED:
        return _field(fields.flag, default, None, ("bool",))
    return _field(lambda m, k: fields.flag(m, k, default), default, None, ("bool",))


def optional_flag() -> Any:
    """A bool field, or None (absent or nil)."""
    return _field(lambda m, k: None if m.get(k) is None else fields.flag(m, k), None, None, ("bool?",))


def number(default: Any = _REQUIRED, optional: bool = False) -> Any:
    """A finite float field (an int is taken as one); with ``optional``, None too."""
    if optional:
        return _field(lambda m, k: None if m.get(k) is None else fields.number(m, k), None, None)
    if default is _REQUIRED:
        return _field(fields.number, default, None)
    return _field(lambda m, k: fields.number(m, k, default), default, None)


def integers(max_items: int, low: int = 0, high: int = fields.MAX_INT, optional: bool = False) -> Any:
    """A list of at most ``max_items`` ints in [low, high]; with ``optional``, None too."""
    def read(msg: Mapping[str, Any], key: str) -> list[int] | None:
        value = msg.get(key)
        if optional and value is None:
            return None
        if type(value) is list and len(value) <= max_items:  # the common case, without a call per item
            for item in value:
                if type(item) is not int or not low <= item <= high:
                    break
            else:
                return value
        return fields.integers(msg, key, max_items, low, high)
    return _field(read, None if optional else _REQUIRED, None)


def strings(max_items: int, max_chars: int = 256, optional: bool = False) -> Any:
    """A list of at most ``max_items`` strings of at most ``max_chars``; with ``optional``, None too."""
    def read(msg: Mapping[str, Any], key: str) -> list[str] | None:
        if optional and msg.get(key) is None:
            return None
        return fields.strings(msg, key, max_items, max_chars)
    return _field(read, None if optional else _REQUIRED, None)


def custom(read: Reader, default: Any = _REQUIRED) -> Any:
    """A field read by ``read(msg, key)``, which raises ProtocolError for a bad value."""
    return _field(read, default, None)


@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every message class; see the module docstring."""

    op: ClassVar[Op]
    _spec: ClassVar[tuple[tuple[str, str, Reader], ...]] = ()
    _wire_op: ClassVar[str] = ""
    _read_fields: ClassVar[Callable[[Mapping[str, Any]], dict[str, Any]]]
    _defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def decode(cls: type[M], header: Mapping[str, Any]) -> M:
        """Read and check a received header; ProtocolError (naming op and field) if it is bad."""
        try:
            # Every field's reader gives its value or default, so the dataclass __init__ (one
            # frozen setattr per field: most of the time of a small push) has nothing to add.
            msg = object.__new__(cls)
            msg.__dict__.update(cls._read_fields(header))
            post = getattr(msg, "__post_init__", None)
            if post is not None:
                post()
            return msg
        except ProtocolError as exc:
            raise ProtocolError(f"{cls.op.value} message: {exc}") from None

    @classmethod
    def made(cls: type[M], **values: Any) -> M:
        """A message this process makes itself, without the checks of the dataclass __init__
        (a server makes two replies a round: ~1 us each saved). Fields not given get their defaults."""
        msg = object.__new__(cls)
        msg.__dict__.update(cls._defaults)
        msg.__dict__.update(values)
        return msg

    def encode(self) -> dict[str, Any]:
        """The header to send (fields that are None are left out)."""
        header: dict[str, Any] = {"op": self._wire_op}
        values = self.__dict__
        for name, wire, _ in self._spec:
            value = values[name]
            if value is not None:
                header[wire] = value
        return header

    def _check(self, ok: bool, why: str) -> None:
        """Raise ProtocolError unless ``ok`` (for rules between fields, in __post_init__)."""
        if not ok:
            raise ProtocolError(f"{self.op.value} message: {why}")


M = TypeVar("M", bound=Message)
MESSAGES: dict[Op, type[Message]] = {}


def message(op: Op) -> Callable[[type[M]], type[M]]:
    """Class decorator: make a frozen dataclass of ``cls``, the message class of ``op``."""
    def wrap(cls: type[M]) -> type[M]:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.op = op
        cls._wire_op = op.value  # a plain str: what msgpack packs, without the enum's lookup
        cls._spec = tuple((f.name, f.metadata.get("wire") or f.name, f.metadata["read"])
                          for f in dataclasses.fields(cls))
        cls._defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        cls._read_fields = staticmethod(_compile_decoder(cls.__name__, [
            (f.name, f.metadata.get("wire") or f.name, f.metadata["read"], f.metadata.get("fast"), f.default)
            for f in dataclasses.fields(cls)]))
        if op in MESSAGES:
            raise TypeError(f"two message classes for {op!r}: {MESSAGES[op].__name__} and {cls.__name__}")
        MESSAGES[op] = cls
        return cls
    return wrap


# The inlined form of each reader's accepting test (the readers above test the same first). A value
# that fails it goes to the reader itself: the default, or the ProtocolError naming the field.
_ACCEPTS = {
    "int": "type({v}) is int and {0} <= {v} <= {1}",
    "int?": "{v} is None or type({v}) is int and {0} <= {v} <= {1}",
    "str": "type({v}) is str and len({v}) <= {0}",
    "str?": "{v} is None or type({v}) is str and len({v}) <= {0}",
    "bool": "type({v}) is bool",
    "bool?": "{v} is None or type({v}) is bool",
}


def _compile_decoder(name: str, spec: list[tuple[str, str, Reader, tuple[Any, ...] | None, Any]]
                     ) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """One function that reads every field of a message class in order: the common checks
    inline, one reader call only for a value they do not accept (or a custom field); an absent
    field with a default gets it, as its reader would give it. A push has sixteen fields; a call
    per field was most of the time a server spends on one."""
    lines = ["def read_fields(header):", "    get = header.get"]
    env: dict[str, Any] = {"ABSENT": _REQUIRED}
    for index, (_, wire, read, fast, default) in enumerate(spec):
        value, reader = f"v{index}", f"read{index}"
        env[reader] = read
        if fast is None:
            lines.append(f"    {value} = {reader}(header, {wire!r})")
            continue
        kind, *bounds = fast
        if not all(type(bound) is int for bound in bounds):
            raise TypeError(f"{name}.{wire}: bounds {bounds!r} are not integers")
        accepts = _ACCEPTS[kind].format(*bounds, v=value)
        if default is dataclasses.MISSING:
            lines.append(f"    {value} = get({wire!r})")
            lines.append(f"    if not ({accepts}):")
        else:
            env[f"default{index}"] = default
            lines.append(f"    {value} = get({wire!r}, ABSENT)")
            lines.append(f"    if {value} is ABSENT:")
            lines.append(f"        {value} = default{index}")
            lines.append(f"    elif not ({accepts}):")
        lines.append(f"        {value} = {reader}(header, {wire!r})")
    pairs = ", ".join(f"{field!r}: v{index}" for index, (field, *_) in enumerate(spec))
    lines.append(f"    return {{{pairs}}}")
    exec("\n".join(lines), env)  # noqa: S102 - our own text, built from the class's field specs
    return env["read_fields"]


def op_of(header: Mapping[str, Any]) -> Op:
    """The header's op; ProtocolError for one no role knows."""
    try:
        return Op(header.get("op"))
    except ValueError:
        raise ProtocolError(f"unknown op {header.get('op')!r}") from None


def decode(header: Mapping[str, Any]) -> Message:
    """The typed message of any header; ProtocolError for an unknown op or a bad field."""
    return MESSAGES[op_of(header)].decode(header)


Frames = List[Any]
Handler = Callable[[Any, Any, Frames], None]  # (routing id or None, typed message, payload frames)
OnMalformed = Callable[[Any, Dict[str, Any], ProtocolError], None]


def handlers(entries: Mapping[type[Message], Handler],
             malformed: Mapping[type[Message], OnMalformed] | None = None) -> dict[Op, Callable[..., None]]:
    """One role's handler table, keyed by Op, for :func:`bps_gossip.transport.receive.drain`.

    Each entry decodes the header into its message class before calling the handler with
    (route, message, frames). A header that fails to decode is dropped by drain (with a log
    line), or given to ``malformed[cls](route, header, error)`` when the role must answer it
    (a push whose sender waits for a reply).
    """
    malformed = malformed or {}
    table: dict[Op, Callable[..., None]] = {}
    for cls, handle in entries.items():
        table[cls.op] = _entry(cls, handle, malformed.get(cls))
    return table


def _entry(cls: type[Message], handle: Handler, bad: OnMalformed | None) -> Callable[..., None]:
    if bad is None:
        def entry(route: Any, header: dict[str, Any], frames: Frames) -> None:
            handle(route, cls.decode(header), frames)
        return entry

    def answered(route: Any, header: dict[str, Any], frames: Frames) -> None:
        try:
            msg = cls.decode(header)
        except ProtocolError as exc:
            bad(route, header, exc)
            return
        handle(route, msg, frames)
    return answered


def send(sock: Any, msg: Message, payloads: Any = (), route: bytes | None = None, flags: int = 0,
         track: bool = False) -> Any:
    """Send ``msg`` (and zero-copy ``payloads``) on ``sock``; ``route``: to that peer of a ROUTER.
    ``flags`` and ``track``: as :func:`bps_gossip.transport.framing.send_message`."""
    return send_message(sock, msg.encode(), payloads, route, flags, track)
