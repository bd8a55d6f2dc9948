"""GossipAverager over the workers' peer channel (tests/clusters/test_gossip.py): mass
conservation on every graph, exact averaging, geometric convergence, push-sum de-biasing, and a
dead peer failing the round."""

from __future__ import annotations

import os
import time

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.gossip.graphs import ExplicitGraph


def mass_conservation(*graphs: str) -> None:
    """6 SGD steps of a constant per-rank gradient on each of ``graphs``, with and without overlap
    and push-sum: x, w and the de-biased z of each, and whether the next rank is on shared memory."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    w0 = np.linspace(-1, 1, 7)
    grad = np.arange(7) * 0.1 + rank       # a constant gradient per rank
    lr, steps = 0.05, 6
    out = {}
    for graph in graphs:
        for overlap in (False, True):
            for push_sum in ((True, False) if not overlap else (True,)):
                tag = f"{graph}-{overlap}-{push_sum}"
                try:
                    # routing off: z's mean is exact only while every w comes back to 1
                    avg = GossipAverager({"w": w0}, graph=graph, overlap=overlap, push_sum=push_sum, tag=tag,
                                         route_slow_links=False)
                except ValueError as exc:   # push-pull needs a regular graph
                    out[tag] = str(exc)
                    continue
                for _ in range(steps):
                    z = avg.debiased()
                    avg.apply_update(z, {"w": z["w"] - lr * grad})
                    avg.step()
                avg.flush()
                out[tag] = [avg.x["w"].tolist(), avg.weight, avg.debiased()["w"].tolist()]
    out["shared_memory"] = avg.link.is_local((rank + 1) % size)
    report(out)
    bps.shutdown()


def exact_average(peers: str, rounds: str) -> None:
    """``rounds`` rounds of npdde with ``peers`` peers per round: the de-biased average."""
    bps.init()
    avg = GossipAverager({"w": np.full(5, float(bps.rank() * 3 + 1))}, graph="npdde", peers_per_itr=int(peers))
    for _ in range(int(rounds)):
        avg.step()
    report(avg.debiased()["w"].tolist())
    bps.shutdown()


def geometric_convergence() -> None:
    """18 rounds of npdde: the consensus distance after each."""
    bps.init()
    avg = GossipAverager({"w": np.full(3, float(bps.rank() ** 2))}, graph="npdde")
    distances = []
    for _ in range(18):
        avg.step()
        distances.append(avg.consensus_distance())
    report(distances)
    bps.shutdown()


def push_sum_irregular() -> None:
    """60 rounds on an irregular 3-rank schedule: numerator, weight and de-biased value."""
    bps.init()
    # rank 0 sends to both others, rank 1 only to 2, rank 2 only to 0: not regular
    graph = ExplicitGraph(3, [{0: [1, 2], 1: [2], 2: [0]}])
    avg = GossipAverager({"w": np.array([float(bps.rank()) * 6])}, graph=graph)
    for _ in range(60):
        avg.step()
    report([avg.x["w"][0], avg.weight, avg.debiased()["w"][0]])
    bps.shutdown()


def dead_peer() -> None:
    """Rank 1 dies after round 0; the others report what the next rounds raised and when."""
    bps.init()
    avg = GossipAverager({"w": np.ones(4)}, graph="ring")
    avg.step()
    bps.barrier()  # every round-0 message has arrived before rank 1 dies
    if bps.rank() == 1:
        os.kill(os.getpid(), 9)
    start = time.time()
    try:
        for _ in range(5):
            avg.step()
        report(["no error"])
    except bps.BpsGossipError as exc:
        report([type(exc).__name__, str(exc), time.time() - start])
    bps.shutdown()


if __name__ == "__main__":
    run({"mass_conservation": mass_conservation, "exact_average": exact_average,
         "geometric_convergence": geometric_convergence, "push_sum_irregular": push_sum_irregular,
         "dead_peer": dead_peer})
