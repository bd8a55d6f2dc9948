"""The smallest end-to-end check: 2 workers, 1 server, one push_pull."""

import pytest
from cluster import assert_all_ok

pytestmark = pytest.mark.smoke  # run by every Python of .ci/pythons


@pytest.mark.timeout(60)
def test_two_workers_sum(cluster):
    job = cluster(2)
    done = job.run_job("smoke_job", "sum_of_ranks")
    assert_all_ok(done, job)
    for f in done:
        assert f.result == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    job.wait_servers_exit()
