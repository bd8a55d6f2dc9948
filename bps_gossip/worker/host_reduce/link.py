"""Where a worker's partitions go when the job reduces by host (bps_gossip.host_groups): this
worker's place in its host group, from each address book, and what that place needs. Runs on
the engine thread.

- A local (not its host's leader) pushes every uncompressed partition to its leader, through
  a DEALER to the leader's peer socket, from its shared-memory segment; the leader's replies
  (Ack, Result, Error) are read like a server's.
- A leader of other workers collects theirs in :class:`~bps_gossip.worker.host_reduce.aggregations.HostAggregations`
  and pushes one sum per partition, marked ``hosted``.
- A worker alone on its host pushes ``hosted`` too (the servers count hosts, not workers).
- Where one host holds the whole job (``whole_job``), the leader's sums are the results: no
  server hears of them.

Compressed partitions are not reduced by host: every worker pushes them itself, as without.
Pushes that reach a leader before its address book of their generation are held (bounded).
"""

from __future__ import annotations

import enum
import time
from typing import Callable

import zmq

from ...config import Config
from ...errors import UNEVEN_STEPS, BpsGossipError, PeerLostError, ProtocolError
from ...host_groups import group_of, push_pull_groups
from ...protocol import Error, Push, send
from ...sum_threads import SumThreads
from ...transport.data_path import Route
from ...transport.sockets import SocketRole, open_socket
from ..operation import Operation
from ..scheduler_link import Book
from .aggregations import HostAggregations, host_route

MAX_EARLY = 4096  # locals' pushes held until this leader has the address book of their generation
LEFT_GRACE = 2.0  # seconds the results a leader sent before it left gracefully may take to arrive


class Way(enum.Enum):
    """How one partition of an operation reaches the servers."""

    DIRECT = "direct"  # pushed by this worker as ever (no host reduce, or compressed)
    TO_LEADER = "to_leader"  # to this host's leader, which pushes for the host
    HOST_ROUND = "host_round"  # this leader's own: summed with the locals' first
    HOSTED = "hosted"  # alone on its host: pushed as the host's sum


