"""Authentication and encryption of every socket: ZeroMQ CURVE keys from the job's secret, and
a key pair of each process's own that says which member sent a message.

Every process of a job derives the same server key pair from BPS_GOSSIP_SECRET (or the file
BPS_GOSSIP_SECRET_FILE names), and every bound socket serves with it. A CurveZMQ client must
know the server's public key to complete the handshake (its first message is sealed to it), so a
process without the secret completes none: nothing it sends reaches a receive loop. Traffic is
encrypted (Curve25519, XSalsa20-Poly1305). Without a secret, sockets are plain, as in BytePS and
ps-lite.

Members of one job hold the same secret, so the secret cannot tell them apart. Each process
therefore connects with a key pair of its own, made at random when it starts and never sent
anywhere but its public half; the handshake proves it holds the secret half. Its routing id (the
name every member knows it by, in the address book) ends with a tag of that public key
(:func:`key_tag`), and every ROUTER drops a message whose routing id is not its connection's
key's (:func:`route_matches_key`, checked in the shared receive loop): a member that presents
another's routing id, learned from the address book, is not taken for it anywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ..errors import ConfigError
from ..thread_names import named

MIN_SECRET_CHARS = 16
MAX_TRACKED_CONNECTIONS = 4096  # accepted connections whose peers a FailedHandshakes remembers
MAX_LOGGED_PEERS = 8  # peers named in one log line
GATHER_SECONDS = 1.0  # a line waits this long after its first failure, so it can name more peers
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """The job's server key pair (Z85 text, as libzmq takes it)."""

    server_public: bytes
    server_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> JobKeys:
        """Derive the key pair from ``secret`` (the same on every process of a job)."""
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"BPS_GOSSIP_SECRET has {len(secret)} characters; use at least {MIN_SECRET_CHARS} "
                              "(bpslaunch makes one: python -c 'import secrets; print(secrets.token_hex(32))')")
        private = z85.encode(hashlib.blake2b(secret.encode(), person=b"bpsg-server", digest_size=32).digest())
        return cls(zmq.curve_public(private), private)


_member_keys: tuple[bytes, bytes, int] | None = None  # public, secret, the pid that made them
_member_lock = threading.Lock()


def member_keys() -> tuple[bytes, bytes]:
    """This process's own CURVE key pair (public, secret; Z85), made at random on first use."""
    global _member_keys
    with _member_lock:
        if _member_keys is None or _member_keys[2] != os.getpid():  # a fork makes its own
            public, secret = zmq.curve_keypair()
            _member_keys = (public, secret, os.getpid())
        return _member_keys[0], _member_keys[1]


@functools.lru_cache(maxsize=4096)  # read for every message a ROUTER receives; a few keys per job
def key_tag(public: bytes | str) -> str:
    """The tag of a public key (Z85) that ends its owner's routing id: 24 hex digits."""
    raw = public.encode() if isinstance(public, str) else public
    return hashlib.blake2b(raw, digest_size=12, person=b"bpsg-route").hexdigest()


def own_tag() -> str:
    """The tag of this process's own public key (:func:`member_keys`)."""
    return key_tag(member_keys()[0])


def routing_id(role: str, keys: JobKeys | None) -> bytes:
    """A new routing id for this process in ``role``: with a secret, it ends with the tag of the
    process's own key (no other process can present it); without one, a random one."""
    tag = own_tag() if keys is not None else uuid.uuid4().hex
    return f"{role}-{os.getpid()}-{tag}".encode()


def route_matches_key(route: bytes, public: str) -> bool:
    """Whether a routing id (up to its first '/') ends with ``-`` and the tag of ``public``, the
    key its connection authenticated with."""
    return route.split(b"/", 1)[0].endswith(_route_suffix(public))


@functools.lru_cache(maxsize=4096)  # checked on every message a ROUTER reads; bounded: keys come from peers
def _route_suffix(public: str) -> bytes:
    return b"-" + key_tag(public).encode()


class _AnyKeyThatKnowsTheServer:
    """ZAP credentials check: any client key, unless the context has a gate
    (:func:`set_admission`). Completing the handshake already proved that the client knows the
    server's public key, which only holders of the job's secret can derive; the client's own key
    then names the member (see the module docstring)."""

    def __init__(self) -> None:
        self.admit: Callable[[bytes], bool] | None = None

    def callback(self, domain: str, key: bytes) -> bool:
        admit = self.admit
        return True if admit is None else admit(key)


_authenticators: dict[int, tuple[ThreadAuthenticator, JobKeys, _AnyKeyThatKnowsTheServer]] = {}


