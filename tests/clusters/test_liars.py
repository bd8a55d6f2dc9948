"""Members that lie (tests/jobs/liars_job.py): gather_rows gives every rank each rank's own row,
whatever one rank writes into the others'; a broadcast gives every rank the root's array, whatever
another rank pushes."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok


@pytest.mark.timeout(90)
@pytest.mark.parametrize("env", [{}, {"BPS_GOSSIP_SHM": "0"}, {"BPS_GOSSIP_HOST_REDUCE": "off"}],
                         ids=["one-host", "zmq", "shm-to-servers"])
def test_a_rank_cannot_write_into_another_ranks_row(cluster, env):
    job = cluster(3, 2, env)
    done = job.run_job("liars_job", "gather", "3")
    assert_all_ok(done, job)
    honest = [[0.0, 0.5], [1.0, 1.5]]
    for finished in done:
        for got in finished.result["got"]:
            assert got[:2] == honest, finished.result  # the liar's 1e9 never reached another's row
            assert got[2] == [1e9, 1e9], finished.result  # its own row is its own business
    job.wait_servers_exit()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("env", [{"BPS_GOSSIP_HOST_REDUCE": "off"}, {"BPS_GOSSIP_SHM": "0"},
                                 {"BPS_GOSSIP_HOST_REDUCE": "on"}],
                         ids=["shm-to-servers", "zmq", "host-reduce"])
def test_a_rank_cannot_add_into_a_broadcast(cluster, env):
    """A non-root rank used to push zeros that the servers summed: pushing anything else changed
    every rank's copy of the root's array (the model broadcast at the first step). The servers
    now take only the root's payload, and so does a host's leader of its locals' pushes (the
    liar is a local of rank 0's host); a leader that lies itself still reaches the servers' sum."""
    job = cluster(3, 1, env)
    done = job.run_job("liars_job", "broadcast")
    assert_all_ok(done, job)
    for finished in done:
        assert finished.result["got"] == [1.0, 2.0, 3.0, 4.0], finished.result
    job.wait_servers_exit()


@pytest.mark.timeout(60)
def test_a_sum_pushed_to_a_host_leader_under_a_gathered_name_fails_at_once(cluster):
    """Reduced by host, a liar (a local) that pushed a sum where every other rank gathered rows
    sent it to its host's leader, where no rank's push ever joined it: every rank waited until
    BPS_GOSSIP_TIMEOUT (120 s here, past this test's timeout). The leader, whose own gather went
    straight to the servers, fails the round at once and the servers' with it: every rank gets a
    TensorMismatchError, whichever comes first (the local's push or the leader's gather), and
    the next gather works."""
    job = cluster(3, 1, {"BPS_GOSSIP_HOST_REDUCE": "on", "BPS_GOSSIP_TIMEOUT": "120"})
    done = job.run_job("liars_job", "sum_where_rows_are_gathered", timeout=50)
    assert_all_ok(done, job)
    for finished in done:
        assert finished.result["decided"] == ["TensorMismatchError"] * 3, finished.result
        assert finished.result["after"] == [[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]], finished.result
