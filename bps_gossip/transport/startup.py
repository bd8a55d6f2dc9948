"""How long a server or worker waits for the scheduler while it registers.

Processes of one job may start minutes apart (Kubernetes pods pulling images, a busy batch
system), and the scheduler need not be first. Registration therefore waits in two phases:

1. Not connected yet: ZeroMQ keeps retrying the connection (and re-resolving a DNS name, such
   as a Kubernetes Service that has no address yet) in the background, and the register
   message waits in the socket's queue. This may last BPS_GOSSIP_START_TIMEOUT (the deadline
   the scheduler itself has for the whole rendezvous). After a second a warning says whom
   the process waits for and which variables say so (a plain ``python train.py`` in a shell
   with DMLC_* left over would otherwise wait in silence), then a line every 30 s. A worker of
   ``bpslaunch --join`` (``Config.joiner``), whose scheduler answered a moment ago, waits
   JOINER_CONNECT_SECONDS instead: the job ended in between.
2. Connected (the handshake with the scheduler succeeded): the rest of the job may still be
   starting. The process heart-beats and waits as long as the scheduler answers; it gives up
   once the scheduler has been silent for BPS_GOSSIP_TIMEOUT. The scheduler ends a rendezvous
   that does not complete within its BPS_GOSSIP_START_TIMEOUT and tells everyone why. After
   10 s, and every 30 s after that, a warning says how many workers and servers have
   registered of how many expected (the scheduler's answers to heartbeats carry the counts).
"""

from __future__ import annotations

import logging
import time

from ..config import Config
from ..errors import CommTimeoutError
from .security import HandshakeWatch

FIRST_NOTE_SECONDS = 1.0  # not connected this long: say whom this process waits for
CONNECTED_NOTE_SECONDS = 10.0  # connected, but the job has not started this long: say who is missing
NOTE_EVERY_SECONDS = 30.0  # then a progress line this often
# A worker of bpslaunch --join, whose scheduler answered bpslaunch's probe a moment ago: not
# connected this long, the scheduler has exited (the job ended in the seconds between).
JOINER_CONNECT_SECONDS = 15.0


