"""Small push_pulls sent from the caller's thread (tests/clusters/test_push_now.py): a chain
started from futures' callbacks, then 300 blocking ones in a row."""

from __future__ import annotations

import threading

import numpy as np
from job_tools import report, run

import bps_gossip as bps


def chained(depth, ones, results, done):
    """A done-callback that records the sum and starts the next push_pull, ``depth`` more."""
    def callback(future):
        results.append(float(future.result()[0]))
        if depth:
            bps.push_pull_async(ones, f"chain{depth}", average=False).add_done_callback(
                chained(depth - 1, ones, results, done))
        else:
            done.set()
    return callback


def chain_and_loop() -> None:
    """A chain of 3 push_pulls from callbacks, then 300 blocking ones: the sums."""
    bps.init()
    ones = np.ones(16, np.float32)
    results, done = [], threading.Event()
    bps.push_pull_async(ones, "chain3", average=False).add_done_callback(chained(2, ones, results, done))
    finished = done.wait(60)
    out = np.empty_like(ones)
    sums = set()
    for step in range(300):  # blocking, one after the other: each sent by this thread
        sums.add(float(bps.push_pull(ones * step, "loop", average=False, out=out)[0]) - 2 * step)
    report({"chain": results if finished else None, "loop": sorted(sums)})
    bps.shutdown()


run({"chain_and_loop": chain_and_loop})
