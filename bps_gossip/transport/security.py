"""Authentication and encryption of every socket: ZeroMQ CURVE keys from the job's secret.

Every process of a job derives the same two key pairs from BPS_GOSSIP_SECRET (or the
file BPS_GOSSIP_SECRET_FILE names): one that every bound socket serves with, one that
every connecting socket presents. A ZAP handler (pyzmq's authenticator thread) admits
only the job's client key, so a process without the secret completes no handshake:
nothing it sends reaches a receive loop. Traffic is encrypted (CurveZMQ: Curve25519,
XSalsa20-Poly1305). Without a secret, sockets are plain, as in BytePS and ps-lite.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ..errors import ConfigError

MIN_SECRET_CHARS = 16
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """The job's CURVE key pairs (Z85 text, as libzmq takes them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> JobKeys:
        """Derive both key pairs from ``secret`` (the same on every process of a job)."""
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"BPS_GOSSIP_SECRET has {len(secret)} characters; use at least {MIN_SECRET_CHARS} "
                              "(bpslaunch makes one: python -c 'import secrets; print(secrets.token_hex(32))')")
        pairs = []
        for role in (b"bpsg-server", b"bpsg-client"):
            raw = hashlib.blake2b(secret.encode(), person=role, digest_size=32).digest()
            private = z85.encode(raw)
            pairs.append((zmq.curve_public(private), private))
        (server_public, server_secret), (client_public, client_secret) = pairs
        return cls(server_public, server_secret, client_public, client_secret)


class _JobKeyOnly:
    """ZAP credentials check: the job's client key, nothing else."""

    def __init__(self, keys: JobKeys) -> None:
        self.allowed = keys.client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


_authenticators: dict[int, tuple[ThreadAuthenticator, JobKeys]] = {}
_lock = threading.Lock()


def _authenticate(ctx: zmq.Context, keys: JobKeys) -> None:
    """Start the context's ZAP handler once (every bound socket of a context shares it)."""
    with _lock:
        running = _authenticators.get(id(ctx))
        if running is not None:
            if running[1] != keys:
                raise ConfigError("one process cannot serve two jobs with different secrets")
            return
        auth = ThreadAuthenticator(ctx, log=None)
        auth.start()
        auth.configure_curve_callback("*", _JobKeyOnly(keys))
        _authenticators[id(ctx)] = (auth, keys)


def make_socket(ctx: zmq.Context, kind: int, keys: JobKeys | None, serve: bool) -> zmq.Socket:
    """A socket of ``kind``; with ``keys``, CURVE-secured as a server (``serve``: it binds) or
    as a client (it connects). Call before bind/connect."""
    sock = ctx.socket(kind)
    if keys is None:
        return sock
    if serve:
        _authenticate(ctx, keys)
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
    else:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    return sock


class FailedHandshakes:
    """Counts the connections to a bound socket that fail their secure handshake (a process
    without the job's secret, or with another one) and logs them, at most once per
    ``every`` seconds with the count since the last line: a guesser cannot flood the log, and a
    job's owner sees that someone knocks. Call :meth:`check` from the socket's own loop."""

    def __init__(self, sock: zmq.Socket, log: logging.Logger, every: float = 10.0) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.log = log
        self.every = every
        self.count = 0  # since the last line
        self.total = 0
        self._next = 0.0

    def check(self) -> None:
        """Read what happened (non-blocking); log when it is time."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            self.count += 1
            self.total += 1
            endpoint = event.get("endpoint", b"").decode(errors="replace")
            now = time.monotonic()
            if now >= self._next:
                self.log.warning("%d connection(s) to %s failed the secure handshake in the last %.0f s "
                                 "(%d in all): a process without this job's secret, or with another one",
                                 self.count, endpoint, self.every, self.total)
                self.count = 0
                self._next = now + self.every

    def close(self) -> None:
        """Stop counting."""
        self.monitor.close(linger=0)


class HandshakeWatch:
    """Watches a connecting socket's handshakes: notices a failed one (a secret that differs
    from the job's, or one side without a secret), so that registration can say so at once
    instead of waiting out a timeout, and a successful one (``connected``: the peer is up and
    will read what is sent; before that, messages only queue while ZeroMQ keeps retrying)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock = sock
        self.connected = False

    def check(self, keys: JobKeys | None, who: str, address: str) -> None:
        """Raise ConfigError if a handshake with ``address`` failed; note one that succeeded
        in ``connected`` (non-blocking)."""
        failed = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            else:
                failed = True
        if not failed:
            return
        if keys is None:
            why = "it has no secret and the job has one: set BPS_GOSSIP_SECRET (or BPS_GOSSIP_SECRET_FILE)"
        else:
            why = "its BPS_GOSSIP_SECRET is not the job's (or the job runs without one)"
        raise ConfigError(f"{who}: the secure handshake with {address} failed: {why}")

    def close(self) -> None:
        """Stop watching."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