class HostLink:
    """This worker's host group and the means to reduce in it (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, config: Config, uid: bytes, pending: set[Operation],
                 push: Callable[[Operation, int], None], fail: Callable[[Operation, BpsGossipError], None],
                 poison: Callable[..., None], peer_sock: zmq.Socket | None = None) -> None:
        self.ctx, self.config, self.uid = ctx, config, uid
        self.pending = pending  # the server links' operations in flight (the same set, never replaced)
        self.push, self.fail, self.poison = push, fail, poison
        self.hosting = False  # the job reduces by host
        self.whole_job = False  # ... and this host holds every worker: its leader's sums are the results
        self.leader = -1  # this worker's host leader
        self.rank = -1
        self.generation = 0
        self.sock: zmq.Socket | None = None  # a local: the DEALER to its leader
        self.route: Route | None = None  # ... and how payloads reach it: by name, in this host's memory
        self.rounds: HostAggregations | None = None  # a leader of other workers
        self.peer_sock = peer_sock  # this worker's peer ROUTER: a leader answers its locals on it
        self.threads = SumThreads(config.server_engine_threads, "hostsum")  # a leader's large sums
        self._early: list[tuple[float, bytes, Push]] = []
        self.gone: dict[int, str] = {}  # workers of this generation that were lost or left, and why
        self.leader_left = 0.0  # when this local's leader left gracefully (0: it did not)

    def connect(self, book: Book) -> bool:
        """Take a new address book; True if the sockets to poll changed."""
        if self.rounds is not None:
            self.rounds.close("changed", f"generation {self.generation} of the job ended")
            self.rounds = None
        old, self.sock, self.route = self.sock, None, None
        if old is not None:
            old.close(linger=0)
        groups = push_pull_groups(book.workers, book.servers)
        group = group_of(groups, book.rank)
        self.hosting = any(len(g) > 1 for g in groups)
        self.whole_job = len(groups) == 1 and self.hosting
        self.leader, self.rank, self.generation = group[0], book.rank, book.generation
        self.gone = {}
        self.leader_left = 0.0
        if len(group) > 1 and self.leader == book.rank:
            self.rounds = HostAggregations(self.config, book.rank, book.generation, group, book.workers,
                                     self.push, self.fail, self.poison, finish=self.whole_job, threads=self.threads)
            self.rounds.sock = self.peer_sock
        elif len(group) > 1:
            self.sock = open_socket(self.ctx, SocketRole.TO_SERVER, self.config, host_route(self.uid, book.generation))
            self.sock.connect(book.workers[self.leader].addr)
            self.route = Route(self.sock, shared=True)
        early, self._early = self._early, []
        for since, route, push in early:
            self._take(since, route, push)
        return old is not None or self.sock is not None

    def way(self, op: Operation) -> Way:
        """How ``op``'s partitions go to the servers."""
        # rows: a leader could write into a local's row; store: each rank's change goes on its own
        if not self.hosting or op.codecs is not None or op.rows or op.store is not None:
            return Way.DIRECT
        if self.sock is not None:
            return Way.TO_LEADER
        return Way.HOST_ROUND if self.rounds is not None else Way.HOSTED

    def needs_segment(self, op: Operation) -> bool:
        """Whether ``op``'s payload must be in shared memory (a local's, or a leader's sum)."""
        return self.way(op) in (Way.TO_LEADER, Way.HOST_ROUND)

    # -- a leader's side -------------------------------------------------------------
    def on_local_push(self, route: bytes, push: Push) -> None:
        """A push that came to this worker's peer socket (from a local of its host)."""
        self._take(time.monotonic(), route, push)

    def _take(self, since: float, route: bytes, push: Push) -> None:
        if push.gen > self.generation:  # the local has the next address book already
            if len(self._early) >= MAX_EARLY:
                raise ProtocolError(f"rank {self.rank} holds {len(self._early)} pushes of generations "
                                    "it has no address book for")
            self._early.append((since, route, push))
        elif self.rounds is not None:
            self.rounds.on_local_push(route, push)
        else:
            raise ProtocolError(f"a push to rank {self.rank}, which leads no host group in generation "
                                f"{self.generation}")

    # -- failures and deadlines ------------------------------------------------------
    def worker_gone(self, rank: int, lost: bool, why: str) -> None:
        """A worker was lost or left: a local fails what waits on its leader (and refuses new
        work in a job that is not elastic: no round can complete), a leader the rounds that wait
        on it. A leader that left gracefully sent the results it had first: they get a moment."""
        if not lost:  # a rank that ended its loop early is the usual reason: say so, as a server does
            why = f"{why} (before pushing to this round; {UNEVEN_STEPS})"
        self.gone[rank] = why
        if self.rounds is not None:
            self.rounds.worker_gone(rank, why)
        elif self.sock is not None and rank == self.leader:
            if lost:
                self._fail_leader_waits()
            else:
                self.leader_left = time.monotonic()

    def _fail_leader_waits(self) -> None:
        for op in list(self.pending):
            if self.way(op) is Way.TO_LEADER:
                self.fail(op, self.refusal(op))

    def refusal(self, op: Operation) -> PeerLostError | None:
        """Why a local cannot push ``op`` to its leader now, or None."""
        if self.sock is None or not self.gone or (self.config.elastic and self.leader not in self.gone):
            return None
        why = "; ".join(self.gone.values())
        if self.leader in self.gone:
            return PeerLostError(f"push_pull {op.name!r}: this host's leader (rank {self.leader}) is gone: {why} "
                                 f"[on rank {self.rank}]")
        return PeerLostError(f"push_pull {op.name!r}: {why}; this job is not elastic, so it cannot go on "
                             f"[on rank {self.rank}]")

    def expire(self, now: float) -> None:
        """Fail host rounds and held pushes older than BPS_GOSSIP_TIMEOUT."""
        timeout = self.config.timeout
        for since, route, push in list(self._early):
            if now - since > timeout and self.peer_sock is not None:
                self._early.remove((since, route, push))
                send(self.peer_sock, Error(req=push.req, kind="timeout",
                                           why=f"rank {self.rank}: no address book of generation {push.gen} "
                                               f"within {timeout:.1f} s (BPS_GOSSIP_TIMEOUT)"), (), route)
        if self.rounds is not None:
            self.rounds.expire(now)
        if self.leader_left and now - self.leader_left > LEFT_GRACE:
            self.leader_left = 0.0
            self._fail_leader_waits()

    def overdue(self, now: float, after: float) -> list[tuple[list[int], str]]:
        """Locals this leader has waited on for ``after`` seconds (elastic stall reports)."""
        return self.rounds.overdue(now, after) if self.rounds is not None else []

    def close(self) -> None:
        """Close the leader link; end the host rounds."""
        if self.rounds is not None:
            self.rounds.close("lost", f"rank {self.rank}, this host's leader, shut down")
            self.rounds = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock, self.route = None, None
        self.threads.close()
