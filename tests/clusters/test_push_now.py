"""Small push_pulls sent from the caller's thread (worker.caller_sends.push_now; to a server, or to
the host leader that sums a one-host job): a chain of them
started from a future's callback (which runs on the engine thread, holding the links' lock)
goes through the engine instead of waiting for that lock, and many in a row all complete."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

pytestmark = pytest.mark.timeout(120)

CODE = '''
import threading
import numpy as np
import bps_gossip as bps

bps.init()
ones = np.ones(16, np.float32)
results, done = [], threading.Event()


def chained(depth):
    def callback(future):
        results.append(float(future.result()[0]))
        if depth:
            bps.push_pull_async(ones, f"chain{depth}", average=False).add_done_callback(chained(depth - 1))
        else:
            done.set()
    return callback


bps.push_pull_async(ones, "chain3", average=False).add_done_callback(chained(2))
finished = done.wait(60)
out = np.empty_like(ones)
sums = set()
for step in range(300):  # blocking, one after the other: each sent by this thread
    sums.add(float(bps.push_pull(ones * step, "loop", average=False, out=out)[0]) - 2 * step)
report({"chain": results if finished else None, "loop": sorted(sums)})
bps.shutdown()
'''


@pytest.mark.parametrize("host_reduce", ["off", "auto"], ids=["to-the-server", "through-the-host-leader"])
def test_chained_from_callbacks_and_in_a_loop(cluster, host_reduce):
    job = cluster(2, env={"BPS_GOSSIP_HOST_REDUCE": host_reduce})
    finished = job.run_workers(CODE, timeout=100)
    assert_all_ok(finished, job)
    for worker in finished:
        assert worker.result == {"chain": [2.0, 2.0, 2.0], "loop": [0.0]}
