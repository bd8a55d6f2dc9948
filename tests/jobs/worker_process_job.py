"""A worker process seen from outside: its threads' OS names (tests/clusters/test_bench_accounting.py),
the shared memory a killed one leaves (test_leftover_segments.py), the error it prints when the ranks'
models differ (test_quiet_output.py), and a plain push_pull for processes started in any order
(test_kubernetes.py).
"""

from __future__ import annotations

import os

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip.transport import shm


def thread_names() -> None:
    """The sorted OS names of every thread of this process while it is part of a job."""
    bps.init()
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names.append(comm.read().strip())
    bps.shutdown()
    report(sorted(names))


def doomed_segment() -> None:
    """Make a segment of the job named by DMLC_PS_ROOT_PORT, as a pushing worker does, print its
    name (the only line), and die by SIGKILL without cleaning up."""
    segment = shm.OwnedSegment(os.environ["DMLC_PS_ROOT_PORT"], 4096)
    print(segment.name, flush=True)
    os.kill(os.getpid(), 9)


def different_models() -> None:
    """Rank 0 builds Dense(8), the others Dense(9), with deferred shapes (known at the first
    forward): the first step raises TensorMismatchError."""
    import mxnet as mx  # seconds to import: only this scenario needs it

    import mxnet_plugin

    mxnet_plugin.init()
    net = mx.gluon.nn.Dense(8 if mxnet_plugin.rank() == 0 else 9)  # deferred shapes: known at the first forward
    net.initialize()
    trainer = mxnet_plugin.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    trainer.step(2)


def rank_sum() -> None:
    """One push_pull of rank + 1: {"rank", "sum"}."""
    bps.init()
    out = bps.push_pull(np.full(3, bps.rank() + 1.0), "x", average=False)
    report({"rank": bps.rank(), "sum": out.tolist()})
    bps.shutdown()


if __name__ == "__main__":
    run({"thread_names": thread_names, "doomed_segment": doomed_segment, "different_models": different_models,
         "rank_sum": rank_sum})
