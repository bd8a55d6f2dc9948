"""Authentication and sender identity (tests/clusters/test_security.py): workers with a wrong
secret or none, strangers' raw sockets to the scheduler, a server and a peer, and an insider
with the secret but no place in the address book spoofing pushes and gossip."""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np
import zmq
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import testing
from bps_gossip.config import load_config
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.transport.security import JobKeys, make_socket, routing_id
from bps_gossip.worker.tensors import key_of


def raw_socket(address, keys, identity=None):
    """A DEALER socket to ``address`` keyed with ``keys`` (None: plain), not part of the job."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, keys, serve=False)
    sock.setsockopt(zmq.LINGER, 0)
    # a routing id of its own key's (any other is dropped before a handler sees it)
    sock.setsockopt(zmq.IDENTITY, identity if identity is not None else routing_id("insider", keys))
    sock.connect(address)
    return sock


def answers(sock, header, frames=(), wait_ms=1500):
    """Send one message; return the header of the answer, or None if nothing came back."""
    sock.send_multipart([msgpack.packb(header)] + list(frames))
    if not sock.poll(wait_ms):
        return None
    return msgpack.unpackb(sock.recv_multipart()[0])


def refused() -> None:
    """init() with this rank's (wrong or missing) secret: what it raised, and how soon."""
    start = time.monotonic()
    try:
        bps.init()
        report(["joined"])
    except bps.BpsGossipError as exc:
        report([type(exc).__name__, str(exc), time.monotonic() - start])


def strangers() -> None:
    """Plain and wrong-key sockets to the scheduler, a server and a peer; then push_pull and gossip."""
    bps.init()
    book = testing.address_book()
    keyed = {"plain": None, "wrong key": JobKeys.from_secret("y" * 32)}
    heard = {}
    for who, keys in keyed.items():
        heard[who] = [
            answers(raw_socket(f"tcp://127.0.0.1:{os.environ['DMLC_PS_ROOT_PORT']}", keys),
                    {"op": "register", "role": "worker", "host": "127.0.0.1", "pid": 1, "local_rank": 0,
                     "local_size": 1, "DMLC_NUM_WORKER": 2, "DMLC_NUM_SERVER": 1}),
            answers(raw_socket(book.servers[0], keys),
                    {"op": "push", "req": 1, "key": 1, "name": "x", "part": 0, "seq": 0, "count": 1,
                     "wire": "<f8", "dtype": "float64", "shape": [1], "kind": "sum", "gen": book.generation},
                    [np.full(1, 1e9).tobytes()]),
            answers(raw_socket(book.workers[1 - bps.rank()].addr, keys),
                    {"op": "gossip", "tag": "g", "round": 0, "gen": book.generation, "keys": ["w"],
                     "weight": 0.5, "dtypes": ["<f8"], "counts": [3]}, [np.full(3, 1e9).tobytes()]),
        ]
    total = bps.push_pull(np.full(4, bps.rank() + 1.0), "x", average=False)
    averager = GossipAverager({"w": np.full(3, float(bps.rank()))}, tag="g")
    averager.step()
    report({"heard": heard, "sum": total.tolist(), "gossip": averager.debiased()["w"].tolist()})
    bps.shutdown()


def spoof(book, keys, out) -> None:
    """Rank 0's insider: pushes as rank 7 of 3 (under two names, from a later generation) and gossip as rank 0."""
    push = {"op": "push", "req": 5, "key": key_of("x"), "part": 0, "seq": 1, "count": 4, "wire": "<f8",
            "dtype": "float64", "shape": [4], "kind": "sum", "rank": 7, "size": 3}
    server = raw_socket(book.servers[0], keys)
    heard = [answers(server, {**push, "name": "x", "gen": book.generation}, [np.full(4, 1e9).tobytes()]),
             answers(server, {**push, "name": "not x", "gen": book.generation}, [np.zeros(4).tobytes()]),
             answers(server, {**push, "name": "x", "gen": book.generation + 5}, [np.zeros(4).tobytes()],
                     wait_ms=6000)]
    out["spoof"] = [(h["op"], h.get("kind"), h.get("why")) for h in heard]
    peer = raw_socket(book.workers[1].addr, keys)
    out["gossip"] = answers(peer, {"op": "gossip", "tag": "g", "round": 0, "src": 0, "gen": book.generation,
                                   "keys": ["w"], "weight": 0.5, "dtypes": ["<f8"], "counts": [3]},
                            [np.full(3, 1e9).tobytes()])


def insider() -> None:
    """push_pull, rank 0 spoofs (spoof()), push_pull and gossip again: what each gave."""
    bps.init()
    book = testing.address_book()
    keys = load_config().keys
    first = bps.push_pull(np.full(4, bps.rank() + 1.0), "x", average=False)
    bps.barrier()
    out = {"first": first.tolist()}
    if bps.rank() == 0:
        spoof(book, keys, out)
    bps.barrier()
    out["second"] = bps.push_pull(np.full(4, bps.rank() + 1.0), "x", average=False).tolist()
    averager = GossipAverager({"w": np.full(3, float(bps.rank()))}, tag="g")
    averager.step()
    out["mixed"] = averager.debiased()["w"].tolist()
    report(out)
    bps.shutdown()


run({"refused": refused, "strangers": strangers, "insider": insider})
