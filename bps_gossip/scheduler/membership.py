"""Who is in the job: registration, rank assignment and the generation number.

Pure bookkeeping, no sockets, so that it can change (elastic jobs) in one place.

Worker ranks follow BytePS: workers are grouped by machine (DMLC_WORKER_ID, or the
host when no id is given), a machine runs BYTEPS_LOCAL_SIZE processes, and
rank = (offset of the machine) + BYTEPS_LOCAL_RANK.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..errors import ConfigError


@dataclasses.dataclass
class Node:
    """One registered process."""

    uid: bytes
    role: str
    addr: str
    host: str
    pid: int
    worker_id: int | None = None
    local_rank: int = 0
    local_size: int = 1
    peer_addr: str = ""
    host_reduce: str = "off"
    rank: int = -1
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    state: str = "alive"  # alive | joining (elastic, not admitted yet) | left | lost
    seniority: tuple[int, int] = (0, 0)  # (generation admitted, rank or arrival then): lower is older
    local: Any = None  # a local_processes.LocalProcess when it runs on the scheduler's host
    progress: int | None = None  # a worker's count of operations its training started (heartbeats)
    progress_at: float = dataclasses.field(default_factory=time.monotonic)  # when that count last moved

    def describe(self) -> str:
        """A short human label, e.g. 'worker rank 2 (pid 123 on 127.0.0.1)'."""
        return f"{self.role} rank {self.rank} (pid {self.pid} on {self.host})"


MAX_JOINING = 256  # elastic: workers waiting for the next commit to join


class Membership:
    """The job's nodes and the address book handed out at every generation."""

    def __init__(self, num_worker_groups: int, num_server: int, elastic: bool = False,
                 max_workers: int = 0) -> None:
        self.num_worker_groups = num_worker_groups
        self.num_server = num_server
        self.elastic = elastic
        self.max_workers = max_workers
        self.nodes: dict[bytes, Node] = {}
        self.generation = 0
        self.started = False
        self._arrivals = 0

    # -- registration -------------------------------------------------------------
    def add(self, node: Node) -> None:
        """Add a registering node; raise ConfigError when it cannot fit this job.

        In an elastic job a worker that registers after the start waits as 'joining'
        until the next membership change admits it.
        """
        self._arrivals += 1
        if self.started and self.elastic and node.role == "worker":
            count = len(self.workers("alive")) + len(self.workers("joining"))
            if self.max_workers and count >= self.max_workers:
                raise ConfigError(f"the job already has {count} workers, BPS_GOSSIP_MAX_WORKERS={self.max_workers}")
            if len(self.workers("joining")) >= MAX_JOINING:  # each is kept until the next commit
                raise ConfigError(f"{MAX_JOINING} workers wait to join already; try again after the next commit")
            node.state = "joining"
            node.seniority = (self.generation + 1, self._arrivals)
            self.nodes[node.uid] = node
            return
        if self.started:
            raise ConfigError(
                f"the job already started with {len(self.workers())} workers and "
                f"{len(self.servers())} servers; a late {node.role} (pid {node.pid} on {node.host}) "
                "cannot join a job that is not elastic"
            )
        if node.role == "server" and len(self.servers()) >= self.num_server:
            raise ConfigError(f"more servers registered than DMLC_NUM_SERVER={self.num_server}")
        if node.role == "worker":
            group = self._group_of(node)
            for other in self.workers():
                if self._group_of(other) != group:
                    continue
                if other.local_rank == node.local_rank:
                    raise ConfigError(
                        f"two workers registered as BYTEPS_LOCAL_RANK={node.local_rank} of machine "
                        f"{group!r} (pids {other.pid} and {node.pid}); give each machine its own DMLC_WORKER_ID"
                    )
                if other.local_size != node.local_size:
                    raise ConfigError(
                        f"workers of machine {group!r} disagree on BYTEPS_LOCAL_SIZE "
                        f"({other.local_size} vs {node.local_size})"
                    )
            groups = {self._group_of(w) for w in self.workers()} | {group}
            if len(groups) > self.num_worker_groups:
                raise ConfigError(
                    f"more worker machines registered than DMLC_NUM_WORKER={self.num_worker_groups}"
                )
        self.nodes[node.uid] = node

    @staticmethod
    def _group_of(node: Node) -> Any:
        return node.worker_id if node.worker_id is not None else f"host:{node.host}"

    def complete(self) -> bool:
        """True when every expected server and worker process has registered."""
        if len(self.servers()) != self.num_server:
            return False
        groups: dict[Any, list[Node]] = {}
        for worker in self.workers():
            groups.setdefault(self._group_of(worker), []).append(worker)
        if len(groups) != self.num_worker_groups:
            return False
        return all(len(members) == members[0].local_size for members in groups.values())

    def assign_ranks(self) -> None:
        """Give every node its rank and open generation 1."""
        groups: dict[Any, list[Node]] = {}
        for worker in self.workers():
            groups.setdefault(self._group_of(worker), []).append(worker)
        offset = 0
        for key in sorted(groups, key=lambda k: (isinstance(k, str), k)):
            for worker in sorted(groups[key], key=lambda w: w.local_rank):
                worker.rank = offset + worker.local_rank
            offset += len(groups[key])
        for index, server in enumerate(sorted(self.servers(), key=lambda s: s.addr)):
            server.rank = index
        for worker in self.workers():
            worker.seniority = (0, worker.rank)
        now = time.monotonic()
        for node in self.nodes.values():
            node.last_seen = now  # rendezvous may have taken longer than a heartbeat timeout
        self.started = True
        self.generation += 1

    def next_generation(self) -> int:
        """Open a new generation (elastic: a change began); ranks follow in :meth:`reassign`."""
        self.generation += 1
        return self.generation

    def reassign(self) -> list[Node]:
        """Admit the joining workers and renumber: the oldest surviving worker becomes rank 0.

        Returns the admitted workers.
        """
        for uid in [uid for uid, node in self.nodes.items() if node.state in ("lost", "left")]:
            del self.nodes[uid]  # gone for good: their messages are refused as strangers' from now on
        joined = self.workers("joining")
        for worker in joined:
            worker.state = "alive"
            worker.last_seen = time.monotonic()
        alive = sorted((n for n in self.nodes.values() if n.role == "worker" and n.state == "alive"),
                       key=lambda n: n.seniority)
        for rank, worker in enumerate(alive):
            worker.rank = rank
        for index, server in enumerate(self.servers("alive")):
            server.rank = index
        return joined

    # -- views --------------------------------------------------------------------
    def workers(self, state: str | None = None) -> list[Node]:
        """Worker nodes, optionally only those in ``state``, in rank order."""
        nodes = [n for n in self.nodes.values() if n.role == "worker" and (state is None or n.state == state)]
        return sorted(nodes, key=lambda n: n.rank)

    def servers(self, state: str | None = None) -> list[Node]:
        """Server nodes, optionally only those in ``state``, in rank order."""
        nodes = [n for n in self.nodes.values() if n.role == "server" and (state is None or n.state == state)]
        return sorted(nodes, key=lambda n: n.rank)

    def book(self) -> dict[str, Any]:
        """The address book every node receives: generation, servers and workers by rank."""
        return {
            "generation": self.generation,
            "servers": [s.addr for s in self.servers("alive")],
            "workers": [
                {
                    "rank": w.rank,
                    "uid": w.uid.hex(),  # its routing id: servers and peers know its messages by it
                    "addr": w.peer_addr,
                    "host": w.host,
                    "pid": w.pid,
                    "local_rank": w.local_rank,
                    "local_size": w.local_size,
                    "host_reduce": w.host_reduce,
                }
                for w in self.workers("alive")
            ],
        }

    def forget(self, uid: bytes) -> None:
        """Before the rendezvous: drop a registered node that died, so that its place (its
        DMLC_WORKER_ID and BYTEPS_LOCAL_RANK, or a server's) is free for a replacement."""
        if self.started:
            raise RuntimeError("only a node that never had a rank can be forgotten")
        self.nodes.pop(uid, None)

    def mark(self, uid: bytes, state: str) -> Node | None:
        """Set a node's state to 'left' or 'lost'; return it if it was alive (or joining)."""
        node = self.nodes.get(uid)
        if node is None or node.state not in ("alive", "joining"):
            return None
        node.state = state
        return node

    def all_workers_gone(self) -> bool:
        """True once the job started and no worker is alive."""
        return self.started and not self.workers("alive")
