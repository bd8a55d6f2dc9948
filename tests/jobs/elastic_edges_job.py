"""Elastic jobs at their edges, beside the training of elastic_job.py: a worker that stalls
(tests/clusters/test_launcher_elastic.py), one that finishes long after the other
(test_elastic.py), and the MXNet APIs an elastic job refuses (test_mxnet_elastic.py).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from job_tools import report, run

import bps_gossip as bps


def stall() -> None:
    """Both slots say READY; a second later rank 1 stops itself (SIGSTOP: alive, no heartbeats).
    A slot's replacement (MARKER<slot> exists) never joins: the job stays below --min-np."""
    marker = os.environ["MARKER"] + os.environ["BYTEPS_LOCAL_RANK"]
    if os.path.exists(marker):
        time.sleep(1000)
    open(marker, "w").close()
    bps.init()
    print("READY", bps.rank(), os.getpid(), flush=True)
    time.sleep(1.0)
    if bps.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stuck: no heartbeats; the scheduler removes it (and kills it)
    time.sleep(1000)


def late_finisher() -> None:
    """One push_pull of ones; rank 0 reports 4 s after the other has left: [rank, sum]."""
    bps.init()
    total = bps.push_pull(np.ones(3), "x", average=False)
    if bps.rank() == 0:
        time.sleep(4)  # a long final evaluation after the other worker has left
    report([bps.rank(), total.tolist()])
    bps.shutdown()


def kvstore_and_module_api() -> None:
    """The ConfigError messages of creating a 'bpsgossip' KVStore and a DistributedOptimizer
    ("no error" where there was none)."""
    import mxnet as mx  # seconds to import: only this scenario needs it

    import mxnet_plugin

    mxnet_plugin.init()
    errors = []
    for make in (lambda: mx.kv.create("bpsgossip"), lambda: mxnet_plugin.DistributedOptimizer(mx.optimizer.SGD())):
        try:
            make()
            errors.append("no error")
        except bps.ConfigError as exc:
            errors.append(str(exc))
    report(errors)
    mxnet_plugin.shutdown()


if __name__ == "__main__":
    run({"stall": stall, "late_finisher": late_finisher, "kvstore_and_module_api": kvstore_and_module_api})
