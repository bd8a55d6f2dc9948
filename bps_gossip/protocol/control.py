"""The messages between the scheduler and the servers and workers (rendezvous, liveness,
barriers, elastic generations). See :mod:`bps_gossip.scheduler` for what each one means."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .. import fields
from ..errors import ProtocolError
from ..host_groups import HOST_REDUCE_MODES
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
    optional_integer,
    strings,
    text,
)

ROLES = ("worker", "server")
MAX_NODES = 1 << 16  # servers or workers in one address book


@message(Op.REGISTER)
class Register(Message):
    """A server or worker asks to join: who it is and where the others reach it."""

    role: str = text(16)
    addr: str = text(256, "")  # a server's endpoint
    host: str = text(256, "")
    pid: int = integer(0, 1 << 31, 0)
    start_ticks: int | None = optional_integer()  # with pid, proves the process is on this host
    worker_id: int | None = optional_integer(0, MAX_RANK)
    local_rank: int = integer(0, 1 << 16, 0)
    local_size: int = integer(1, 1 << 16, 1)
    peer_addr: str = text(256, "")  # a worker's gossip endpoint
    num_worker: int | None = optional_integer(wire="DMLC_NUM_WORKER")  # checked against the scheduler's
    num_server: int | None = optional_integer(wire="DMLC_NUM_SERVER")
    host_reduce: str = text(8, "off")  # a worker's BPS_GOSSIP_HOST_REDUCE, "off" if it cannot (hosts.py)

    def __post_init__(self) -> None:
        self._check(self.role in ROLES, f"cannot register role {self.role!r}")
        self._check(self.host_reduce in HOST_REDUCE_MODES, f"host_reduce {self.host_reduce!r} is not one of "
                                                           f"{HOST_REDUCE_MODES}")
        self._check(self.local_rank < self.local_size,
                    f"local_rank {self.local_rank} is not below local_size {self.local_size}")


@message(Op.HEARTBEAT)
class Heartbeat(Message):
    """I am alive (every BPS_GOSSIP_HEARTBEAT_INTERVAL); answered by :class:`HbAck`.
    ``progress``: a worker's count of operations its training has started so far (the
    scheduler's evidence that a rank reported as stuck is stuck)."""

    progress: int | None = optional_integer(0, fields.MAX_INT)


@message(Op.HB_ACK)
class HbAck(Message):
    """The scheduler is alive. Before the rendezvous completes it also says how many workers
    and servers have registered so far (a waiting process tells its user who is missing)."""

    workers: int | None = optional_integer(0, MAX_NODES)
    servers: int | None = optional_integer(0, MAX_NODES)


@message(Op.LEAVE)
class Leave(Message):
    """A node shuts down (``crashed``: because of an uncaught exception); answered by :class:`Bye`."""

    crashed: bool = flag(False)


@message(Op.BYE)
class Bye(Message):
    """The scheduler saw a node leave."""


@message(Op.REFUSED)
class Refused(Message):
    """The scheduler will not (or no longer) have this node, and why."""

    why: str = text(MAX_WHY, "")


@message(Op.WAIT)
class Wait(Message):
    """Elastic: a worker that registered while the job runs joins at its next commit."""

    why: str = text(MAX_WHY, "")


def _read_workers(msg: Mapping[str, Any], key: str) -> list[BookEntry]:
    value = msg.get(key)
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise ProtocolError(f"field {key!r} must be a list of at most {MAX_NODES} workers")
    return [BookEntry.read(entry) for entry in value]


def _host_reduce(entry: Mapping[str, Any]) -> str:
    mode = fields.text(entry, "host_reduce", 8, "off")
    if mode not in HOST_REDUCE_MODES:
        raise ProtocolError(f"field 'host_reduce'={mode!r} is not one of {HOST_REDUCE_MODES}")
    return mode


@dataclasses.dataclass(frozen=True)
class BookEntry:
    """One worker in the address book."""

    rank: int
    uid: str  # its routing id in hex: servers and peers know its messages by it
    addr: str  # its gossip endpoint
    host: str
    pid: int
    local_rank: int
    local_size: int
    host_reduce: str = "off"  # how it reduces with the workers on its host (bps_gossip.host_groups)

    @classmethod
    def read(cls, entry: Any) -> BookEntry:
        """Check one received entry."""
        if not isinstance(entry, dict):
            raise ProtocolError("an address book entry must be a map")
        uid = fields.text(entry, "uid", 256)
        try:
            bytes.fromhex(uid)
        except ValueError:
            raise ProtocolError(f"field 'uid'={uid[:64]!r} is not hex") from None
        return cls(rank=fields.integer(entry, "rank", 0, MAX_RANK), uid=uid, addr=fields.text(entry, "addr", 256),
                   host=fields.text(entry, "host", 256), pid=fields.integer(entry, "pid", 0, 1 << 31),
                   local_rank=fields.integer(entry, "local_rank", 0, 1 << 16),
                   local_size=fields.integer(entry, "local_size", 1, 1 << 16),
                   host_reduce=_host_reduce(entry))

    @property
    def routing_id(self) -> bytes:
        """The worker's routing id on every connection."""
        return bytes.fromhex(self.uid)


