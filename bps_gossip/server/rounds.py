"""A server's rounds: which pushes belong together, when a round is complete, and who hears why
one failed. No sockets: replies go out through the ``reply`` callable the server gives.

A push's rank is the worker whose connection it came on (its routing id is in the scheduler's
address book), a round's size is the book's, and the generation is the scheduler's: nothing of
that is taken from the message. A push for a generation whose book has not reached this
server yet is held (bounded) until it has.

A push that disagrees with its round, a worker that died or left, and a round that stays
incomplete past BPS_GOSSIP_TIMEOUT all end in an error reply to every participant: never a
silent hang.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import numpy as np

from ..compression import PartitionState, codec_from_header, merge_on_server, rng_for
from ..config import Config
from ..errors import ProtocolError
from ..host_groups import host_groups
from ..protocol import Ack, AddressBook, Error, Message, Push, Result, Stalled
from ..protocol.data import held_bytes
from ..transport.shm import AttachedSegments
from ..transport.sockets import server_frame_limit
from .aggregation import Aggregation, Contribution, RoundId
from .async_store import AsyncStore, StoreRefused
from .early_pushes import EarlyPushes
from .holdings import AggregationTable, TensorNames
from .pool import SumPool

MAX_ATTACHED = 4096  # segments mapped at once; the oldest are unmapped past this
# Summed on the I/O thread up to this size (every push of at most SMALL_PUSH_BYTES, which the
# workers send without asking for an acknowledgement): a hop to the pool and back costs more
# (8 workers pushing 512 KiB partitions to 4 servers: the servers' CPU 28-29 -> 22-23 ms a step,
# their wake-ups 386-406 -> 160-169, against the 256 KiB this was).
INLINE_BYTES = 1024 * 1024

Reply = Callable[[Contribution, Message, Tuple[Any, ...]], None]


class Aggregations:
    """The open rounds of one server and everything they are checked against."""

    def __init__(self, config: Config, addr: str, reply: Reply, pool: SumPool) -> None:
        self.config = config
        self.addr = addr
        self.reply = reply
        self.pool = pool
        self.rounds = AggregationTable()  # RoundId -> Aggregation, charged to the rank that opened it
        self.names = TensorNames()  # key -> tensor name: two names on one key are refused
        self.feedback: dict[tuple[int, int], PartitionState] = {}  # compressed tensors' server-side error
        self.gone: dict[int, str] = {}  # worker rank -> why it is no longer in the job
        self.rounds_done = 0
        self.pushes_by_rank: list[int] = []  # pushes taken per rank of this generation (stats)
        self.socket_bytes = 0  # payload bytes that came as frames, not through shared memory (stats)
        self.segments = AttachedSegments(MAX_ATTACHED)
        self.size = 0
        self.ranks: dict[bytes, int] = {}  # a worker's routing id -> its rank, from the address book
        self.pids: list[int] = []  # by rank: a worker's shared-memory segments carry its pid
        self.leaders: frozenset[int] = frozenset()  # ranks that push their host's sum (bps_gossip.host_groups)
        self.book_generation = 0  # the generation of the last address book
        self.early = EarlyPushes()  # pushes for a generation whose book has not come yet
        self.generation = 0  # elastic: rounds of older generations are failed and dropped
        self.frame_limit = server_frame_limit(config)
        self.stored = AsyncStore()  # asynchronous training's weights (no rounds)

    # -- address books and generations --------------------------------------------
    def take_book(self, book: AddressBook) -> None:
        """An address book from the scheduler: who the workers are, and a new generation."""
        self.size = len(book.workers)
        self.ranks = {w.routing_id: index for index, w in enumerate(book.workers)}
        self.pids = [w.pid for w in book.workers]
        self.pushes_by_rank = [0] * self.size
        groups = host_groups(book.workers, book.servers)
        self.leaders = frozenset(group[0] for group in groups if len(group) > 1)
        if self.leaders:  # ranks that are alone on their host push for themselves, as leaders do
            self.leaders = frozenset(group[0] for group in groups)
        self.book_generation = book.generation
        self.new_generation(book.generation, "a new generation began")
        for _, route, push, frames, _ in self.early.take_all():
            self.on_push(route, push, frames)

    def new_generation(self, generation: int, why: str) -> None:
        """Elastic: fail every round of an older generation (its workers are told to reset)."""
        if generation <= self.generation:
            return
        self.generation = generation
        for agg in list(self.rounds.values()):
            if agg.rid[0] < generation:
                if agg.error is None:
                    self.fail(agg, "changed", f"tensor {agg.name!r}: membership changed: {why}")
                self.rounds.pop(agg.rid, None)

    def worker_gone(self, why: str, rank: int) -> None:
        """A worker died or left a job that is not elastic: no open round can complete."""
        self.gone[rank] = why
        # Pushes are refused from now on, so not even a round the gone worker already pushed
        # to can complete: fail them all now.
        why = "; ".join(self.gone.values())
        for agg in list(self.rounds.values()):
            if agg.error is None:
                self.fail(agg, "lost", f"tensor {agg.name!r}: {why}")
            self.rounds.pop(agg.rid, None)

    # -- a push: decoded by the table, checked, stored, summed -----------------------
    def on_push(self, route: bytes, push: Push, frames: list) -> None:
        """One worker's push (already decoded, so every field is of its type and range)."""
        if push.gen > self.book_generation:  # the worker has its new book, this server not yet
            self._hold(route, push, frames)
            return
        checked = self._check(route, push, frames)
        if checked is None:
            return
        who, payload, codec = checked
        self.pushes_by_rank[who.rank] += 1
        if who.region is None and payload is not None:
            self.socket_bytes += len(payload)
        if push.store is not None:
            self._to_stored_weights(who, push, payload)
            return
        agg = self._store(who, push, codec)
        if agg is None:
            return
        self.names.saw_part(push.key, push.part)
        data = payload if who.region is not None else payload.buffer
        if agg.root is not None and who.rank != agg.root:  # a broadcast: only the root's bits reach anyone
            done = agg.skip()
        elif agg.rows or agg.nbytes <= INLINE_BYTES:
            if agg.rows:  # a copy: a region never becomes a rows round's sum (write_back copies it there)
                data = agg.own_row(data, who.rank)
            done = agg.add(data)
        else:
            self.pool.submit(agg, payload)
            done = False
        if done:
            agg.write_back()
            self.finish(agg)  # the result doubles as this push's acknowledgement
            return
        if push.ack:
            self.reply(who, Ack(req=push.req), ())

    def _to_stored_weights(self, who: Contribution, push: Push, payload: Any) -> None:
        """Asynchronous training: apply the push to the stored weights and answer with them at once."""
        data = payload if who.region is not None else payload.buffer
        try:
            value = self.stored.push(who.rank, push.store == "init", push.key, push.part, push.name, push.instance,
                                     push.signature, push.wire, data, push.count)
        except StoreRefused as exc:
            self._error(who, exc.kind, str(exc))
            return
        if who.region is not None:  # the worker reads the stored weights from its own region
            who.region[:] = value
            self.reply(who, Result.made(req=push.req, shm=True), ())
        else:
            self.reply(who, Result.made(req=push.req), (value,))

    def malformed(self, route: bytes, header: dict[str, Any], error: ProtocolError) -> None:
        """A push that does not decode: its sender waits, so it gets an error (with its req if
        that much could be read)."""
        req = header.get("req")
        req = req if isinstance(req, int) and not isinstance(req, bool) and 0 <= req < 1 << 63 else 0
        self._error(Contribution(-1, route, req), "protocol", f"malformed push: {error}")

    def _hold(self, route: bytes, push: Push, frames: list) -> None:
        """Keep a push until the address book of its generation arrives (bounded)."""
        nbytes = held_bytes(push) + sum(len(frame) for frame in frames)  # headers too: they can be most of it
        member = route in self.ranks
        why = self.early.refusal(route, nbytes, member)
        if why is not None:
            self._error(Contribution(-1, route, push.req), "protocol",
                        f"server {self.addr} holds pushes for generations whose address book it has not "
                        f"received: {why}; generation {push.gen} push dropped")
            return
        self.early.hold(route, push, frames, nbytes, member)

    def _check(self, route: bytes, push: Push, frames: list) -> tuple[Contribution, Any, Any] | None:
        """Who pushed, its payload and codec; None (the sender told why) for a push to refuse."""
        who = Contribution(-1, route, push.req)
        try:
            push.check_payload(frames)
            codec = codec_from_header({"codec": push.codec}, push.count) if push.codec is not None else None
        except (ValueError, ProtocolError) as exc:
            self._error(who, "protocol", f"malformed push: {exc}")
            return None
        rank = self.ranks.get(route)
        if rank is None:  # before anything of the message is acted on
            self._error(who, "protocol", f"server {self.addr}: the sender is no worker of generation "
                                         f"{self.book_generation} of this job")
            return None
        who.rank = rank
        payload: Any = frames[0] if frames else None
        if push.shm is not None:  # only a registered worker's own segment is mapped
            try:
                payload = who.region = self._region(rank, push)
            except (OSError, ValueError, ProtocolError) as exc:
                self._error(who, "protocol", f"malformed push: {exc}")
                return None
        why = self._refusal(push)
        if why is not None:
            self._error(who, *why)
            return None
        return who, payload, codec

    def _region(self, rank: int, push: Push) -> np.ndarray:
        """The region of worker ``rank``'s own shared-memory segment named in its push, within the
        limit a frame has (shared memory must not be a way around it)."""
        limit = self.frame_limit
        if push.nbytes > limit:
            raise ProtocolError(f"rank {rank} pushed {push.nbytes} bytes through shared memory, more than the "
                                f"servers take ({limit})")
        return self.segments.owned_view(f"rank {rank}", self.pids[rank], push.shm, push.wire, push.count, push.offset)

    def _refusal(self, push: Push) -> tuple[str, str] | None:
        """(kind, why) if this job cannot take the push now, else None."""
        known = self.names.name_of(push.key, push.name)
        if known != push.name:
            return "protocol", f"tensor names {known!r} and {push.name!r} hash to the same key {push.key}; rename one"
        if self.gone and push.store is None:  # the stored weights wait for nobody: a worker may finish first
            why = "; ".join(self.gone.values())
            return "lost", f"tensor {push.name!r}: {why}; this job is not elastic, so it cannot go on"
        # The stored weights wait for nobody either: a pusher of the book this server still holds
        # goes on through a change (a worker that finished and left opened it; the rest flush).
        if push.gen < self.generation and not (push.store is not None and push.gen == self.book_generation):
            return "changed", f"tensor {push.name!r}: generation {push.gen} of the job has ended"
        return None

    def expected_ranks(self, agg: Aggregation) -> frozenset[int] | range:
        """The ranks whose pushes complete ``agg``: every worker's, or each host's leader's."""
        return self.leaders if agg.hosted else range(self.size)

    def _store(self, who: Contribution, push: Push, codec: Any) -> Aggregation | None:
        """The push's round, with the push in it; None if the round failed (everyone told)."""
        rid = (push.gen, push.key, push.part, push.seq)
        agg = self.rounds.get(rid)
        if agg is None:
            agg = self._open(who, push, codec, rid)
            if agg is None:
                return None
        elif who.rank in agg.pushes:
            if push.hosted and not push.count and who.rank in self.leaders and agg.error is None:
                # A leader's word that its host's round failed, on a round it pushed to itself (a
                # gather_rows, which goes straight here): a local pushed something else under it.
                self.fail(agg, "mismatch", f"tensor {push.name!r}: {push.kind}")
                return None
            self._error(who, "protocol", f"tensor {push.name!r}: rank {who.rank} pushed partition {push.part} "
                                         f"of round {push.seq} twice")
            return None
        if agg.error is not None:  # the round failed already: this push only hears why
            agg.pushes[who.rank] = who
            self._error(who, "mismatch", agg.error)
            if len(agg.pushes) >= agg.expected:
                self.rounds.pop(rid, None)
            return None
        agg.error = agg.mismatch(who.rank, push.signature, push.wire, push.count)  # names the first pusher
        if agg.error is None:
            agg.error = self._disagreement(agg, who, push)
        agg.pushes[who.rank] = who
        if agg.error is not None:
            self.fail(agg, "mismatch", agg.error)
            return None
        return agg

    def _open(self, who: Contribution, push: Push, codec: Any, rid: RoundId) -> Aggregation | None:
        """A new round for ``push`` (charged to its rank); None (the sender told why) if refused."""
        merge = (codec[1], codec[2]) if codec is not None else (False, None)
        why = None
        if push.hosted and who.rank not in self.leaders:
            why = "protocol", f"rank {who.rank} pushed a host's sum but leads no host group of this generation"
        elif push.root is not None and push.root >= self.size:
            why = "mismatch", f"broadcast from root {push.root} in a job of {self.size} workers"
        elif push.rows and push.shape[0] != self.size:
            why = "mismatch", f"gather_rows of {push.shape[0]} rows in a job of {self.size} workers (one row each)"
        # What the server holds for the round: a copy of a payload that came as a frame (the
        # float32 sum of a compressed one), nothing for one in the worker's own region.
        held = held_bytes(push)
        if who.region is None:
            held += 4 * codec[0].n if codec is not None else push.count * np.dtype(push.wire).itemsize
        if why is None:
            refusal = self.rounds.refusal(who.rank, held)
            why = None if refusal is None else ("protocol", f"server {self.addr}: {refusal}")
        if why is not None:
            self._error(who, why[0], f"tensor {push.name!r}: {why[1]}")
            return None
        agg = Aggregation(rid, push.name, push.signature, push.wire, push.count,
                          len(self.leaders) if push.hosted else self.size, codec[0] if codec is not None else None,
                          merge)
        agg.hosted, agg.rows, agg.row, agg.root = push.hosted, push.rows, push.shape[1] if push.rows else 0, push.root
        self.rounds.open(rid, agg, who.rank, held)
        return agg

    @staticmethod
    def _disagreement(agg: Aggregation, who: Contribution, push: Push) -> str | None:
        """Why ``push`` cannot join ``agg`` besides its signature (each would let a sum reach
        what it must not), or None."""
        for what, theirs, ours in (("the root", push.root, agg.root), ("gather_rows", push.rows, agg.rows),
                                   ("reducing by host first (BPS_GOSSIP_HOST_REDUCE, compression)",
                                    push.hosted, agg.hosted)):
            if theirs != ours:
                return f"tensor {push.name!r}: ranks {sorted(agg.pushes)} and rank {who.rank} disagree on {what}"
        return None

    # -- results and failures --------------------------------------------------------
    def _error(self, who: Contribution, kind: str, why: str) -> None:
        self.reply(who, Error(req=who.req, kind=kind, why=why), ())

    def fail(self, agg: Aggregation, kind: str, why: str) -> None:
        """Fail ``agg``: every worker that pushed to it gets ``why``."""
        agg.error = why
        for who in agg.pushes.values():
            self._error(who, kind, why)
        if len(agg.pushes) >= agg.expected:
            self.rounds.pop(agg.rid, None)

    def finish(self, agg: Aggregation) -> None:
        """Every worker pushed: send each the sum."""
        self.rounds.pop(agg.rid, None)
        if agg.error is not None:
            return
        self.rounds_done += 1
        if agg.codec is not None:  # one compression of the sum; every worker gets the same bytes
            ef, seed = agg.merge
            _, key, part, seq = agg.rid
            state = self.feedback.setdefault((key, part), PartitionState())
            result = merge_on_server(ef, agg.codec, agg.acc, state, rng_for(seed, part, seq, 1))
            for who in agg.pushes.values():
                self.reply(who, Result(req=who.req), (result,))
            return
        # A sum that lives in a worker's region goes to remote workers as a copy, taken before
        # anyone hears of the result: that worker reuses its region for its next push as soon as
        # it has read the sum, and ZeroMQ sends frames later still.
        remote = any(who.region is None for who in agg.pushes.values())
        frame = agg.acc.copy() if remote and agg.acc_in_region else agg.acc
        for who in agg.pushes.values():
            if who.region is not None:  # the sum is already in its region (write_back)
                self.reply(who, Result.made(req=who.req, shm=True), ())
            else:
                self.reply(who, Result.made(req=who.req), (frame,))

    def pool_done(self, rid: RoundId, error: str | None) -> None:
        """A round the pool completed (or whose summation failed)."""
        agg = self.rounds.get(rid)
        if agg is None:
            return
        if error is not None:
            self.fail(agg, "protocol", f"tensor {agg.name!r}: {error}")
        else:
            self.finish(agg)

    def expire(self, now: float) -> list[Stalled]:
        """Fail what waited past BPS_GOSSIP_TIMEOUT; return the stalls to report (elastic)."""
        timeout = self.config.timeout
        for _, route, push, _, _ in self.early.expired(now, timeout, self.ranks):
            self._error(Contribution(-1, route, push.req), "timeout",
                        f"server {self.addr}: no address book of generation {push.gen} within "
                        f"{timeout:.1f} s (BPS_GOSSIP_TIMEOUT)")
        stalls = []
        for agg in list(self.rounds.values()):
            stall = self._stall(agg, now)
            if stall is not None:
                stalls.append(stall)
            if agg.error is None and now - agg.created > timeout:
                missing = sorted(set(self.expected_ranks(agg)) - set(agg.pushes))
                self.fail(agg, "timeout", f"tensor {agg.name!r} partition {agg.rid[2]}: ranks {missing} did not "
                                          f"push within {timeout:.1f} s (BPS_GOSSIP_TIMEOUT)")
                self.rounds.pop(agg.rid, None)
        return stalls

    def _stall(self, agg: Aggregation, now: float) -> Stalled | None:
        """Elastic: ranks that others have waited on for BPS_GOSSIP_STALL_TIMEOUT are reported
        (once per round) to the scheduler, which removes them like lost workers. Only when they are
        no more than those waiting: a majority missing means the pushers are early, not stuck."""
        stall = self.config.stall_timeout
        if not self.config.elastic or not stall or agg.stall_reported or agg.error is not None \
                or now - agg.created <= stall:
            return None
        agg.stall_reported = True
        if agg.hosted:  # a missing leader waits on its host: the leader reports whom (host_reduce)
            return None
        missing = sorted(set(self.expected_ranks(agg)) - set(agg.pushes))
        if not missing or len(missing) > len(agg.pushes):
            return None
        return Stalled(ranks=missing, generation=agg.rid[0],
                       why=f"pushed nothing of {agg.name!r} for {now - agg.created:.1f} s "
                           f"while ranks {sorted(agg.pushes)} waited on server {self.addr}")

    def close(self) -> None:
        """Unmap the workers' segments."""
        self.segments.close()
