"""mxnet_plugin plans a step's fused push_pulls over the servers by bytes
(bps_gossip.worker.server_choice.plan_servers), the same on every rank: DistributedTrainer's
allreduce mode and gluon.Trainer with the 'bpsgossip' KVStore, 2 workers and 3 servers. The
workers run tests/jobs/server_balance_job.py."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank


def on_three_servers(cluster, scenario: str, timeout: float) -> list[dict]:
    """Each rank's report of server_balance_job's ``scenario``, run by 2 workers pushing to 3
    servers (host reduce off: on one host the lowest rank would sum, and no server would take a push)."""
    job = cluster(2, servers=3, env={"BYTEPS_PARTITION_BYTES": "65536", "BPS_GOSSIP_HOST_REDUCE": "off"})
    done = job.run_job("server_balance_job", scenario, timeout=timeout)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    return results_by_rank(done)


@pytest.mark.timeout(120)
def test_fused_steps_balance_bytes_over_servers(cluster):
    for r in on_three_servers(cluster, "fused_steps", 110):
        assert not r["failures"], r["failures"]
        # the names' hash alone would put some partitions elsewhere: the plan is what is checked
        assert r["allreduce_differs_from_hash"] and r["kvstore_differs_from_hash"], r
        assert r["allreduce_partitions"] >= 10 and not r["allreduce_mismatch"], r
        assert max(r["allreduce_load"]) - min(r["allreduce_load"]) <= 1, r
        assert r["kvstore_checked"] >= 10 and not r["kvstore_mismatch"], r


@pytest.mark.timeout(60)
def test_plan_servers_places_a_users_tensors(cluster):
    for r in on_three_servers(cluster, "plan_servers", 50):
        assert r["sums_ok"] and r["differs_from_hash"] and not r["mismatch"], r
        assert "pushed already" in r["late"], r
