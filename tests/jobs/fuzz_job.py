"""The worker program of tests/clusters/test_fuzz.py: attack the job from inside, then use it.

Each worker sends malformed, oversized-field and spoofed messages (inf, nan, huge ints,
bools, strings, lists where numbers belong) to the scheduler, to every server and to
its peer's gossip port, from sockets of its own that hold the job's secret (an insider
without a place in the address book), then runs a correct push_pull and a gossip round
and reports whether the results are exact.
"""

import itertools
import json
import math
import os
import random

import msgpack
import numpy as np
import zmq

import bps_gossip as bps
from bps_gossip import testing
from bps_gossip.config import load_config
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.transport.security import make_socket, routing_id

KEYS = load_config().keys

BAD_VALUES = [math.inf, -math.inf, math.nan, 1e308, -1, (1 << 64) - 1, 1 << 63, True, False, None, "0", "", b"x", [], {}, [1.5],
              "x" * 5000, -(1 << 63)]
PUSH = {"op": "push", "req": 1, "rank": 0, "key": 1, "name": "fuzzed", "part": 0, "seq": 0, "count": 2,
        "wire": "<f4", "dtype": "float32", "shape": [2], "kind": "sum", "ack": True, "gen": 0, "size": 2}
REGISTER = {"op": "register", "role": "worker", "host": "127.0.0.1", "pid": 1, "worker_id": 0, "local_rank": 0,
            "local_size": 1, "peer_addr": "tcp://127.0.0.1:1", "DMLC_NUM_WORKER": 2, "DMLC_NUM_SERVER": 1}
GOSSIP = {"op": "gossip", "tag": "fuzz", "round": 0, "src": 0, "gen": 0, "keys": ["w"], "weight": 0.5,
          "dtypes": ["<f8"], "counts": [3]}
ACK = {"op": "gossip_ack", "src": 0, "gen": 0, "shm": "bpsg_nothing"}


def report(value):
    print("RESULT " + json.dumps(value), flush=True)


def variants(template, rng):
    """Every field of ``template`` replaced by every bad value, fields dropped, and garbage."""
    for field in template:
        for bad in BAD_VALUES:
            yield {**template, field: bad}
        yield {k: v for k, v in template.items() if k != field}
    for _ in range(150):
        yield {**template, **{rng.choice(list(template)): rng.choice(BAD_VALUES) for _ in range(3)}}


CONNECTIONS = itertools.count()


def attack(address, template, rng, payloads):
    """Send every variant (and some undecodable frames) to ``address``; return how many were sent."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, KEYS, serve=False)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    # an id of this process's key (each connection its own): what else a message says is fuzzed
    sock.setsockopt(zmq.IDENTITY, routing_id(f"fuzz{next(CONNECTIONS)}", KEYS))
    sock.connect(address)
    sent = 0
    for msg in variants(template, rng):
        frames = [msgpack.packb(msg, use_bin_type=True)] + rng.choice(payloads)
        sock.send_multipart(frames)
        sent += 1
    for garbage in (b"", b"\xc1", b"\x92\x01", os.urandom(64), msgpack.packb([1, 2]), msgpack.packb({"op": 7})):
        sock.send_multipart([garbage])
        sent += 1
    sock.close()
    return sent


def oversized(address, template, count=3):
    """Messages far above the socket's ZMQ_MAXMSGSIZE: the connection drops, nothing is kept."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, KEYS, serve=False)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for _ in range(count):
        sock.send_multipart([msgpack.packb(template), b"\0" * (64 << 20)])
    sock.close()
    return count


bps.init()
rank, size = bps.rank(), bps.size()
book = testing.address_book()
rng = random.Random(rank)
payloads = [[], [b"\x00" * 8], [b"\x00" * 3], [b"\x00" * 8, b"\x00" * 8]]
sent = attack(os.environ["FUZZ_SCHEDULER"], REGISTER, rng, payloads)
sent += oversized(os.environ["FUZZ_SCHEDULER"], REGISTER)
for server in book.servers:
    sent += attack(server, {**PUSH, "rank": rank, "gen": book.generation}, rng, payloads)
    sent += oversized(server, PUSH, count=1)  # 64 MiB: above the servers' frame limit too
peer = (rank + 1) % size
sent += attack(book.workers[peer].addr, {**GOSSIP, "src": rank}, rng, payloads)
sent += attack(book.workers[peer].addr, {**ACK, "src": rank}, rng, payloads)
bps.barrier()

total = bps.push_pull(np.full(5, rank + 1.0), "after_fuzz", average=False)
averager = GossipAverager({"w": np.full(3, float(rank))}, tag="after_fuzz")
averager.step()
report({"rank": rank, "sent": sent, "sum": total.tolist(), "gossip": averager.debiased()["w"].tolist()})
bps.shutdown()