def set_admission(ctx: zmq.Context, admit: Callable[[bytes], bool] | None) -> None:
    """Have the ZAP handler of ``ctx`` (started by the first serving socket) ask ``admit`` with
    each client's public key (Z85) whether its handshake may complete; None admits every key."""
    with _lock:
        running = _authenticators.get(id(ctx))
    if running is None:
        raise ValueError("no socket of this context serves with a secret: nothing to gate")
    running[2].admit = admit
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
        check = _AnyKeyThatKnowsTheServer()
        auth.configure_curve_callback("*", check)
        _authenticators[id(ctx)] = (auth, keys, check)


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
        sock.curve_publickey, sock.curve_secretkey = member_keys()
    return sock


class FailedHandshakes:
    """Counts the connections to a bound socket that fail their secure handshake (a process
    without the job's secret, or with another one) and logs them with the peers' addresses, at
    most once per ``every`` seconds with the count since the last line: a guesser cannot flood
    the log, and a job's owner sees who knocks. Call :meth:`check` from the socket's own loop.

    libzmq's failure events name only the bound endpoint, never the peer. A thread of its own
    therefore reads the socket's monitor as events come: an accepted connection's event carries
    its file descriptor, whose peer address it reads at once (the descriptor stays that
    connection's until libzmq reports it disconnected), and a failure is followed by the
    failed connection's disconnect, which names the descriptor. Best effort: a handshake fails
    within a few round trips, and an address the thread was too late to read shows as "?"
    (a line therefore gathers GATHER_SECONDS after its first failure)."""

    def __init__(self, sock: zmq.Socket, log: logging.Logger, every: float = 10.0) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.log = log
        self.every = every
        self.count = 0  # since the last line
        self.total = 0
        self.endpoint = ""
        self.peers: list[str] = []  # of the failures since the last line, at most MAX_LOGGED_PEERS
        # Connections that completed the handshake and are not yet disconnected (ConnectionGate
        # reads it; one thread writes it). libzmq ends every accepted connection with one
        # disconnect and, if its handshake did not succeed, one failure event before it: a
        # disconnect is a failed one's while failures wait for theirs, else an authenticated one's.
        self.authenticated = 0
        self.succeeded = 0  # handshakes completed, ever
        self._next = 0.0  # no line before (rate limit)
        self._due = 0.0  # nor before this (the first failure of a line, and a moment)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=named("bpsg-handshakes", self._watch), name="bpsg-handshakes",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        accepted: dict[int, str] = {}  # descriptor -> peer, of the connections not yet disconnected
        # failures whose disconnect has not come yet: True for a failed handshake, False for a refusal
        unattributed: collections.deque[bool] = collections.deque(maxlen=MAX_TRACKED_CONNECTIONS)
        while not self._stop.is_set():
            try:
                if not self.monitor.poll(100):
                    continue
                event = recv_monitor_message(self.monitor)
            except zmq.ZMQError:
                return  # closed
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                if len(accepted) < MAX_TRACKED_CONNECTIONS:
                    accepted[value] = peer_of(value)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.authenticated += 1
                self.succeeded += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = accepted.pop(value, "?")
                if not unattributed:
                    self.authenticated = max(0, self.authenticated - 1)
                elif unattributed.popleft():  # a failed connection's end: counted now, with its peer
                    with self._lock:
                        if not self.count:  # the first of a line: gather a moment, for more peers
                            self._due = time.monotonic() + GATHER_SECONDS
                        self.count += 1
                        self.total += 1
                        if len(self.peers) < MAX_LOGGED_PEERS and peer not in self.peers:
                            self.peers.append(peer)
            else:  # a failure; one refused by the server's ConnectionGate knew the secret: not logged here
                unattributed.append(kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                self.endpoint = event.get("endpoint", b"").decode(errors="replace")

    def check(self) -> None:
        """Log what happened since the last line, when it is time (non-blocking)."""
        now = time.monotonic()
        with self._lock:
            if not self.count or now < max(self._next, self._due):
                return
            count, total, endpoint, peers = self.count, self.total, self.endpoint, self.peers
            self.count, self.peers = 0, []
        self._next = now + self.every
        self.log.warning("%d connection(s) to %s from %s failed the secure handshake in the last %.0f s "
                         "(%d in all): a process without this job's secret, or with another one",
                         count, endpoint, ", ".join(peers) or "?", self.every, total)

    def close(self) -> None:
        """Stop counting."""
        self._stop.set()
        self._thread.join(2.0)
        self.monitor.close(linger=0)


def peer_of(fd: int) -> str:
    """The address of the peer of the connected TCP socket ``fd`` (its host: a port a client
    picked says nothing), or "?" (not a TCP socket, or closed already). The descriptor stays
    open: libzmq owns it."""
    try:
        conn = socket.socket(fileno=fd)
    except OSError:
        return "?"
    try:
        address = conn.getpeername()
        return str(address[0]) if isinstance(address, tuple) else "?"
    except OSError:
        return "?"
    finally:
        conn.detach()


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