class StartupWait:
    """The two-phase registration deadline (see the module docstring) of one process."""

    def __init__(self, watch: HandshakeWatch, config: Config, who: str, log: logging.Logger) -> None:
        self.watch = watch
        self.config = config
        self.who = who
        self.log = log
        self.started = time.monotonic()
        self.heard: float | None = None  # when the scheduler last sent anything; None: not connected
        self.connected_at: float | None = None
        self.warned = False
        self.next_note = self.started + FIRST_NOTE_SECONDS
        self.registered: tuple[int, int] | None = None  # (workers, servers), as the scheduler last said
        self.joining = False  # an elastic joiner told to wait: it waits for a commit, not a rendezvous

    @property
    def connected(self) -> bool:
        """True once the handshake with the scheduler succeeded (heartbeats then make sense)."""
        return self.heard is not None

    def heard_from(self, workers: int | None = None, servers: int | None = None) -> None:
        """The scheduler sent something (with the counts of registered workers and servers, if
        it said them)."""
        self.heard = time.monotonic()
        if workers is not None and servers is not None:
            self.registered = (workers, servers)

    def check(self) -> None:
        """Raise ConfigError for a failed handshake, CommTimeoutError when a phase's time is up."""
        cfg = self.config
        self.watch.check(cfg.keys, self.who, cfg.scheduler_address)
        now = time.monotonic()
        if self.heard is None and self.watch.connected:
            self.heard = self.connected_at = now
            self.next_note = now + CONNECTED_NOTE_SECONDS
            if self.warned:
                self.log.warning("%s: connected to the scheduler at %s after %.0f s",
                                 self.who, cfg.scheduler_address, now - self.started)
        if self.heard is not None:
            if now - self.heard > cfg.timeout:
                raise CommTimeoutError(
                    f"{self.who}: the scheduler at {cfg.scheduler_address} sent no address book and no "
                    f"answer for {cfg.timeout:.1f} s (BPS_GOSSIP_TIMEOUT; did it die?)")
            if now >= self.next_note and not self.joining:
                self.next_note = now + NOTE_EVERY_SECONDS
                self.log.warning("%s", self._missing(now))
            return
        waited = now - self.started
        if cfg.joiner and waited > JOINER_CONNECT_SECONDS:
            raise CommTimeoutError(
                f"{self.who}: the elastic job at {cfg.root_uri}:{cfg.root_port} answered bpslaunch --join a moment "
                f"ago, then did not answer this worker for {JOINER_CONNECT_SECONDS:g} s: it has ended (finished "
                "training, or its scheduler was lost); not joining")
        if cfg.joiner:
            return  # connecting takes milliseconds; no note on leftover DMLC_* variables for a joiner
        if waited > cfg.start_timeout:
            raise CommTimeoutError(
                f"{self.who}: no connection to the scheduler at {cfg.scheduler_address} within "
                f"{cfg.start_timeout:.1f} s (BPS_GOSSIP_START_TIMEOUT; is it running? check "
                "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
        if now >= self.next_note:
            self.next_note = now + NOTE_EVERY_SECONDS
            self.log.warning("%s", self._unanswered(waited))
            self.warned = True

    def _unanswered(self, waited: float) -> str:
        """Whom this process waits for, and which variables make it wait."""
        cfg = self.config
        where = (f"the scheduler at {cfg.root_uri}:{cfg.root_port} (DMLC_PS_ROOT_URI={cfg.root_uri}, "
                 f"DMLC_PS_ROOT_PORT={cfg.root_port})")
        if self.warned:
            return (f"{self.who}: still no answer from {where} after {waited:.0f} s; trying up to "
                    f"BPS_GOSSIP_START_TIMEOUT={cfg.start_timeout:g} s")
        line = (f"{self.who}: waiting for {where}: nothing answers there yet; trying up to "
                f"BPS_GOSSIP_START_TIMEOUT={cfg.start_timeout:g} s")
        if cfg.role != "worker":
            return f"{line} (DMLC_ROLE={cfg.role})"
        reasons = ", ".join(distributed_by(cfg))
        return (f"{line}. This process is one worker of a distributed job ({reasons}); meant to train alone "
                "(a shell with DMLC_* left from another job)? Unset these variables (bash: unset ${!DMLC_*})")

    def _missing(self, now: float) -> str:
        """How far the rendezvous got, as the scheduler last said."""
        cfg = self.config
        assert self.connected_at is not None
        line = (f"{self.who}: connected to the scheduler at {cfg.root_uri}:{cfg.root_port} for "
                f"{now - self.connected_at:.0f} s; the job has not started")
        if self.registered is None:
            return f"{line}: waiting for the other workers and servers to register"
        workers, servers = self.registered
        expected = (f"of {cfg.num_worker * cfg.local_size} worker processes (DMLC_NUM_WORKER={cfg.num_worker} "
                    f"machines x BYTEPS_LOCAL_SIZE={cfg.local_size})" if cfg.role == "worker" else
                    f"worker processes (of DMLC_NUM_WORKER={cfg.num_worker} machines)")
        return (f"{line}: {workers} {expected} and {servers} of DMLC_NUM_SERVER={cfg.num_server} servers "
                "have registered")


def distributed_by(config: Config) -> list[str]:
    """The settings that make a worker part of a distributed job (as Config.distributed decides)."""
    reasons = [f"DMLC_NUM_WORKER={config.num_worker}"] if config.num_worker > 1 else []
    if config.local_size > 1:
        reasons.append(f"BYTEPS_LOCAL_SIZE={config.local_size}")
    if config.force_distributed:
        reasons.append("BYTEPS_FORCE_DISTRIBUTED=1")
    if config.elastic:
        reasons.append("BPS_GOSSIP_ELASTIC=1")
    return reasons or ["DMLC_ROLE=worker"]