@message(Op.BOOK)
class AddressBook(Message):
    """Who is in the job's generation, and this node's rank in it (``restore``, elastic: roll
    back to the last commit, something crashed). On the wire: ``{"op": "book", "rank": r,
    "book": {"generation", "servers", "workers"}, "restore": bool}``."""

    rank: int = integer(0, MAX_RANK)
    generation: int = integer(0, fields.MAX_INT)
    servers: list[str] = strings(MAX_NODES, 256)
    workers: list[BookEntry] = custom(_read_workers)
    restore: bool = flag(False)

    def __post_init__(self) -> None:
        self._check(all(w.rank == index for index, w in enumerate(self.workers)), "workers out of rank order")

    @classmethod
    def decode(cls, header: Mapping[str, Any]) -> AddressBook:
        book = header.get("book")
        if not isinstance(book, dict):
            raise ProtocolError("book message: field 'book' must be a map")
        return super().decode({**book, "rank": header.get("rank"), "restore": header.get("restore", False)})

    def encode(self) -> dict[str, Any]:
        book = {"generation": self.generation, "servers": list(self.servers),
                "workers": [dataclasses.asdict(w) for w in self.workers]}
        return {"op": self.op.value, "rank": self.rank, "book": book, "restore": self.restore}


@message(Op.BARRIER)
class Barrier(Message):
    """A worker reached barrier ``seq``."""

    seq: int = integer(0, fields.MAX_INT, 0)


@message(Op.BARRIER_DONE)
class BarrierDone(Message):
    """Every worker reached barrier ``seq``."""

    seq: int = integer(0, fields.MAX_INT)


@message(Op.BARRIER_FAILED)
class BarrierFailed(Message):
    """Barrier ``seq`` cannot complete (a worker was lost or left)."""

    seq: int = integer(0, fields.MAX_INT)
    why: str = text(MAX_WHY, "")


@message(Op.COMMIT)
class Commit(Message):
    """Elastic: a worker's commit check ``seq`` (a barrier that says whether workers join)."""

    seq: int = integer(0, fields.MAX_INT, 0)


@message(Op.COMMIT_DONE)
class CommitDone(Message):
    """Every worker made commit check ``seq``; ``changed``: a new generation begins."""

    seq: int = integer(0, fields.MAX_INT)
    changed: bool = flag()


@message(Op.REJOIN)
class Rejoin(Message):
    """Elastic: a worker is ready for ``generation`` (``has_state``: it holds the job's state)."""

    generation: int = integer(0, fields.MAX_INT)
    has_state: bool = flag(True)


@message(Op.CHANGED)
class Changed(Message):
    """Elastic: generation ``generation`` begins; pending work of the old one fails."""

    generation: int = integer(0, fields.MAX_INT)
    restore: bool = flag(True)
    why: str = text(MAX_WHY, "")


@message(Op.FINISHED)
class Finished(Message):
    """Elastic: a worker finished training; the job admits nobody more."""


@message(Op.STALLED)
class Stalled(Message):
    """Elastic: ``ranks`` pushed or sent nothing while others waited (removed like lost ones)."""

    ranks: list[int] = integers(64, 0, MAX_RANK)
    generation: int = integer(0, fields.MAX_INT)
    why: str = text(512, "")


@dataclasses.dataclass(frozen=True)
class _NodeGone(Message):
    role: str = text(16)
    rank: int = integer(-1, MAX_RANK)  # -1: it never had one
    pid: int = integer(0, 1 << 31, 0)
    host: str = text(256, "")
    why: str = text(MAX_WHY, "")

    def describe(self, how: str) -> str:
        """'worker rank 2 (pid 123 on host) was lost: why'."""
        return f"{self.role} rank {self.rank} (pid {self.pid} on {self.host}) {how}: {self.why}"


@message(Op.NODE_LOST)
class NodeLost(_NodeGone):
    """A node died (or stopped answering); a job that is not elastic cannot go on."""


@message(Op.NODE_LEFT)
class NodeLeft(_NodeGone):
    """A node shut down gracefully."""


@message(Op.JOB_FAILED)
class JobFailed(Message):
    """The job failed (elastic: too few workers for too long), or ended before this worker was admitted."""

    why: str = text(MAX_WHY, "")


@message(Op.JOB_OVER)
class JobOver(Message):
    """Elastic: the job finished before this worker was admitted or got its state (it exits 0)."""

    why: str = text(MAX_WHY, "")


@message(Op.TERMINATE)
class Terminate(Message):
    """Every worker has gone: a server exits."""

    why: str = text(MAX_WHY, "")
