"""The scheduler: rendezvous, ranks, address book, barriers, heartbeats.

It binds DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT with one ROUTER socket (every interface with
DMLC_USE_KUBERNETES=1). Every server and worker registers; when all are in, each gets the
address book and its rank. Nodes that stop heart-beating are declared lost, and every
other node is told at once so that nobody waits for the dead. Once every worker has left
or died, the scheduler tells the servers to terminate and exits (BytePS issue #264: its
scheduler never did).

Elastic jobs (BPS_GOSSIP_ELASTIC=1) change membership instead of failing: a lost
worker or server, a graceful leave, or (at the next commit check) workers waiting to
join open a new generation. Every member is told ``changed`` at once (pending work
of the old generation fails, recoverably); the workers answer ``rejoin``; once all
have, the new address book goes out with one ``restore`` flag for everybody (true if
anything crashed since the last book). A job below BPS_GOSSIP_MIN_WORKERS for longer
than BPS_GOSSIP_ELASTIC_TIMEOUT fails with a message to every worker.

Run it with ``DMLC_ROLE=scheduler bpslaunch`` or ``python -m bps_gossip.scheduler``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import time
from typing import Any

import zmq

from . import fields
from .config import Config, load_config
from .errors import BpsGossipError, ConfigError, ProtocolError
from .liveness import LocalProcess
from .logs import get_logger
from .membership import Membership, Node
from .transport import send_message, shm
from .transport.framing import MAX_HEADER_BYTES
from .transport.receive import DropLog, drain
from .transport.security import make_socket

MAX_CONTROL_BYTES = 4 * MAX_HEADER_BYTES  # the largest message the scheduler accepts


@dataclasses.dataclass
class Change:
    """An elastic membership change in progress: who has rejoined, and why it began."""

    generation: int
    restore: bool
    why: list[str]
    since: float = dataclasses.field(default_factory=time.monotonic)
    ready: set[bytes] = dataclasses.field(default_factory=set)


def bind_host(config: Config) -> str:
    """The address the scheduler binds: every interface (0.0.0.0) with DMLC_USE_KUBERNETES=1,
    as ps-lite does (DMLC_PS_ROOT_URI then names a Service, whose address may not be the pod's,
    or whose DNS record may not exist yet when the scheduler starts); else DMLC_PS_ROOT_URI's
    address."""
    if config.use_kubernetes:
        return "0.0.0.0"
    try:
        return socket.gethostbyname(config.root_uri)
    except OSError as exc:
        raise ConfigError(f"DMLC_PS_ROOT_URI={config.root_uri!r} cannot be resolved ({exc}); "
                          "under Kubernetes set DMLC_USE_KUBERNETES=1 (the scheduler then binds "
                          "0.0.0.0)") from None


class Scheduler:
    """The scheduler's state and its single-threaded event loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = get_logger("scheduler", config.log_level)
        self.members = Membership(config.num_worker, config.num_server, config.elastic, config.max_workers)
        self.ctx = zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.ROUTER, config.keys, serve=True)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Only small control messages come here: a larger one drops its sender's connection
        # before anything is allocated for it.
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.sock.bind(f"tcp://{bind_host(config)}:{config.root_port}")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.log.info("listening on %s (others connect to %s)", self.endpoint, config.scheduler_address)
        self.barriers: dict[int, set[bytes]] = {}
        self.commits: dict[int, set[bytes]] = {}
        self.change: Change | None = None  # an elastic membership change waiting for rejoins
        self.closing: str | None = None  # elastic: why the job admits nobody more (a worker finished)
        self.worker_lost: str | None = None  # not elastic: the loss that broke the job
        self.exit_code = 0
        self.running = True
        self.created = time.monotonic()
        self.member_handlers = {
            "heartbeat": self._on_heartbeat, "leave": self._on_leave,
            "barrier": lambda uid, msg, _node: self._on_barrier(uid, msg),
            "commit": lambda uid, msg, _node: self._on_commit(uid, msg),
            "rejoin": lambda uid, msg, node: self._on_rejoin(uid, msg, node),
            "finished": lambda _uid, _msg, node: self._on_finished(node),
            "stalled": lambda _uid, msg, node: self._on_stalled(msg, node),
        }
        self.handlers = {"register": lambda uid, msg, _frames: self._on_register(uid, msg),
                         **dict.fromkeys(self.member_handlers, self._from_member)}
        self.drops = DropLog(self.log, "message")

    # -- sending ------------------------------------------------------------------
    def _send(self, uid: bytes, header: dict[str, Any]) -> None:
        try:
            send_message(self.sock, header, route=uid)
        except zmq.ZMQError as exc:
            self.log.warning("could not send %s to %r: %s", header.get("op"), uid, exc)

    def _tell_everyone(self, header: dict[str, Any], skip: bytes | None = None) -> None:
        for node in self.members.nodes.values():
            if node.state == "alive" and node.uid != skip:
                self._send(node.uid, header)

    # -- handlers -----------------------------------------------------------------
    def _on_register(self, uid: bytes, msg: dict[str, Any]) -> None:
        late_joiner = self.config.elastic and self.members.started and msg.get("role") == "worker"
        for var, mine in (("DMLC_NUM_WORKER", self.config.num_worker), ("DMLC_NUM_SERVER", self.config.num_server)):
            theirs = msg.get(var)
            if theirs != mine and not late_joiner:  # a joiner need not know the job's initial shape
                self._send(uid, {"op": "refused", "why": f"{var}={theirs} at the {msg.get('role')} but {mine} at the scheduler"})
                return
        try:
            node = Node(
                uid=uid,
                role=fields.text(msg, "role", 16),
                addr=fields.text(msg, "addr", 256, ""),
                host=fields.text(msg, "host", 256, ""),
                pid=fields.integer(msg, "pid", 0, 1 << 31, 0),
                worker_id=fields.optional_integer(msg, "worker_id", 0, 1 << 20),
                local_rank=fields.integer(msg, "local_rank", 0, 1 << 16, 0),
                local_size=fields.integer(msg, "local_size", 1, 1 << 16, 1),
                peer_addr=fields.text(msg, "peer_addr", 256, ""),
            )
            if node.role not in ("worker", "server"):
                raise ConfigError(f"cannot register role {node.role!r}")
            if node.local_rank >= node.local_size:
                raise ConfigError(f"local_rank {node.local_rank} is not below local_size {node.local_size}")
            node.local = LocalProcess.find(node.pid, fields.optional_integer(msg, "start_ticks", 0, fields.MAX_INT))
            if not self.members.started:  # a replacement may come before the next tick sees its predecessor die
                self._forget_dead_before_start(time.monotonic())
            self.members.add(node)
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            self.log.error("refused registration from %r: %s", uid, exc)
            self._send(uid, {"op": "refused", "why": str(exc)})
            return
        self.log.info("registered %s pid %s on %s", node.role, node.pid, node.host)
        if node.state == "joining" and self.closing is not None:
            self._job_over(node)
            return
        if node.state == "joining":
            self._send(uid, {"op": "wait", "why": "the job is running; joining at its next commit"})
            if self.change is not None or not self.members.workers("alive"):
                self._maybe_finish_change()  # nobody will commit: admit it with this change
            return
        if not self.members.started and self.members.complete():
            self.members.assign_ranks()
            book = self.members.book()
            for member in self.members.nodes.values():
                self._send(member.uid, {"op": "book", "rank": member.rank, "book": book})
            self.log.info("rendezvous complete: generation %d, %d workers, %d servers",
                          book["generation"], len(book["workers"]), len(book["servers"]))

    def _on_barrier(self, uid: bytes, msg: dict[str, Any]) -> None:
        if self.change is not None:
            return  # sent in the old generation: the worker fails it itself on 'changed'
        seq = fields.integer(msg, "seq", 0, fields.MAX_INT, 0)
        if self.worker_lost is not None:  # a job without its lost worker cannot meet again
            self._send(uid, {"op": "barrier_failed", "seq": seq, "why": self.worker_lost})
            return
        waiting = self.barriers.setdefault(seq, set())
        waiting.add(uid)
        alive = {w.uid for w in self.members.workers("alive")}
        if alive <= waiting:
            for member in waiting & alive:
                self._send(member, {"op": "barrier_done", "seq": seq})
            del self.barriers[seq]

    def _on_gone(self, node: Node, how: str, reason: str) -> None:
        """A node left (gracefully) or was lost: tell everyone, fail barriers it blocks."""
        level = logging.WARNING if how == "lost" else logging.INFO
        self.log.log(level, "%s %s: %s", node.describe(), how, reason)
        self._sweep(node, how)
        if self.config.elastic and self.members.started:
            self._on_gone_elastic(node, how, reason)
            return
        notice = {"op": f"node_{how}", "role": node.role, "rank": node.rank, "pid": node.pid,
                  "host": node.host, "why": reason}
        self._tell_everyone(notice, skip=node.uid)
        if node.role == "worker" and how == "lost":
            self.worker_lost = f"{node.describe()} {how}: {reason}"
        if node.role == "worker":
            for seq, waiting in list(self.barriers.items()):
                for member in waiting:
                    self._send(member, {"op": "barrier_failed", "seq": seq,
                                        "why": f"{node.describe()} {how} during barrier: {reason}"})
                del self.barriers[seq]
        if self.members.all_workers_gone():
            self._terminate("every worker has shut down")

    def _sweep(self, node: Node, how: str) -> None:
        if how == "lost" and node.role == "worker" and node.host == self.config.node_host:
            # A killed worker cannot unlink its shared memory (its resource tracker may be gone too).
            removed = shm.sweep(self.config.job_id, node.pid)
            if removed:
                self.log.info("removed %d shared-memory segments of %s", removed, node.describe())

    # -- elastic membership -------------------------------------------------------
    def _on_gone_elastic(self, node: Node, how: str, reason: str) -> None:
        if node.state == "joining" or (node.role == "worker" and node.rank < 0):
            return  # never admitted: nobody depended on it
        if node.role == "server":
            if not self.members.servers("alive"):
                self._fail_job(f"the last server ({node.describe()}) {how}: {reason}")
                return
        elif not self.members.workers("alive") and not self.members.workers("joining") \
                and (how == "left" or self.closing is not None):
            self._terminate("every worker has shut down" if how == "left" else
                            f"the last worker was lost after the job finished training ({self.closing})")
            return
        self._begin_change(restore=how == "lost", why=f"{node.describe()} {how}: {reason}")

    def _begin_change(self, restore: bool, why: str) -> None:
        """Open a new generation: every member drops the old one and the workers rejoin."""
        generation = self.members.next_generation()
        if self.change is not None:  # a change during a change: one more reason, same rendezvous
            restore = restore or self.change.restore
            reasons = [*self.change.why, why]
            since = self.change.since
        else:
            reasons, since = [why], time.monotonic()
        self.change = Change(generation, restore, reasons, since)
        self.barriers.clear()  # their members fail them locally on 'changed'
        self.commits.clear()
        self.log.info("generation %d begins (%s): %s", generation, "restore" if restore else "no restore", why)
        notice = {"op": "changed", "generation": generation, "restore": restore, "why": why}
        for member in self.members.nodes.values():
            if member.state == "alive":
                self._send(member.uid, notice)
        self._maybe_finish_change()

    def _on_rejoin(self, uid: bytes, msg: dict[str, Any], node: Node) -> None:
        if self.change is None or int(msg.get("generation", -1)) != self.change.generation:
            return  # an old generation's rejoin: a newer 'changed' is on its way to it
        if self.closing is not None and msg.get("has_state") is False:
            self._job_over(node)  # admitted, but the job finished before its state sync did
        else:
            self.change.ready.add(uid)
        self._maybe_finish_change()

    # -- the end of an elastic job ------------------------------------------------
    def _on_finished(self, node: Node) -> None:
        """A worker finished training: the job succeeds from here on. Nobody more is admitted,
        joiners without the job's state are told it is over (they exit 0), and the job no
        longer fails for having fewer than BPS_GOSSIP_MIN_WORKERS (the rest are finishing)."""
        if not self.config.elastic or self.closing is not None:
            return
        self.closing = f"{node.describe()} finished training"
        self.log.info("%s: the job admits no more workers", self.closing)
        for joiner in self.members.workers("joining"):
            self._job_over(joiner)

    def _job_over(self, node: Node) -> None:
        self.members.mark(node.uid, "left")
        self._send(node.uid, {"op": "job_over", "why": self.closing})
        self.log.info("%s is not needed: %s", node.describe(), self.closing)

    def _maybe_finish_change(self) -> None:
        """Send the new book once every surviving worker rejoined and there are enough."""
        if self.change is None:
            if self.members.workers("joining"):
                self._begin_change(restore=False, why="workers joined a job without workers")
            return
        alive = {w.uid for w in self.members.workers("alive")}
        count = len(alive) + len(self.members.workers("joining"))
        if not alive and self.closing is not None:
            self._terminate(f"every worker has finished ({self.closing})")
            return
        needed = 1 if self.closing is not None else max(1, self.config.min_workers)
        if not alive <= self.change.ready or count < needed:
            return
        change, self.change = self.change, None
        joined = self.members.reassign()
        book = self.members.book()
        for member in self.members.nodes.values():
            if member.state == "alive":
                self._send(member.uid, {"op": "book", "rank": member.rank, "book": book, "restore": change.restore})
        self.log.info("generation %d: %d workers (%d joined), %d servers, restore=%s",
                      book["generation"], len(book["workers"]), len(joined), len(book["servers"]), change.restore)

    def _on_commit(self, uid: bytes, msg: dict[str, Any]) -> None:
        """A commit check: a barrier whose answer (join or not) is the same for every worker."""
        if self.change is not None:
            return  # the worker is told 'changed' and fails the check itself
        seq = fields.integer(msg, "seq", 0, fields.MAX_INT, 0)
        waiting = self.commits.setdefault(seq, set())
        waiting.add(uid)
        if {w.uid for w in self.members.workers("alive")} <= waiting:
            del self.commits[seq]
            joining = self.members.workers("joining")
            for member in waiting:
                self._send(member, {"op": "commit_done", "seq": seq, "changed": bool(joining)})
            if joining:
                self._begin_change(restore=False, why=f"{len(joining)} worker(s) joined")

    def _check_elastic(self, now: float) -> None:
        if not self.running or self.change is None or now - self.change.since <= self.config.elastic_timeout:
            return
        busy = [w for w in self.members.workers("alive") if w.uid not in self.change.ready]
        if busy and not self.change.restore:
            # Only graceful leaves so far: workers that have not rejoined are finishing their own
            # work (a last evaluation, a checkpoint) and will leave or rejoin; nothing is stuck.
            return
        count = len(self.members.workers("alive")) + len(self.members.workers("joining"))
        if count < self.config.min_workers and self.closing is None:
            self._fail_job(f"only {count} worker(s) for {now - self.change.since:.0f} s, fewer than "
                           f"BPS_GOSSIP_MIN_WORKERS={self.config.min_workers} "
                           f"(BPS_GOSSIP_ELASTIC_TIMEOUT={self.config.elastic_timeout:g}); last change: "
                           + "; ".join(self.change.why))
        else:
            missing = [w.describe() for w in self.members.workers("alive") if w.uid not in self.change.ready]
            self._fail_job(f"{', '.join(missing)} did not rejoin generation {self.change.generation} within "
                           f"BPS_GOSSIP_ELASTIC_TIMEOUT={self.config.elastic_timeout:g} s")

    def _incomplete_start(self, waited: float) -> str:
        workers = self.members.workers()
        hosts = sorted(f"worker pid {w.pid} on {w.host}" for w in workers)
        return (f"the rendezvous did not complete within BPS_GOSSIP_START_TIMEOUT={self.config.start_timeout:g} s "
                f"({waited:.0f} s): {len(self.members.servers())} of DMLC_NUM_SERVER={self.config.num_server} "
                f"servers and {len(workers)} worker process(es) of DMLC_NUM_WORKER={self.config.num_worker} "
                f"machine(s) registered{': ' + ', '.join(hosts) if hosts else ''}")

    def _fail_job(self, why: str) -> None:
        self.log.error("the job failed: %s", why)
        for member in self.members.nodes.values():
            if member.role == "worker" and member.state in ("alive", "joining"):
                self._send(member.uid, {"op": "job_failed", "why": why})
        self.exit_code = 1
        self._terminate(why)

    def _terminate(self, why: str) -> None:
        self.log.info("terminating: %s", why)
        for joiner in self.members.workers("joining"):  # waiting to be admitted: tell them, do not let them wait
            self._send(joiner.uid, {"op": "job_failed", "why": f"the job ended before this worker was admitted ({why})"})
        for server in self.members.servers("alive"):
            self._send(server.uid, {"op": "terminate", "why": why})
        self.running = False

    def _from_member(self, uid: bytes, msg: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        """Every op but register: only from a registered member (a joiner may heart-beat or leave)."""
        op = msg["op"]
        node = self.members.nodes.get(uid)
        if node is not None:
            node.last_seen = time.monotonic()
        if node is not None and node.state == "joining" and op in ("heartbeat", "leave"):
            if op == "heartbeat":
                self._send(uid, {"op": "hb_ack"})
            else:
                self.members.mark(uid, "left")
                self._send(uid, {"op": "bye"})
        elif node is None or node.state != "alive":
            self._send(uid, {"op": "refused", "why": "not a registered member of this job"})
        else:
            self.member_handlers[op](uid, msg, node)

    def _on_heartbeat(self, uid: bytes, _msg: dict[str, Any], _node: Node) -> None:
        self._send(uid, {"op": "hb_ack"})

    def _on_leave(self, uid: bytes, msg: dict[str, Any], node: Node) -> None:
        crashed = msg.get("crashed") is True
        self.members.mark(uid, "lost" if crashed else "left")
        self._send(uid, {"op": "bye"})
        if crashed:
            self._on_gone(node, "lost", "exited with an uncaught exception")
        else:
            self._on_gone(node, "left", "shut down")

    def _on_stalled(self, msg: dict[str, Any], reporter: Node) -> None:
        """Elastic: a server (or a worker waiting for gossip) saw ranks push nothing for
        BPS_GOSSIP_STALL_TIMEOUT while others waited: stuck workers are removed like lost ones."""
        generation = fields.integer(msg, "generation", 0, fields.MAX_INT)
        if not self.config.elastic or self.change is not None or generation != self.members.generation:
            return  # a change is under way already, or the report is of an old generation
        ranks = set(fields.integers(msg, "ranks", 64, 0, 1 << 20))
        why = fields.text(msg, "why", 512, "")
        for worker in self.members.workers("alive"):
            if worker.rank in ranks and worker is not reporter:
                reason = f"stuck: {why} (BPS_GOSSIP_STALL_TIMEOUT={self.config.stall_timeout:g}, seen by {reporter.describe()})"
                self.members.mark(worker.uid, "lost")
                self._remove_for_good(worker, reason)
                self._on_gone(worker, "lost", reason)

    def _remove_for_good(self, node: Node, why: str) -> None:
        """Elastic: a worker declared lost while its process lives (stopped, stuck) is killed when
        it runs on this host, so that it cannot come back half-way into a job that went on."""
        if self.config.elastic and node.role == "worker" and node.local is not None and node.local.alive():
            self.log.warning("%s is alive but %s: stopping it (SIGKILL)", node.describe(), why)
            node.local.kill()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        if not self.members.started:
            self._forget_dead_before_start(now)
            if now - self.created > self.config.start_timeout:
                self._fail_job(self._incomplete_start(now - self.created))
            return
        for node in list(self.members.nodes.values()):
            if node.state not in ("alive", "joining"):
                continue
            if node.local is not None and not node.local.alive():
                # On this host the kernel tells at once; heartbeats would take a timeout.
                self.members.mark(node.uid, "lost")
                self._on_gone(node, "lost", "its process exited")
            elif now - node.last_seen > self.config.heartbeat_timeout:
                self.members.mark(node.uid, "lost")
                self._remove_for_good(node, f"no heartbeat for {now - node.last_seen:.1f} s")
                self._on_gone(node, "lost", f"no heartbeat for {now - node.last_seen:.1f} s")
        if self.config.elastic:
            self._check_elastic(now)

    def _forget_dead_before_start(self, now: float) -> None:
        """A node that registered and died before the rendezvous would hold its place for good
        (a replacement is refused as a duplicate, the rendezvous never completes): forget it."""
        for node in list(self.members.nodes.values()):
            if node.local is not None and not node.local.alive():
                why = "its process exited"
            elif now - node.last_seen > self.config.heartbeat_timeout:
                why = f"no heartbeat for {now - node.last_seen:.1f} s"
            else:
                continue
            self.members.forget(node.uid)
            self.log.warning("%s pid %s on %s is gone before the rendezvous (%s); its place is free again",
                             node.role, node.pid, node.host, why)

    # -- loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Serve until every worker has gone; then terminate the servers and return."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        tick = min(0.5, self.config.heartbeat_interval)
        try:
            while self.running:
                if poller.poll(int(tick * 1000)):
                    # bounded: a flood of messages cannot hold off the heartbeat checks
                    drain(self.sock, True, self.handlers, self.drops, 1024)
                self._check_heartbeats()
        finally:
            self.sock.close(linger=1000)


def main() -> int:
    """Entry point: run the scheduler from the environment."""
    try:
        config = load_config()
        scheduler = Scheduler(config)
        scheduler.run()
        return scheduler.exit_code
    except BpsGossipError as exc:
        print(f"bps_gossip scheduler: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:
        print(f"bps_gossip scheduler: cannot bind DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
