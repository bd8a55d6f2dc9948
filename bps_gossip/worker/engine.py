"""The worker's communication engine: one background thread, its poller and its inbox.

API calls (any thread) put a typed command (worker.commands) in the inbox, wake the
thread through a pipe and get a :class:`concurrent.futures.Future` back. The thread owns
three parts, each with its own socket(s), and only routes between them:

- :class:`~bps_gossip.worker.scheduler_link.SchedulerLink`: registration, address books,
  heartbeats, barriers, commit checks, notices, leaving;
- :class:`~bps_gossip.worker.server_links.ServerLinks`: partitions, credit, replies, deadlines;
- :class:`~bps_gossip.worker.peer_endpoint.PeerEndpoint`: gossip between workers.

Generations (elastic jobs): when the scheduler says a generation ended, pending work fails
with WorkersChangedError (at once after a crash; after a short grace for a graceful change,
so that results already on their way still land), new work fails until ``reset()`` sends a
Rejoin, and the next address book starts the new generation everywhere.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable

import zmq

from ..config import Config, warn_if_no_secret
from ..errors import BpsGossipError, NotInitializedError, PeerLostError, WorkersChangedError
from ..futures import Future, complete, fail, wait
from ..logs import get_logger
from ..thread_names import ENGINE, named
from ..transport.security import routing_id
from ..transport.shm import SegmentPool, shm_available
from . import commands as cmd
from .operation import Operation
from .peer_endpoint import PeerEndpoint
from .scheduler_link import Book, SchedulerLink
from .server_links import ServerLinks
from .trace import Tracer

CHANGE_GRACE = 1.0  # seconds pending work may still complete after a graceful change
UNSTOPPABLE = (cmd.Stop, cmd.Finished, cmd.Rejoin, cmd.HoldsState)  # run even in a stale generation
PEER_TRAFFIC = (cmd.PeerSend, cmd.PeerAck, cmd.PeerBlocked)  # dropped quietly in a stale generation


class Engine:
    """Owns the worker's sockets on a background thread; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = get_logger("worker", config.log_level)
        warn_if_no_secret(config, self.log)
        # The routing id on every connection: servers and peers know this worker's rank by it
        # (from the address book); with a secret it names this process's own key (transport.security).
        self.uid = routing_id("worker", config.keys)
        self.tracer = Tracer(config.trace_dir, config.local_rank, config.trace_start, config.trace_end) \
            if config.trace_on else None
        self.segments = SegmentPool(config.job_id) if config.shm and shm_available() else None
        ctx = zmq.Context.instance()
        # Made here, used only by the engine thread from start() on (thread start is a barrier).
        self.scheduler = SchedulerLink(ctx, config, self.uid, self.log, listener=self)
        # A host leader's locals push to its peer socket, and it answers them there.
        self.peers = PeerEndpoint(ctx, config, self.uid, self.log, self.segments, on_push=self._on_local_push,
                                  entered=self.entered)
        self.servers = ServerLinks(ctx, config, self.uid, self.log, self.segments, self.tracer, self.peers.sock)
        self.book: Book | None = None  # replaced whole at every generation: safe to read anywhere
        self.has_state = False  # elastic: this worker holds the job's state (told on rejoin)
        # API threads append, the engine thread pops (both atomic); a deque, not a queue: an empty
        # queue.SimpleQueue says so by raising, once per wake of the engine thread.
        self._inbox: collections.deque[cmd.Command] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._seqs: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self.submitted = 0  # commands handed to the engine thread: the progress heartbeats carry
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._broken: BpsGossipError | None = None  # the job cannot go on: everything fails with it
        self._dead: BpsGossipError | None = None  # set once the engine thread has ended
        self._stale: WorkersChangedError | None = None  # the error of a generation that ended
        self._stale_grace = 0.0  # graceful change: when pending work of the old generation fails
        self._target_gen = 0  # the generation announced, book not here yet
        self._rejoin: Future | None = None
        self._sockets_changed = False
        self._running = True
        self._handlers: dict[type, Callable[[Any], None]] = {
            cmd.Submit: self._on_submit, cmd.Barrier: self._on_barrier, cmd.Stats: self._on_stats,
            cmd.Commit: self._on_commit, cmd.Rejoin: self._on_rejoin, cmd.Finished: self._on_finished,
            cmd.HoldsState: self._on_holds_state, cmd.Stop: self._on_stop, cmd.PeerSend: self.peers.send,
            cmd.PeerAck: self.peers.ack, cmd.PeerExpect: self.peers.expect, cmd.PeerBlocked: self.peers.blocked,
        }
        self._thread = threading.Thread(target=named(ENGINE, self._main), name="bps-gossip-engine", daemon=True)

    # ------------------------------------------------------------------ API side
    def start(self) -> Book:
        """Start the engine thread, register, and return the address book (blocks)."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join(timeout=5)
            self._running = False
            os.close(self._wake_r)  # an init() that is retried must not leak two descriptors each time
            os.close(self._wake_w)
            raise self._init_error
        assert self.book is not None
        return self.book

    def next_seq(self, name: str) -> int:
        """The round number of this rank's next operation on ``name``."""
        with self._seq_lock:
            seq = self._seqs.get(name, 0)
            self._seqs[name] = seq + 1
            return seq

    def entered(self, name: str) -> int:
        """How many operations on ``name`` this rank has started (in this generation)."""
        with self._seq_lock:
            return self._seqs.get(name, 0)

    def submit(self, command: cmd.Command) -> None:
        """Hand ``command`` to the engine thread."""
        if not self._running:
            raise NotInitializedError("bps_gossip was shut down; call init() again first")
        if self._dead is not None:  # nobody reads the inbox any more: fail at once, never hang
            self._drop(command, self._dead)
            return
        if not isinstance(command, cmd.PeerBlocked):  # telling where training waits is no progress
            self.submitted += 1  # progress, for the scheduler (a rank reported as stuck is stuck if this stands still)
        self._inbox.append(command)
        os.write(self._wake_w, b".")
        if self._dead is not None:  # the thread ended meanwhile and may have missed this command
            self._fail_inbox()

    def push_now(self, op: Operation) -> bool:
        """Send a small push_pull from the calling thread if nothing is ahead of it (see
        worker.server_links); False: it must be submitted to the engine thread instead."""
        if threading.get_ident() == self._thread.ident:  # a future's callback, on this thread (holds the lock)
            return False
        servers = self.servers
        with servers.lock:
            if not self._running or self._dead is not None or self._broken is not None or self._stale is not None \
                    or self._inbox or not servers.push_now(op):
                return False
            self.submitted += 1
            wake = servers.unseen
        if wake:  # a reply the engine's poll may not hear of: let it look
            os.write(self._wake_w, b".")
        return True

    def stop(self, timeout: float = 5.0, crashed: bool = False) -> None:
        """Leave the job (``crashed``: because of an uncaught exception) and stop the engine thread."""
        if not self._running:
            return
        future: Future = Future()
        self.submit(cmd.Stop(future, crashed))
        try:
            wait(future, timeout, "shutdown")
        except BpsGossipError as exc:
            self.log.warning("shutdown: %s", exc)
        self._running = False
        self._thread.join(timeout)
        if self.tracer is not None:
            self.tracer.write()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @staticmethod
    def _drop(command: cmd.Command, error: BaseException) -> None:
        """Complete the future of a command that will never run."""
        if isinstance(command, cmd.Stop):
            complete(command.future, None)  # a stop has nothing left to do
        else:
            fail(command.future, error)

    def _fail_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.popleft()
            except IndexError:  # empty (two threads may empty it at once)
                return
            self._drop(command, self._dead)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            book, self.has_state = self.scheduler.register(
                self.peers.address, self.config.host_reduce if self.segments is not None else "off")
            self.on_book(book)
        except BaseException as exc:  # reported to start()'s caller
            self._init_error = exc
            self._close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:
            self.log.exception("engine thread crashed")
            self.on_broken(PeerLostError(f"bps_gossip engine crashed: {exc!r}"))
        finally:
            with self.servers.lock:  # no caller sends on a socket being closed (push_now)
                self._close()
                self._dead = self._broken or NotInitializedError("bps_gossip was shut down")
            self._fail_inbox()

    def _close(self) -> None:
        if self.segments is not None:
            self.segments.close()
        self.peers.close()
        self.servers.close()
        self.scheduler.close()

    def _poller(self) -> zmq.Poller:
        self._sockets_changed = False
        poller = zmq.Poller()
        for sock in (self._wake_r, self.scheduler.sock, self.peers.sock, *self.servers.poll_sockets):
            poller.register(sock, zmq.POLLIN)
        return poller

    def _loop(self) -> None:
        poller = self._poller()
        more = False  # partitions ready to go: do not sleep in poll
        lock = self.servers.lock  # held but while polling: callers send small pushes meanwhile (push_now)
        lock.acquire()
        self.servers.deferred = []
        try:
            while self._running:
                if self._sockets_changed:  # a new generation brought other servers
                    poller = self._poller()
                now = time.monotonic()
                if self.scheduler.tick(now, self.submitted):
                    self._check_deadlines(now)
                more = self.servers.readable() or more  # a reply our own sends may have left unannounced
                wait_ms = 0 if more else int(self.scheduler.seconds_to_beat(time.monotonic()) * 1000)
                self.servers.flush()
                lock.release()
                try:
                    events = dict(poller.poll(min(wait_ms, 200)))
                finally:
                    lock.acquire()
                if self._wake_r in events:
                    self._drain_inbox()
                if self.scheduler.sock in events:
                    self.scheduler.drain()
                if self.peers.sock in events:
                    self.peers.drain()
                self.servers.drain(events)
                more = self.servers.dispatch()
        finally:
            self.servers.flush()
            self.servers.deferred = None
            lock.release()

    def _drain_inbox(self) -> None:
        try:
            os.read(self._wake_r, 65536)
        except BlockingIOError:
            pass
        inbox = self._inbox
        while self._running and inbox:
            command = inbox.popleft()  # only this thread pops while it runs
            if self._broken is not None and not isinstance(command, (cmd.Stop, cmd.Finished)):
                self._drop(command, self._broken)
            elif self._stale is not None and not isinstance(command, UNSTOPPABLE) \
                    and not self._outlives_change(command):
                if not isinstance(command, PEER_TRAFFIC):
                    self._drop(command, self._stale)
            else:
                self._handlers[type(command)](command)

    def _outlives_change(self, command: cmd.Command) -> bool:  # only while self._stale is set
        """A stored-weights operation (asynchronous training) goes on through a change that rolls
        nothing back: it waits for no other worker. A worker that finished and shut down opens such
        a change, and the others' last pulls (flush() after elastic.run) must still complete."""
        return not self._stale.restore and isinstance(command, cmd.Submit) and command.op.store is not None

    # ------------------------------------------------------------------ commands
    def _on_local_push(self, route: bytes, push: Any) -> None:
        """A local of this worker's host pushed to its peer socket: the host link takes it."""
        self.servers.hosts.on_local_push(route, push)

    def _on_submit(self, command: cmd.Submit) -> None:
        self.servers.enqueue(command.op)

    def _on_barrier(self, command: cmd.Barrier) -> None:
        self.scheduler.barrier(command.future)

    def _on_stats(self, command: cmd.Stats) -> None:
        self.servers.stats(command.future)

    def _on_commit(self, command: cmd.Commit) -> None:
        self.scheduler.commit(command.future)

    def _on_finished(self, _command: cmd.Finished) -> None:
        if self._broken is None:
            self.scheduler.finished()

    def _on_holds_state(self, _command: cmd.HoldsState) -> None:
        self.has_state = True

    def _on_rejoin(self, command: cmd.Rejoin) -> None:
        self._rejoin = command.future
        if self._stale is not None:
            self._fail_pending(self._stale)
            self.scheduler.rejoin(self._target_gen, self.has_state)
        # else: the 'changed' notice is on its way (a server told us first)

    def _on_stop(self, command: cmd.Stop) -> None:
        self.peers.await_reads(self.scheduler.silent)
        self._fail_all(NotInitializedError("bps_gossip was shut down while this operation was pending"))
        self.scheduler.leave(command.crashed)
        self._running = False
        complete(command.future, None)

    # ------------------------------------------------------------------ what the scheduler says
    def on_book(self, book: Book) -> None:
        """A new address book: reconnect servers, open the generation's peer channel."""
        self.book = book
        self._sockets_changed |= self.servers.connect(book)
        self.peers.new_generation(book)
        with self._seq_lock:
            self._seqs.clear()  # every rank numbers each name's rounds from 0 in a new generation
        self._stale = None
        complete(self._rejoin, book)
        self._rejoin = None

    def on_node_gone(self, role: str, rank: int, lost: bool, why: str) -> None:
        """A worker or server was lost or left."""
        if role == "server":
            self.servers.server_gone(rank, why)
            return
        self.servers.worker_gone(rank, lost, why)
        if self.peers.channel is not None:
            self.peers.channel.on_worker_gone(rank, "lost" if lost else "left", why)

    def on_changed(self, generation: int, why: str, restore: bool) -> None:
        """Elastic: the generation ended. Fail what is pending; rejoin when asked (reset())."""
        if generation <= max(self.book.generation, self._target_gen):
            return
        self._target_gen = self.peers.next_generation = generation
        self._stale = WorkersChangedError(
            f"the job's workers changed (generation {self.book.generation} -> {generation}): {why} "
            f"[on rank {self.book.rank}]", restore=restore)
        if restore or self._rejoin is not None:
            self._fail_pending(self._stale)  # a crash: everything rolls back, no need to wait
        else:
            # A graceful leave or a join: results that servers and peers sent before they heard
            # of it are on their way (a worker that left got its result, so ours was sent too).
            # New work fails at once; pending work gets a moment to complete.
            self._fail_control(self._stale)
            self._stale_grace = time.monotonic() + CHANGE_GRACE
        if self._rejoin is not None:
            self.scheduler.rejoin(generation, self.has_state)

    def on_broken(self, error: BpsGossipError) -> None:
        """The job cannot go on for this worker: fail everything now and from now on."""
        self._fail_all(error)
        fail(self._rejoin, error)
        self._rejoin = None

    # ------------------------------------------------------------------ failures
    def _fail_all(self, error: BpsGossipError) -> None:
        self._broken = error
        self._fail_pending(error)

    def _fail_pending(self, error: BpsGossipError) -> None:
        self._stale_grace = 0.0
        self.servers.fail_all(error, keep_stores=error is self._stale and not error.restore)
        self.peers.fail_all(error)
        self._fail_control(error)

    def _fail_control(self, error: BpsGossipError) -> None:
        """Fail the waits the scheduler answers (barriers, commit checks) and stats requests."""
        self.scheduler.fail_waits(error)
        self.servers.fail_stats(error)

    def _check_deadlines(self, now: float) -> None:
        silence = self.scheduler.silence(now) if self._broken is None else None
        if silence is not None:
            self._fail_all(silence)
            return
        if self._stale is not None and self._stale_grace and now > self._stale_grace:
            self._fail_pending(self._stale)  # what the old generation could still finish has arrived
        self.peers.check_deadlines(now)
        if self.config.elastic and self.config.stall_timeout and self._stale is None:
            for ranks, why in [*self.peers.channel.overdue(now, self.config.stall_timeout),
                               *self.servers.hosts.overdue(now, self.config.stall_timeout)]:
                self.scheduler.stalled(ranks, why)
        self.servers.check_deadlines(now)
