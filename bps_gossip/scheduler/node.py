"""The scheduler process: its socket, the handler table, barriers and commit checks, losses,
and the end of the job."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

import zmq

from .. import local_processes as reports  # the lines bpslaunch reads on our stderr
from ..config import Config, load_config, warn_if_no_secret
from ..errors import BpsGossipError, ConfigError, ProtocolError
from ..local_processes import LocalProcess, raise_open_files_limit
from ..logs import get_logger
from ..protocol import (
    Barrier,
    BarrierDone,
    BarrierFailed,
    Bye,
    Commit,
    CommitDone,
    Finished,
    HbAck,
    Heartbeat,
    JobFailed,
    Leave,
    Message,
    NodeLeft,
    NodeLost,
    Refused,
    Register,
    Rejoin,
    Stalled,
    Terminate,
    handlers,
    send,
)
from ..transport import shm
from ..transport.receive import DropLog, drain
from ..transport.security import FailedHandshakes
from ..transport.sockets import SocketRole, open_socket
from . import liveness
from .changes import Changes, address_book
from .membership import Membership, Node
from .orphaned import LauncherWatch
from .stalls import StallReports, heard_progress

MemberHandler = Callable[[bytes, Any, Node], None]


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


MAX_WAITS_PER_MEMBER = 16  # open barriers (and commit checks) one member may wait in


class Scheduler:
    """The scheduler's state and its single-threaded event loop."""

    def __init__(self, config: Config, report_registrations: bool = False) -> None:
        self.config = config
        self.report_registrations = report_registrations  # to the bpslaunch that started it (local_processes.py)
        self.log = get_logger("scheduler", config.log_level)
        warn_if_no_secret(config, self.log)
        self.members = Membership(config.num_worker, config.num_server, config.elastic, config.max_workers)
        self.ctx = zmq.Context.instance()
        self.sock = open_socket(self.ctx, SocketRole.SCHEDULER, config)
        self.sock.bind(f"tcp://{bind_host(config)}:{config.root_port}")
        self.knocks = FailedHandshakes(self.sock, self.log) if config.keys is not None else None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.log.info("listening on %s (others connect to %s)", self.endpoint, config.scheduler_address)
        self.barriers: dict[int, set[bytes]] = {}
        self.commits: dict[int, set[bytes]] = {}
        self.changes = Changes(config, self.members, self.log, self._send, self._end, self._void_barriers,
                               self._formed)
        self.stalls = StallReports(config, self.members, self.log, self._remove_stuck)
        self.worker_lost: str | None = None  # not elastic: the loss that broke the job
        self.exit_code = 0
        self.running = True
        self.created = time.monotonic()
        self.handlers = handlers({
            Register: self._on_register,
            Heartbeat: self._member(self._on_heartbeat, joiners=True),
            Leave: self._member(self._on_leave, joiners=True),
            Barrier: self._member(self._on_barrier),
            Commit: self._member(self._on_commit),
            Rejoin: self._member(self.changes.rejoin),
            Finished: self._member(lambda _uid, _msg, node: self.changes.finished(node)),
            Stalled: self._member(self._on_stalled),
        }, malformed={Register: self._refuse})
        self.drops = DropLog(self.log, "message")
        self.refusals = DropLog(self.log, "registration", verb="refused a", level=logging.ERROR)

    # -- sending ------------------------------------------------------------------
    def _send(self, uid: bytes, msg: Message) -> None:
        try:
            send(self.sock, msg, route=uid)
        except zmq.ZMQError as exc:
            self.log.warning("could not send %s to %r: %s", msg.op.value, uid, exc)

    def _tell_everyone(self, msg: Message, skip: bytes | None = None) -> None:
        for node in self.members.nodes.values():
            if node.state == "alive" and node.uid != skip:
                self._send(node.uid, msg)

    # -- registration -------------------------------------------------------------
    def _refuse(self, uid: bytes, _header: dict[str, Any], error: Exception) -> None:
        self.refusals.dropped(f"{error} (from {uid[:64]!r})")
        self._send(uid, Refused(why=str(error)))

    def _on_register(self, uid: bytes, msg: Register, _frames: list) -> None:
        cfg = self.config
        late_joiner = cfg.elastic and self.members.started and msg.role == "worker"
        for var, theirs, mine in (("DMLC_NUM_WORKER", msg.num_worker, cfg.num_worker),
                                  ("DMLC_NUM_SERVER", msg.num_server, cfg.num_server)):
            if theirs != mine and not late_joiner:  # a joiner need not know the job's initial shape
                self._send(uid, Refused(why=f"{var}={theirs} at the {msg.role} but {mine} at the scheduler"))
                return
        node = Node(uid=uid, role=msg.role, addr=msg.addr, host=msg.host, pid=msg.pid, worker_id=msg.worker_id,
                    local_rank=msg.local_rank, local_size=msg.local_size, peer_addr=msg.peer_addr,
                    host_reduce=msg.host_reduce if msg.role == "worker" else "off",
                    local=LocalProcess.find(msg.pid, msg.start_ticks))
        twin = self._same_process(node)
        if twin is not None:  # a pid and start time are world-readable: a claim, not a proof
            self._refuse(uid, {}, ConfigError(f"pid {node.pid} on this host is registered already, as "
                                              f"{twin.describe()}"))
            return
        try:
            if not self.members.started:  # a replacement may come before the next tick sees its predecessor die
                liveness.forget_dead_before_start(self.members, time.monotonic(), cfg.heartbeat_timeout, self.log)
            self.members.add(node)
        except (ConfigError, ProtocolError) as exc:
            self._refuse(uid, {}, exc)
            return
        self.log.info("registered %s pid %s on %s", node.role, node.pid, node.host)
        if self.report_registrations and node.role == "worker":
            print(f"{reports.WORKER_REGISTERED} {node.pid}", file=sys.stderr, flush=True)
        if node.state == "joining":
            self.changes.joiner(node)
        elif not self.members.started and self.members.complete():
            self.members.assign_ranks()
            for member in self.members.nodes.values():
                self._send(member.uid, address_book(self.members, member.rank))
            book = self.members.book()
            self.log.info("rendezvous complete: generation %d, %d workers, %d servers",
                          book["generation"], len(book["workers"]), len(book["servers"]))
            self._formed(book["generation"], len(book["workers"]))

    def _formed(self, generation: int, workers: int) -> None:  # an address book went out: tell bpslaunch
        if self.report_registrations:
            print(f"{reports.GENERATION_FORMED} {generation} {workers}", file=sys.stderr, flush=True)

    def _member(self, handle: MemberHandler, joiners: bool = False) -> Callable[[bytes, Any, list], None]:
        """A table entry for ops only registered members send (a joiner may heart-beat or leave)."""
        def gate(uid: bytes, msg: Any, _frames: list) -> None:
            node = self.members.nodes.get(uid)
            if node is not None:
                node.last_seen = time.monotonic()
            if node is None or not (node.state == "alive" or (joiners and node.state == "joining")):
                self._send(uid, Refused(why="not a registered member of this job"))
                return
            handle(uid, msg, node)
        return gate

    def _on_heartbeat(self, uid: bytes, msg: Heartbeat, node: Node) -> None:
        heard_progress(node, msg.progress, time.monotonic())
        if self.members.started:
            self._send(uid, HbAck())
        else:  # a registered node waiting for the rest: it can tell its user who is missing
            self._send(uid, HbAck(workers=len(self.members.workers()), servers=len(self.members.servers())))

    def _on_leave(self, uid: bytes, msg: Leave, node: Node) -> None:
        joining = node.state == "joining"
        self.members.mark(uid, "lost" if msg.crashed and not joining else "left")
        self._send(uid, Bye())
        if joining:
            return  # never admitted: nobody depended on it
        if msg.crashed:
            self._on_gone(node, "lost", "exited with an uncaught exception")
        else:
            self._on_gone(node, "left", "shut down")

    # -- barriers and commit checks -----------------------------------------------
    def _waits_too_often(self, uid: bytes, table: dict[int, set[bytes]], seq: int) -> bool:
        """Whether a member already waits in MAX_WAITS_PER_MEMBER open barriers (or commit checks):
        a worker waits in one or two; each seq it invents would be kept until everyone came."""
        return seq not in table and sum(uid in waiting for waiting in table.values()) >= MAX_WAITS_PER_MEMBER

    def _on_barrier(self, uid: bytes, msg: Barrier, node: Node) -> None:
        if self.changes.change is not None:
            return  # sent in the old generation: the worker fails it itself on 'changed'
        if self.worker_lost is not None:  # a job without its lost worker cannot meet again
            self._send(uid, BarrierFailed(seq=msg.seq, why=self.worker_lost))
            return
        if self._waits_too_often(uid, self.barriers, msg.seq):
            self._send(uid, BarrierFailed(seq=msg.seq, why=f"{node.describe()} waits in {MAX_WAITS_PER_MEMBER} "
                                                           "barriers already"))
            return
        waiting = self.barriers.setdefault(msg.seq, set())
        waiting.add(uid)
        alive = {w.uid for w in self.members.workers("alive")}
        if alive <= waiting:
            for member in waiting & alive:
                self._send(member, BarrierDone(seq=msg.seq))
            del self.barriers[msg.seq]

    def _on_commit(self, uid: bytes, msg: Commit, _node: Node) -> None:
        """A commit check: a barrier whose answer (join or not) is the same for every worker."""
        if self.changes.change is not None:
            return  # the worker is told 'changed' and fails the check itself
        if self._waits_too_often(uid, self.commits, msg.seq):
            return  # nobody waits in sixteen commit checks: only a misbehaving member does
        waiting = self.commits.setdefault(msg.seq, set())
        waiting.add(uid)
        if {w.uid for w in self.members.workers("alive")} <= waiting:
            del self.commits[msg.seq]
            joining = self.members.workers("joining")
            for member in waiting:
                self._send(member, CommitDone(seq=msg.seq, changed=bool(joining)))
            if joining:
                self.changes.begin(restore=False, why=f"{len(joining)} worker(s) joined")

    def _void_barriers(self) -> None:
        self.barriers.clear()
        self.commits.clear()

    # -- losses -------------------------------------------------------------------
    def _on_gone(self, node: Node, how: str, reason: str) -> None:
        """A node left (gracefully) or was lost: tell everyone, fail barriers it blocks."""
        self.log.log(logging.WARNING if how == "lost" else logging.INFO, "%s %s: %s", node.describe(), how, reason)
        self._sweep(node, how)
        if self.config.elastic and self.members.started:
            self.changes.gone(node, how, reason)
            return
        notice = (NodeLost if how == "lost" else NodeLeft)(role=node.role, rank=node.rank, pid=node.pid,
                                                           host=node.host, why=reason)
        self._tell_everyone(notice, skip=node.uid)
        if node.role == "worker" and how == "lost":
            self.worker_lost = f"{node.describe()} {how}: {reason}"
        if node.role == "worker":
            for seq, waiting in list(self.barriers.items()):
                for member in waiting:
                    self._send(member, BarrierFailed(seq=seq, why=f"{node.describe()} {how} during barrier: {reason}"))
                del self.barriers[seq]
        if self.members.all_workers_gone():
            self._terminate("every worker has shut down")

    def _sweep(self, node: Node, how: str) -> None:
        if how == "lost" and node.role == "worker" and node.host == self.config.node_host:
            # A killed worker cannot unlink its shared memory (its resource tracker may be gone too).
            removed = shm.sweep(self.config.job_id, node.pid)
            if removed:
                self.log.info("removed %d shared-memory segments of %s", removed, node.describe())

    def _on_stalled(self, _uid: bytes, msg: Stalled, reporter: Node) -> None:
        if self.config.elastic and self.changes.change is None:  # else a change is under way already
            self.stalls.report(msg, reporter, time.monotonic())

    def _remove_stuck(self, worker: Node, reason: str) -> None:
        self.members.mark(worker.uid, "lost")
        self._remove_for_good(worker, reason)
        self._on_gone(worker, "lost", reason)

    def _same_process(self, node: Node) -> Node | None:
        """A live member that registered with the same process of this host as ``node``."""
        if node.local is None:
            return None
        for other in self.members.nodes.values():
            if other.state in ("alive", "joining") and other.local is not None \
                    and (other.local.pid, other.local.ticks) == (node.local.pid, node.local.ticks):
                return other
        return None

    def _remove_for_good(self, node: Node, why: str) -> None:
        """Elastic: a worker declared lost while its process lives (stopped, stuck) must not come
        back half-way into a job that went on. The scheduler signals nobody (a pid in a registration
        proves nothing): it asks the bpslaunch that started it, which stops the worker only if it
        started that very process. Without bpslaunch the worker stays out of the job: every member
        refuses it."""
        if self.config.elastic and node.role == "worker" and node.local is not None and node.local.alive():
            self.log.warning("%s is alive but %s: asking its launcher to stop it", node.describe(), why)
            print(f"{reports.STOP_REQUEST} {node.local.pid} {node.local.ticks}", file=sys.stderr, flush=True)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        if not self.members.started:
            liveness.forget_dead_before_start(self.members, now, self.config.heartbeat_timeout, self.log)
            if now - self.created > self.config.start_timeout:
                self._fail_job(self._incomplete_start(now - self.created))
            return
        for node, why in liveness.silent(self.members, now, self.config.heartbeat_timeout):
            if node.state in ("alive", "joining"):  # an earlier loss of this pass may have ended it
                self.members.mark(node.uid, "lost")
                self._remove_for_good(node, why)
                self._on_gone(node, "lost", why)
        if self.config.elastic and self.running:
            if self.changes.change is None:
                self.stalls.check(now)
            self.changes.check(now)

    # -- the end ------------------------------------------------------------------
    def _incomplete_start(self, waited: float) -> str:
        workers = self.members.workers()
        hosts = sorted(f"worker pid {w.pid} on {w.host}" for w in workers)
        return (f"the rendezvous did not complete within BPS_GOSSIP_START_TIMEOUT={self.config.start_timeout:g} s "
                f"({waited:.0f} s): {len(self.members.servers())} of DMLC_NUM_SERVER={self.config.num_server} "
                f"servers and {len(workers)} worker process(es) of DMLC_NUM_WORKER={self.config.num_worker} "
                f"machine(s) registered{': ' + ', '.join(hosts) if hosts else ''}")

    def _end(self, why: str, failed: bool) -> None:
        if failed:
            self._fail_job(why)
        else:
            self._terminate(why)

    def _fail_job(self, why: str) -> None:
        self.log.error("the job failed: %s", why)
        for member in self.members.nodes.values():
            if member.role == "worker" and member.state in ("alive", "joining"):
                self._send(member.uid, JobFailed(why=why))
        self.exit_code = 1
        self._terminate(why)

    def _terminate(self, why: str) -> None:
        self.log.info("terminating: %s", why)
        for joiner in self.members.workers("joining"):  # waiting to be admitted: tell them, do not let them wait
            self._send(joiner.uid, JobFailed(why=f"the job ended before this worker was admitted ({why})"))
        for server in self.members.servers("alive"):
            self._send(server.uid, Terminate(why=why))
        self.running = False

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
                if self.knocks is not None:
                    self.knocks.check()
        finally:
            if self.knocks is not None:
                self.knocks.close()
            self.sock.close(linger=1000)


def main() -> int:
    """Entry point: run the scheduler from the environment."""
    watch = LauncherWatch()
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends it through its clean-up
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
        watch.install()
    try:
        return _run(watch.report_registrations)
    finally:
        watch.clean_up()


def _run(report_registrations: bool) -> int:
    try:
        config = load_config()
        raise_open_files_limit()
        scheduler = Scheduler(config, report_registrations)
        scheduler.run()
        return scheduler.exit_code
    except BpsGossipError as exc:
        print(f"bps_gossip scheduler: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:
        taken = ("; another job or job step uses this port: export DMLC_PS_ROOT_PORT=<a free port>"
                 if exc.errno == errno.EADDRINUSE else "")
        print(f"bps_gossip scheduler: cannot bind DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT "
              f"({config.root_uri}:{config.root_port}): {exc}{taken}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
