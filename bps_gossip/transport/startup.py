"""How long a server or worker waits for the scheduler while it registers.

Processes of one job may start minutes apart (Kubernetes pods pulling images, a busy batch
system), and the scheduler need not be first. Registration therefore waits in two phases:

1. Not connected yet: ZeroMQ keeps retrying the connection (and re-resolving a DNS name, such
   as a Kubernetes Service that has no address yet) in the background, and the register
   message waits in the socket's queue. This may last BPS_GOSSIP_START_TIMEOUT (the deadline
   the scheduler itself has for the whole rendezvous); a note is logged once after
   BPS_GOSSIP_TIMEOUT so that a wrong DMLC_PS_ROOT_URI does not go unnoticed.
2. Connected (the handshake with the scheduler succeeded): the rest of the job may still be
   starting. The process heart-beats and waits as long as the scheduler answers; it gives up
   once the scheduler has been silent for BPS_GOSSIP_TIMEOUT. The scheduler ends a rendezvous
   that does not complete within its BPS_GOSSIP_START_TIMEOUT and tells everyone why.
"""

from __future__ import annotations

import logging
import time

from ..config import Config
from ..errors import CommTimeoutError
from .security import HandshakeWatch


class StartupWait:
    """The two-phase registration deadline (see the module docstring) of one process."""

    def __init__(self, watch: HandshakeWatch, config: Config, who: str, log: logging.Logger) -> None:
        self.watch = watch
        self.config = config
        self.who = who
        self.log = log
        self.started = time.monotonic()
        self.heard: float | None = None  # when the scheduler last sent anything; None: not connected
        self.warned = False

    @property
    def connected(self) -> bool:
        """True once the handshake with the scheduler succeeded (heartbeats then make sense)."""
        return self.heard is not None

    def heard_from(self) -> None:
        """The scheduler sent something."""
        self.heard = time.monotonic()

    def check(self) -> None:
        """Raise ConfigError for a failed handshake, CommTimeoutError when a phase's time is up."""
        cfg = self.config
        self.watch.check(cfg.keys, self.who, cfg.scheduler_address)
        now = time.monotonic()
        if self.heard is None and self.watch.connected:
            self.heard = now
            if self.warned:
                self.log.warning("%s: connected to the scheduler at %s after %.0f s",
                                 self.who, cfg.scheduler_address, now - self.started)
        if self.heard is not None:
            if now - self.heard > cfg.timeout:
                raise CommTimeoutError(
                    f"{self.who}: the scheduler at {cfg.scheduler_address} sent no address book and no "
                    f"answer for {cfg.timeout:.1f} s (BPS_GOSSIP_TIMEOUT; did it die?)")
            return
        waited = now - self.started
        if waited > cfg.start_timeout:
            raise CommTimeoutError(
                f"{self.who}: no connection to the scheduler at {cfg.scheduler_address} within "
                f"{cfg.start_timeout:.1f} s (BPS_GOSSIP_START_TIMEOUT; is it running? check "
                "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
        if waited > cfg.timeout and not self.warned:
            self.warned = True
            self.log.warning("%s: no connection to the scheduler at %s after %.0f s; still trying, up to "
                             "BPS_GOSSIP_START_TIMEOUT=%g s", self.who, cfg.scheduler_address, waited,
                             cfg.start_timeout)
