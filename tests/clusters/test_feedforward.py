"""MXNet's legacy FeedForward API with kvstore='bpsgossip' (issue 23, item 1): it decides gradient
scaling by the store's type as for dist_sync, so 2 workers with batch B each must train as one
process with batch 2B on both shards (SGD without momentum: the step is the mean gradient). The
workers run tests/jobs/feedforward_job.py."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok


@pytest.mark.timeout(120)
def test_feedforward_trains_as_one_process_on_the_global_batch(cluster):
    job = cluster(2)
    done = job.run_job("feedforward_job", "global_batch", timeout=100)
    assert_all_ok(done, job)
    results = [f.result for f in done]
    assert results[0]["digest"] == results[1]["digest"], results  # ranks identical
    assert all(r["moved"] > 1e-2 for r in results), results  # the comparison means something
    assert all(r["max_difference"] < 1e-5 for r in results), results
    job.wait_servers_exit()
