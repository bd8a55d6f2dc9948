"""A worker's gossip connections across elastic generations, in one process: the DEALER to a
peer that stays in the job is used again (a new one would present the same routing id while the
peer's ROUTER may still hold the old connection, and without handover the ROUTER drops it with
what it carried); one to a peer that left is closed. A real ROUTER on 127.0.0.1 is the peer."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import zmq

from bps_gossip.config import Config
from bps_gossip.transport import bind_random_port, recv_message
from bps_gossip.worker.peer_endpoint import PeerEndpoint

pytestmark = pytest.mark.timeout(60)


def _book(generation: int, peers: list[str]):
    from bps_gossip.protocol import BookEntry
    from bps_gossip.worker.scheduler_link import Book

    uids = [(b"me" * 4).hex()] + [bytes([65 + i]).hex() * 4 for i in range(len(peers))]
    workers = [BookEntry(rank=rank, uid=uid, addr=addr, host="127.0.0.1", pid=1, local_rank=0, local_size=1)
               for rank, (uid, addr) in enumerate(zip(uids, ["tcp://127.0.0.1:9", *peers]))]
    return Book(rank=0, size=len(workers), local_rank=0, local_size=1, generation=generation, servers=[],
                workers=workers)


def test_a_peer_that_stays_keeps_its_connection():
    ctx = zmq.Context.instance()
    peers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    addrs = [bind_random_port(sock, "127.0.0.1") for sock in peers]
    endpoint = PeerEndpoint(ctx, dataclasses.replace(Config(), shm=False), b"me" * 4, logging.getLogger("test"), None)
    try:
        endpoint.new_generation(_book(1, addrs))
        header = {"tag": "g", "round": 0, "keys": ["w"], "weight": None}
        for dst in (1, 2):
            endpoint.channel.send(dst, header, [np.ones(3, np.float32)])
        kept, left = endpoint.channel.routes[1].sock, endpoint.channel.routes[2].sock
        for sock in peers:
            assert sock.poll(5000)
            assert recv_message(sock, routed=True)[1]["gen"] == 1
        endpoint.new_generation(_book(2, addrs[:1]))  # the second peer left the job
        assert left.closed and not kept.closed
        endpoint.channel.send(1, {**header, "round": 1}, [np.ones(3, np.float32)])
        assert endpoint.channel.routes[1].sock is kept
        assert peers[0].poll(5000)
        route, message, _ = recv_message(peers[0], routed=True)
        assert route == b"me" * 4 and message["gen"] == 2 and message["round"] == 1
    finally:
        endpoint.close()
        for sock in peers:
            sock.close(linger=0)
