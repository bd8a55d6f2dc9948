"""Registering with the scheduler and waiting for the address book: the same for a server and a
worker.

:func:`join` connects a DEALER to the scheduler, sends the registration and waits through
:class:`~bps_gossip.transport.startup.StartupWait` (a failed secure handshake says so at once;
see that module for how long the wait lasts), heart-beating once connected. The scheduler's
answer ends it: ``book`` returns, ``refused``, ``terminate``, ``job_failed`` and ``job_over``
raise. An elastic job that is running answers a joining worker ``wait``: the worker is admitted
at the next commit, and gives up after BPS_GOSSIP_ELASTIC_TIMEOUT + BPS_GOSSIP_TIMEOUT.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence, Tuple

import zmq

from .config import Config
from .errors import CommTimeoutError, ConfigError, JobEndedError, JobFailedError, ProtocolError
from .protocol import (
    AddressBook,
    HbAck,
    Heartbeat,
    JobFailed,
    JobOver,
    Message,
    Op,
    Refused,
    Register,
    Terminate,
    Wait,
    send,
)
from .transport import recv_message
from .transport.security import HandshakeWatch, routing_id
from .transport.sockets import SocketRole, open_socket
from .transport.startup import StartupWait

Also = Sequence[Tuple[zmq.Socket, Callable[[], None]]]  # other sockets to serve meanwhile


@dataclasses.dataclass(frozen=True)
class Admission:
    """The scheduler's answer: the address book, and whether this worker was told to wait
    (an elastic joiner: it gets the job's state from rank 0 later)."""

    book: AddressBook
    waited: bool


class BookWait:
    """One registration in progress; see :func:`join`."""

    def __init__(self, sock: zmq.Socket, config: Config, who: str, log: logging.Logger) -> None:
        self.sock, self.config, self.who, self.log = sock, config, who, log
        self.admit_by: float | None = None  # elastic: told to wait, admitted by then
        self.wait: StartupWait | None = None  # the deadlines and progress notes of the running wait
        self.role = "worker"
        # What ends or changes the wait; each returns the book once admitted. A heartbeat's answer
        # says who has registered so far; anything else only shows that the scheduler is there.
        self.answers: dict[Op, tuple[type[Message], Callable[[Any], AddressBook | None]]] = {
            cls.op: (cls, handle) for cls, handle in (
                (AddressBook, lambda book: book), (Refused, self._on_refused), (Terminate, self._on_terminate),
                (JobFailed, self._on_job_failed), (JobOver, self._on_job_over), (Wait, self._on_wait),
                (HbAck, self._on_hb_ack))}

    def run(self, register: Register, also: Also) -> Admission:
        """Send ``register`` and wait for the book (see the module docstring)."""
        cfg = self.config
        self.role = register.role
        watch = HandshakeWatch(self.sock)
        try:
            self.sock.connect(cfg.scheduler_address)
            send(self.sock, register)
            wait = self.wait = StartupWait(watch, cfg, self.who, self.log)
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            for sock, _ in also:
                poller.register(sock, zmq.POLLIN)
            serve = dict(also)
            every = min(cfg.heartbeat_interval, 0.5)
            next_beat = time.monotonic() + every
            while True:
                self._check(wait)
                events = dict(poller.poll(int(every * 1000)))
                for sock, handle in serve.items():
                    if sock in events:
                        handle()
                if self.sock not in events:
                    # Paced by the clock, not by the poll: another socket's traffic (a server's early
                    # pushes) wakes the poll without limit. Before the connection, beats only pile up.
                    if wait.connected and time.monotonic() >= next_beat:
                        send(self.sock, Heartbeat())
                        next_beat = time.monotonic() + every
                    continue
                wait.heard_from()
                book = self._receive()
                if book is not None:
                    return Admission(book, self.admit_by is not None)
        finally:
            watch.close()

    def _check(self, wait: StartupWait) -> None:
        wait.check()
        cfg = self.config
        if self.admit_by is not None and time.monotonic() > self.admit_by:
            raise CommTimeoutError(
                f"{self.who}: the running job at {cfg.scheduler_address} did not admit this worker within "
                f"{cfg.elastic_timeout + cfg.timeout:.1f} s (it joins at the next commit: does the "
                "training loop call state.commit()?)")

    def _receive(self) -> AddressBook | None:
        _, header, _ = recv_message(self.sock, routed=False)
        answer = self.answers.get(header["op"])  # a str (framing checked it); Op keys find it
        if answer is None:
            return None
        cls, handle = answer
        return handle(cls.decode(header))

    def _on_refused(self, msg: Refused) -> None:
        # A worker's registration is refused for its settings; a server's is a broken job.
        error = ConfigError if self.role == "worker" else ProtocolError
        raise error(f"the scheduler refused this {self.role} ({self.who}): {msg.why}")

    def _on_terminate(self, msg: Terminate) -> None:
        raise JobFailedError(f"{self.who}: the job ended before it started: {msg.why}")

    def _on_job_failed(self, msg: JobFailed) -> None:
        raise JobFailedError(f"the job failed: {msg.why}")

    def _on_job_over(self, msg: JobOver) -> None:
        raise JobEndedError(f"the job finished before this worker was admitted ({msg.why})")

    def _on_hb_ack(self, msg: HbAck) -> None:
        if self.wait is not None:  # before the rendezvous completes: who has registered so far
            self.wait.heard_from(msg.workers, msg.servers)

    def _on_wait(self, msg: Wait) -> None:
        if self.admit_by is None:
            cfg = self.config
            self.admit_by = time.monotonic() + cfg.elastic_timeout + cfg.timeout
            if self.wait is not None:
                self.wait.joining = True
            self.log.info("waiting to join the running job: %s", msg.why)
        return None


def join(sock: zmq.Socket, register: Register, config: Config, who: str, log: logging.Logger,
         also: Also = ()) -> Admission:
    """Connect ``sock`` (a new :data:`~bps_gossip.transport.sockets.SocketRole.TO_SCHEDULER`
    socket) to the scheduler, register with ``register`` and wait for the address book.

    ``who`` names this process in errors ("server tcp://...", "worker pid 123"); ``also`` are
    other sockets polled meanwhile, each with what to do when it is readable (a server holds
    pushes of workers that got their book first). Raises ConfigError (a refused worker, a failed
    handshake), ProtocolError (a refused server, a malformed answer), JobFailedError,
    JobEndedError or CommTimeoutError.
    """
    return BookWait(sock, config, who, log).run(register, also)


PROBE_SECONDS = 3.0  # how long a probe waits for the scheduler's handshake


def scheduler_answers(config: Config, within: float = PROBE_SECONDS) -> bool:
    """Whether the job's scheduler is there: a socket with this job's keys connects and waits
    ``within`` seconds for the handshake, sending nothing. So --join and resume() say within
    seconds that no job answers instead of waiting BPS_GOSSIP_START_TIMEOUT for a scheduler that
    exited. A full handshake, not a bare TCP connection: the scheduler logs those as failed
    handshakes. Raises ConfigError when the handshake fails (a secret that is not the job's)."""
    ctx = zmq.Context.instance()
    sock = open_socket(ctx, SocketRole.TO_SCHEDULER, config, routing_id("probe", config.keys))
    watch = HandshakeWatch(sock)
    deadline = time.monotonic() + within
    try:
        sock.connect(config.scheduler_address)
        while not watch.connected:
            watch.check(config.keys, "a probe of the job", config.scheduler_address)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True
    finally:
        watch.close()
        sock.close(linger=0)
