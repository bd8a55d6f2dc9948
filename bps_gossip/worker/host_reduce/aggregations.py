"""A host leader's side of one push per host (bps_gossip.host_groups): the partitions the other
workers of this host push to it, summed with its own before one push goes to the servers.

A local worker pushes a partition to its leader's peer socket exactly as it would push to a
server on this host: a ``Push`` header naming a region of its own shared-memory segment.
The leader keeps a host round per (generation, tensor, partition, round); once its own
partition and every local's are in (with the same dtype, shape, operation and broadcast root),
it adds the locals' regions into its own staged copy and pushes that sum to the servers marked
``hosted``; for a broadcast the host's "sum" is its root's region alone, or zeros where the
root is on another host, so no local can add into the root's array. The servers' result goes into the leader's output and into every local's region,
and each local hears ``Result(shm=True)``, so a local's push_pull costs it one copy in and one
copy out, as with a server on its host.

Everything a local sends is checked as a server checks it: the sender is a worker of this
host in the current address book (its connection's routing id), the region is in that
worker's own segment, and the round is bounded in number. A round that fails (a mismatch, a
server's error, a lost worker, a new generation) tells every local in it why; a round still
missing pushes after BPS_GOSSIP_TIMEOUT fails naming the missing ranks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from ...config import Config
from ...errors import BpsGossipError, ProtocolError, error_for, kind_of
from ...protocol import Ack, BookEntry, Error, Message, Push, Result, send
from ...protocol.data import describe_signature
from ...sum_threads import SumThreads
from ...transport.shm import AttachedSegments
from ..operation import Operation

MAX_HOST_ROUNDS = 16384  # host rounds open at once (locals ahead of their leader included)
MAX_ATTACHED = 1024  # locals' segments mapped at once
MAX_DIRECT = 1024  # the leader's own gather_rows rounds remembered (see HostAggregations.went_direct)
BLOCK_BYTES = 1 << 18  # sums and copies of more than IN_CACHE go block by block, each staying in cache
IN_CACHE = 1 << 20  # a partition this small stays in cache whole: a call per local is cheaper


def add_into(mine: np.ndarray, regions: list[np.ndarray]) -> None:
    """``mine`` += every one of ``regions``, block by block, so each is read from memory once
    (pairwise, ``mine`` would be read and written once per local)."""
    step = max(1, BLOCK_BYTES // mine.itemsize) if mine.nbytes > IN_CACHE else max(mine.size, 1)
    for start in range(0, mine.size, step):
        block = mine[start:start + step]
        for region in regions:
            np.add(block, region[start:start + step], out=block)


def copy_to(total: np.ndarray, regions: list[np.ndarray]) -> None:
    """Copy ``total`` into every one of ``regions``, block by block (``total`` read once)."""
    step = max(1, BLOCK_BYTES // total.itemsize) if total.nbytes > IN_CACHE else max(total.size, 1)
    for start in range(0, total.size, step):
        block = total[start:start + step]
        for region in regions:
            region[start:start + step] = block


def host_route(uid: bytes, generation: int) -> bytes:
    """The routing id of a local's connection to its leader in ``generation``: its own, since the
    local's gossip DEALER to the same peer socket has the plain one, and a ROUTER drops a second
    connection with an id it already has (also the previous generation's, not yet seen closed)."""
    return uid + b"/host/%d" % generation

HostRoundId = tuple  # (generation, key, partition, round)


def _as_root(root: int | None) -> str:
    return "a sum" if root is None else f"a broadcast from root {root}"


@dataclasses.dataclass(eq=False)
class LocalPush:
    """One local worker's partition: the connection and request to answer, its region."""

    route: bytes  # emptied once the local was answered
    req: int
    region: np.ndarray


@dataclasses.dataclass(eq=False)
class HostAggregation:
    """One partition of one tensor of one round on this host."""

    rid: HostRoundId
    name: str
    terms: tuple[dict[str, Any], str, int, int | None]  # the first push's (signature, wire dtype, count,
    # broadcast root): all must agree
    first: int  # the rank that set ``terms``
    created: float
    locals: dict[int, LocalPush] = dataclasses.field(default_factory=dict)
    own: tuple[Operation, int] | None = None  # the leader's operation and partition
    own_done: bool = False  # the leader's partition came and was sent, or failed
    error: tuple[str, str] | None = None  # (kind, why) once failed
    sent: bool = False  # the host's sum went to the servers
    stall_reported: bool = False
    spread: bool = False  # the sum is in every local's region already (a leader that finishes)


class HostAggregations:
    """The open host rounds of a leader (see the module docstring). ``push(op, part)`` sends
    the host's sum of ``op``'s partition to the servers; ``fail(op, error)`` fails the leader's
    own operation; ``sock`` is the leader's peer ROUTER, the locals' replies go out on it."""

    def __init__(self, config: Config, rank: int, generation: int, members: tuple[int, ...],
                 workers: list[BookEntry], push: Callable[[Operation, int], None],
                 fail: Callable[[Operation, BpsGossipError], None],
                 poison: Callable[[HostRoundId, str, dict[str, Any], str], None], *,
                 finish: bool = False, threads: SumThreads | None = None) -> None:
        self.config = config
        self.finish = finish  # this host holds the whole job: the sums are the results (no server)
        self.threads = threads  # large rounds are summed (and copied out) there
        self.closed = False
        self.rank = rank
        self.generation = generation
        self.members = members
        self.locals = frozenset(members) - {rank}
        self.ranks = {host_route(bytes.fromhex(w.uid), generation): index for index, w in enumerate(workers)}
        self.pids = [w.pid for w in workers]
        self.push = push
        self.fail_own = fail
        self.poison = poison
        self.sock: Any = None
        self.rounds: dict[HostRoundId, HostAggregation] = {}
        self.attached = AttachedSegments(MAX_ATTACHED)
        self.gone: dict[int, str] = {}  # locals lost or gone: no round can complete without them
        self.direct: dict[tuple[int, int, int], None] = {}  # (generation, key, round) of own gather_rows rounds

    # -- what arrives --------------------------------------------------------------
    def on_local_push(self, route: bytes, push: Push) -> None:
        """A local worker's partition (decoded, so every field has its type and range)."""
        rank = self.ranks.get(route)
        if rank is None or rank not in self.locals:
            # No reply: whoever this is, it is not a worker of this host we answer for.
            raise ProtocolError(f"a push from {route[:64]!r}, which is no other worker of host leader "
                                f"{self.rank} in generation {self.generation}")
        if push.gen < self.generation:
            self._reply(route, Error(req=push.req, kind="changed",
                                     why=f"tensor {push.name!r}: generation {push.gen} of the job has ended"))
            return
        try:
            if push.shm is None or push.codec is not None or push.hosted:
                raise ProtocolError("a push to the host leader names a shared-memory region and nothing else")
            region = self.attached.owned_view(f"rank {rank}", self.pids[rank], push.shm, push.wire, push.count,
                                              push.offset)
        except (OSError, ValueError, ProtocolError) as exc:
            self._reply(route, Error(req=push.req, kind="protocol", why=f"malformed push to the host leader: {exc}"))
            return
        rid = (push.gen, push.key, push.part, push.seq)
        agg = self._round(rid, push.name, (push.signature, push.wire, push.count, push.root), rank)
        if agg is None:
            self._reply(route, Error(req=push.req, kind="protocol",
                                     why=f"host leader {self.rank} has {len(self.rounds)} rounds open"))
            return
        if rank in agg.locals:
            self._reply(route, Error(req=push.req, kind="protocol",
                                     why=f"tensor {push.name!r}: rank {rank} pushed partition {push.part} "
                                         f"of round {push.seq} twice"))
            return
        agg.locals[rank] = LocalPush(route, push.req, region)
        if push.ack and agg.error is None:
            self._reply(route, Ack(req=push.req))
        self._agree(agg, rank, (push.signature, push.wire, push.count, push.root))
        if (rid[0], rid[1], rid[3]) in self.direct:
            self._gathered_elsewhere(agg)
            return
        self._advance(agg)

    def went_direct(self, op: Operation) -> None:
        """The leader's own ``op`` gathers rows (``gather_rows``) and was pushed straight to the
        servers, as every honest rank's is: a local's push of the same round (a sum pushed under a
        name whose rows are gathered: a liar, or a rank that calls the wrong collective) can never
        complete here. Such rounds fail now, and so do those that come later, on every rank
        (without this they waited until BPS_GOSSIP_TIMEOUT, the whole job with them). Called after
        the leader's push: the servers' round then holds it when this host's poison comes, which
        alone would complete a round of one host."""
        mark = (self.generation, op.key, op.seq)
        if mark in self.direct:
            return
        self.direct[mark] = None
        if len(self.direct) > MAX_DIRECT:
            self.direct.pop(next(iter(self.direct)))
        for agg in list(self.rounds.values()):
            if (agg.rid[0], agg.rid[1], agg.rid[3]) == mark:
                self._gathered_elsewhere(agg)

    def _gathered_elsewhere(self, agg: HostAggregation) -> None:
        """Fail ``agg``, pushed by locals where this leader gathers rows, here and at the servers."""
        agg.own_done = True  # the leader's own went straight to the servers
        if agg.error is not None:
            return
        if not agg.sent:
            agg.sent = True
            self.poison(agg.rid, agg.name, agg.terms[0], "a sum pushed where rows are gathered", gathered=True)
        self._fail(agg, "mismatch", f"tensor {agg.name!r}: rank {self.rank} gathers its rows (gather_rows) but "
                                    f"rank(s) {sorted(agg.locals)} pushed it to be summed; every rank must call "
                                    "the same collective")
        self.rounds.pop(agg.rid, None)  # the honest locals never come here: nothing else would end it

    def own(self, op: Operation, part: int) -> None:
        """The leader's own partition is ready (its staged copy holds its data)."""
        offset, count = op.parts[part]
        rid = (self.generation, op.key, part, op.seq)
        agg = self._round(rid, op.name, (op.sig, op.send.dtype.str, count, op.root), self.rank)
        if agg is None:
            self.fail_own(op, ProtocolError(f"push_pull {op.name!r}: host leader {self.rank} has "
                                            f"{len(self.rounds)} rounds open"))
            return
        if agg.own is not None or agg.own_done:
            self.fail_own(op, ProtocolError(f"push_pull {op.name!r}: round {op.seq} twice on rank {self.rank}"))
            return
        agg.own = (op, part)
        if op.host_rounds is None:
            op.host_rounds = {}
        op.host_rounds[part] = agg
        self._agree(agg, self.rank, (op.sig, op.send.dtype.str, count, op.root))
        self._advance(agg)

    def _round(self, rid: HostRoundId, name: str, terms: tuple[dict[str, Any], str, int, int | None],
               rank: int) -> HostAggregation | None:
        agg = self.rounds.get(rid)
        if agg is None:
            if len(self.rounds) >= MAX_HOST_ROUNDS:
                return None
            agg = self.rounds[rid] = HostAggregation(rid, name, terms, rank, time.monotonic())
        return agg

    def _agree(self, agg: HostAggregation, rank: int, terms: tuple[dict[str, Any], str, int, int | None]) -> None:
        """Fail the round if ``rank``'s push disagrees with the first one."""
        if agg.error is not None or (terms[0] == agg.terms[0] and np.dtype(terms[1]) == np.dtype(agg.terms[1])
                                     and terms[2:] == agg.terms[2:]):
            return
        if terms[:3] == agg.terms[:3]:
            why = (f"tensor {agg.name!r}: rank {agg.first} pushed it as {_as_root(agg.terms[3])} but rank {rank} "
                   f"as {_as_root(terms[3])}; every rank must name the same root")
        else:
            why = (f"tensor {agg.name!r}: rank {agg.first} pushed {describe_signature(agg.terms[0])} but rank "
                   f"{rank} pushed {describe_signature(terms[0])}; every rank must push the same shape, dtype and "
                   "operation")
        if not agg.sent:  # the other hosts' ranks must hear it too, not wait for this host's sum
            agg.sent = True
            # Both signatures in the text: the other hosts' ranks learn what this host's disagree on.
            self.poison(agg.rid, agg.name, terms[0], f"rank {agg.first} pushed {describe_signature(agg.terms[0])}, "
                                                   f"rank {rank} {describe_signature(terms[0])}")
        self._fail(agg, "mismatch", why)

    def _advance(self, agg: HostAggregation) -> None:
        """Sum and push once everyone of the host is in; answer what a failed round owes."""
        if agg.error is None and self.gone and not agg.sent:
            agg.error = ("lost", f"tensor {agg.name!r}: " + "; ".join(self.gone.values()))
        if agg.error is not None:
            self._fail(agg, *agg.error)
            return
        if agg.own is None or len(agg.locals) < len(self.locals) or agg.sent:
            return
        op, part = agg.own
        offset, count = op.parts[part]
        agg.sent = agg.own_done = True
        if self.threads is not None and count * op.send.dtype.itemsize > IN_CACHE:
            self.threads.submit(lambda: self._reduce(agg, op, offset, count),
                                lambda done: self._reduced(agg, op, part, done.exception()))
            return
        self._reduce(agg, op, offset, count)
        self._reduced(agg, op, part, None)

    def _reduce(self, agg: HostAggregation, op: Operation, offset: int, count: int) -> None:
        """The host's sum into the leader's region; where it is the result, also into the
        leader's output and every local's region (on a summation thread for large rounds)."""
        if not count:
            return
        mine = op.region(offset, count)
        regions = [local.region for local in agg.locals.values()]
        root = agg.terms[3]
        if root is None:
            add_into(mine, regions)
        elif root in agg.locals:  # a broadcast: the host's sum is its root's bits, whatever the others pushed
            copy_to(agg.locals[root].region, [mine])
        elif root != self.rank:
            mine.fill(0)  # the root is on another host: this one adds nothing (as the servers take it)
        if self.finish:  # one pass over the sum (block by block) fills the output and every local
            copy_to(mine, regions if op.leased else [op.out[offset:offset + count], *regions])  # leased: mine is out
            agg.spread = True

    def _reduced(self, agg: HostAggregation, op: Operation, part: int, error: BaseException | None) -> None:
        if self.closed or agg.error is not None or op.failed:
            return  # failed meanwhile: everyone was told
        if error is not None:
            self._fail(agg, "protocol", f"tensor {agg.name!r}: host leader {self.rank} failed to sum: {error!r}")
            return
        self.push(op, part)

    # -- what the servers answer -----------------------------------------------------
    def result(self, op: Operation, part: int) -> None:
        """The servers' sum of a hosted partition is in ``op.out``: hand it to the locals."""
        agg = op.host_rounds.pop(part, None) if op.host_rounds else None
        if agg is None or agg.error is not None:
            return
        self.rounds.pop(agg.rid, None)
        offset, count = op.parts[part]
        if count and not agg.spread:
            copy_to(op.out[offset:offset + count], [local.region for local in agg.locals.values()])
        for local in agg.locals.values():
            self._reply(local.route, Result(req=local.req, shm=True))
            local.route = b""

    def op_failed(self, op: Operation, error: BaseException) -> None:
        """The leader's operation failed: so do its host rounds, for everyone in them."""
        for agg in list((op.host_rounds or {}).values()):
            agg.own, agg.own_done = None, True
            self._fail(agg, kind_of(error), str(error))
        if op.host_rounds:
            op.host_rounds.clear()

    # -- failures --------------------------------------------------------------------
    def _fail(self, agg: HostAggregation, kind: str, why: str) -> None:
        """Fail ``agg``: every local in it hears why (once), and the leader's operation fails.
        The round stays (answering the late) until everyone of the host was told."""
        agg.error = (kind, why)
        for local in agg.locals.values():
            if local.route:
                self._reply(local.route, Error(req=local.req, kind=kind, why=why))
                local.route = b""  # told
        if agg.own is not None:
            op, _ = agg.own
            agg.own, agg.own_done = None, True
            if not op.failed:
                self.fail_own(op, error_for(kind, why))
        if len(agg.locals) >= len(self.locals) and agg.own_done:
            self.rounds.pop(agg.rid, None)

    def worker_gone(self, rank: int, why: str) -> None:
        """A worker was lost or left: the rounds still waiting for it cannot complete (in a job
        that is not elastic, no round can)."""
        if rank not in self.locals and self.config.elastic:
            return  # another host's: the new generation fails what needs it
        self.gone[rank] = why
        why = "; ".join(self.gone.values())
        for agg in list(self.rounds.values()):
            # Not elastic: the servers refuse every push from now on, so nothing can complete.
            if not agg.sent and (rank not in agg.locals or not self.config.elastic):
                self._fail(agg, "lost", f"tensor {agg.name!r}: {why}")
                self.rounds.pop(agg.rid, None)

    def expire(self, now: float) -> None:
        """Fail rounds still missing pushes after BPS_GOSSIP_TIMEOUT."""
        timeout = self.config.timeout
        for agg in list(self.rounds.values()):
            if agg.sent or now - agg.created <= timeout:
                continue
            if agg.error is not None:  # failed, and whoever never came will not be told
                self.rounds.pop(agg.rid, None)
                continue
            missing = sorted(r for r in self.members if r not in agg.locals and (r != self.rank or agg.own is None))
            self._fail(agg, "timeout", f"tensor {agg.name!r} partition {agg.rid[2]}: ranks {missing} of host "
                                       f"leader {self.rank} did not push within {timeout:.1f} s (BPS_GOSSIP_TIMEOUT)")
            self.rounds.pop(agg.rid, None)

    def overdue(self, now: float, after: float) -> list[tuple[list[int], str]]:
        """Ranks this leader's host has waited on for ``after`` seconds, each round once (elastic:
        reported to the scheduler; the servers see only that this leader is missing): locals that
        did not push, or this leader itself when every local did and its own training did not (its
        engine still runs; the scheduler removes it only if its heartbeats say it started nothing)."""
        found = []
        for agg in self.rounds.values():
            if agg.sent or agg.stall_reported or now - agg.created <= after:
                continue
            missing = sorted(self.locals - agg.locals.keys())
            if agg.own is not None and missing:
                found.append((missing, f"pushed nothing of {agg.name!r} to host leader {self.rank} for "
                                       f"{now - agg.created:.1f} s"))
            elif agg.own is None and not missing:
                found.append(([self.rank], f"host leader {self.rank} pushed nothing of {agg.name!r} for "
                                           f"{now - agg.created:.1f} s while every worker of its host had"))
            else:
                continue  # the leader and a local both missing: either may be the one that waits
            agg.stall_reported = True
        return found

    def close(self, kind: str, why: str) -> None:
        """End this generation's rounds (everyone in them told why)."""
        for agg in list(self.rounds.values()):
            agg.own, agg.own_done = None, True  # the engine fails the leader's operations itself
            self._fail(agg, kind, why)
        self.rounds.clear()
        self.closed = True
        if self.threads is not None:
            self.threads.settle()  # no summation thread reads a local's segment as it is unmapped
        self.attached.close()

    def _reply(self, route: bytes, msg: Message) -> None:
        send(self.sock, msg, (), route)

