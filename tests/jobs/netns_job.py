"""The workers of tests/clusters/test_netns.py, each on its own emulated host (a network
namespace of scripts/netns_cluster.py, whose eth0 is the host's link: /sys inside ``ip netns
exec`` is the namespace's own). Each prints one ``RESULT`` line for the test.
"""

from __future__ import annotations

import json

import numpy as np
from job_tools import run

import bps_gossip as bps
from bps_gossip import testing


def link_bytes(name: str) -> int:
    """The count ``name`` (rx or tx) of bytes through this host's link."""
    with open(f"/sys/class/net/eth0/statistics/{name}_bytes") as counter:
        return int(counter.read())


def push_pull_over_the_link(elements: str, rounds: str) -> None:
    """``rounds`` push_pulls of ``elements`` float32, each sum checked: ``RESULT rank= size= rx= tx=
    shm=`` (the link's bytes meanwhile, and the servers reached through shared memory)."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    rx0, tx0 = link_bytes("rx"), link_bytes("tx")
    x = np.full(int(elements), rank + 1, dtype=np.float32)
    for _ in range(int(rounds)):
        out = bps.push_pull(x, name="t", average=False)
        assert np.all(out == size * (size + 1) / 2), out[:4]
    rx1, tx1 = link_bytes("rx"), link_bytes("tx")
    print(f"RESULT rank={rank} size={size} rx={rx1 - rx0} tx={tx1 - tx0} "
          f"shm={sorted(testing.server_links().shm_servers)}", flush=True)
    bps.shutdown()


def sent_between_barriers(elements: str, rounds: str) -> None:
    """Two workers on each host: what the host's link sent during ``rounds`` push_pulls, between
    barriers, once connections and segments are made: ``RESULT rank= size= tx=``."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    x = np.full(int(elements), rank + 1, dtype=np.float32)
    bps.push_pull(x, name="t", average=False)  # connections and segments made
    bps.barrier()
    before = link_bytes("tx")
    for _ in range(int(rounds)):
        out = bps.push_pull(x, name="t", average=False)
        assert np.all(out == size * (size + 1) / 2), out[:4]
    bps.barrier()
    print(f"RESULT rank={rank} size={size} tx={link_bytes('tx') - before}", flush=True)
    bps.shutdown()


def auto_mode_steps() -> None:
    """30 steps of a Dense(256) layer with mode='auto', then an exact average: ``RESULT`` with the
    mode history and the consensus distance (JSON)."""
    import mxnet as mx  # seconds to import: only this scenario needs it

    import mxnet_plugin

    mxnet_plugin.init()
    rank = mxnet_plugin.rank()
    net = mx.gluon.nn.Dense(256, in_units=256)
    net.initialize(mx.init.Constant(0.01))
    trainer = mxnet_plugin.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.001}, mode="auto")
    x = mx.nd.full((2, 256), rank + 1.0)
    for _ in range(30):
        with mx.autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
    trainer.average_parameters()
    print("RESULT " + json.dumps({"history": list(trainer.mode_history), "distance": trainer.consensus_distance()}),
          flush=True)
    mxnet_plugin.shutdown()


if __name__ == "__main__":
    run({"push_pull_over_the_link": push_pull_over_the_link, "sent_between_barriers": sent_between_barriers,
         "auto_mode_steps": auto_mode_steps})
