"""Small push_pulls sent from the caller's thread (worker.caller_sends.push_now; to a server, or to
the host leader that sums a one-host job): a chain of them
started from a future's callback (which runs on the engine thread, holding the links' lock)
goes through the engine instead of waiting for that lock, and many in a row all complete. The
workers run tests/jobs/push_now_job.py."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

pytestmark = pytest.mark.timeout(120)

@pytest.mark.parametrize("host_reduce", ["off", "auto"], ids=["to-the-server", "through-the-host-leader"])
def test_chained_from_callbacks_and_in_a_loop(cluster, host_reduce):
    job = cluster(2, env={"BPS_GOSSIP_HOST_REDUCE": host_reduce})
    finished = job.run_job("push_now_job", "chain_and_loop", timeout=100)
    assert_all_ok(finished, job)
    for worker in finished:
        assert worker.result == {"chain": [2.0, 2.0, 2.0], "loop": [0.0]}
