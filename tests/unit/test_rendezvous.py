"""The shared wait for the address book (bps_gossip/rendezvous.py) against a scripted scheduler:
one ROUTER on this host that answers a registration the way a test says."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from bps_gossip import protocol as p
from bps_gossip.config import Config
from bps_gossip.errors import ConfigError, JobEndedError, JobFailedError, ProtocolError
from bps_gossip.rendezvous import join
from bps_gossip.transport import recv_message, send_message
from bps_gossip.transport.sockets import SocketRole, open_socket

BOOK = p.AddressBook(rank=0, generation=1, servers=["tcp://127.0.0.1:1"],
                     workers=[p.BookEntry(0, "ab", "tcp://127.0.0.1:2", "127.0.0.1", 1, 0, 1)])
LOG = logging.getLogger("test-rendezvous")


def scripted(answers: list, heartbeats: int = 0):
    """Bind a scheduler that waits for a register (and ``heartbeats`` heartbeats), then sends
    ``answers``; returns (config, thread, what it received)."""
    ctx = zmq.Context.instance()
    sock = open_socket(ctx, SocketRole.SCHEDULER, Config())
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    received: list[str] = []

    def serve():
        try:
            assert sock.poll(10_000)
            route, header, _ = recv_message(sock, routed=True)
            received.append(header["op"])
            while received.count("heartbeat") < heartbeats and sock.poll(10_000):
                received.append(recv_message(sock, routed=True)[1]["op"])
            for answer in answers:
                if isinstance(answer, dict):  # raw: an op of a newer scheduler
                    send_message(sock, answer, route=route)
                else:
                    p.send(sock, answer, route=route)
        finally:
            sock.close(linger=1000)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    config = Config(root_port=port, heartbeat_interval=0.05, heartbeat_timeout=1.0, timeout=5.0,
                    start_timeout=10.0, elastic_timeout=5.0)
    return config, thread, received


def register(role: str = "worker") -> p.Register:
    return p.Register(role=role, host="127.0.0.1", pid=1, num_worker=1, num_server=1)


def run_join(config: Config, role: str = "worker"):
    sock = open_socket(zmq.Context.instance(), SocketRole.TO_SCHEDULER, config, b"test-" + role.encode())
    try:
        return join(sock, register(role), config, f"{role} under test", LOG)
    finally:
        sock.close(linger=0)


@pytest.mark.timeout(30)
def test_book_after_heartbeats():
    config, thread, received = scripted([p.HbAck(), BOOK], heartbeats=2)
    admitted = run_join(config)
    thread.join(10)
    assert admitted.book == BOOK and not admitted.waited
    assert received[0] == "register" and received.count("heartbeat") >= 2


@pytest.mark.timeout(30)
def test_heartbeats_are_paced_while_another_socket_is_busy():
    """A server waits for its book while workers' early pushes keep its data socket readable: each
    wake of the poll sent a heartbeat (seen in CI: 8,000 a second to a port that was not the
    scheduler's). Three heartbeats must take at least two heartbeat intervals."""
    config, thread, received = scripted([BOOK], heartbeats=3)
    ctx = zmq.Context.instance()
    busy_in, busy_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    busy_in.bind("inproc://busy-data-socket")
    busy_out.connect("inproc://busy-data-socket")
    stop = threading.Event()

    def flood():  # never blocks (a full queue is dropped), so that it ends when told to
        while not stop.is_set():
            try:
                busy_out.send(b"early push", zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)

    feeder = threading.Thread(target=flood, daemon=True)
    feeder.start()
    sock = open_socket(ctx, SocketRole.TO_SCHEDULER, config, b"test-server")
    try:
        start = time.monotonic()
        admitted = join(sock, register("server"), config, "server under test", LOG,
                        also=[(busy_in, lambda: busy_in.recv(zmq.NOBLOCK))])
        took = time.monotonic() - start
    finally:
        stop.set()
        feeder.join(5)
        sock.close(linger=0)
        busy_out.close(linger=0)
        busy_in.close(linger=0)
    thread.join(10)
    assert admitted.book == BOOK and received.count("heartbeat") == 3
    assert took >= 2 * config.heartbeat_interval, f"3 heartbeats in {took * 1000:.1f} ms"


@pytest.mark.timeout(30)
def test_a_joiner_told_to_wait_is_admitted_later():
    config, thread, _ = scripted([p.Wait(why="running"), {"op": "from_the_future"}, p.HbAck(), BOOK])
    admitted = run_join(config)
    thread.join(10)
    assert admitted.book == BOOK and admitted.waited


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer,role,error", [
    (p.Refused(why="DMLC_NUM_WORKER=3"), "worker", ConfigError),
    (p.Refused(why="too many servers"), "server", ProtocolError),
    (p.JobFailed(why="too few workers"), "worker", JobFailedError),
    (p.JobOver(why="rank 0 finished training"), "worker", JobEndedError),
    (p.Terminate(why="every worker has shut down"), "server", JobFailedError),
])
def test_answers_that_end_the_wait(answer, role, error):
    config, thread, _ = scripted([answer])
    with pytest.raises(error, match=answer.why):
        run_join(config, role)
    thread.join(10)
