"""Horovod's collectives for MXNet users on 3 real ranks (tests/jobs/horovod_collectives_job.py):
allgather with first dimensions that differ by rank, a mismatched trailing shape or dtype failing on
every rank naming the ranks, objects across ranks (plain data; a set fails on every rank), and
grouped_allreduce / grouped_push_pull against sums computed from every rank's inputs."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank


@pytest.mark.timeout(150)
def test_horovod_collectives_on_three_ranks(cluster):
    # small partitions: the big allgather goes in many pieces, more than one window of them
    job = cluster(3, 1, {"BYTEPS_PARTITION_BYTES": "6000"})
    done = job.run_job("horovod_collectives_job", "all", timeout=140)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    for r in results:
        assert not r["failures"], f"rank {r['rank']}: " + "\n".join(r["failures"])
        errors = r["errors"]
        kind, message = errors["trailing"]
        assert kind == "TensorMismatchError", (r["rank"], errors)
        assert "ranks 0, 1: float32 (*, 3)" in message and "rank 2: float32 (*, 4)" in message, message
        kind, message = errors["dtype"]
        assert kind == "TensorMismatchError" and "rank 2: float64 (*, 3)" in message, message
        kind, message = errors["0-d"]
        if r["rank"] == 2:
            assert kind == "ValueError" and "0-d" in message, message
        else:
            assert kind == "TensorMismatchError" and "rank 2 gave a 0-d array" in message, message
        kind, message = errors["list"]
        if r["rank"] == 2:
            assert kind == "TypeError" and "got list" in message, message
        else:
            assert kind == "TensorMismatchError" and "rank 2 gave something that is not a numpy array" in message, message

        objects = r["objects"]
        kind, message = objects["allgather_set"]
        assert kind == "TypeError" and "rank 1: cannot send a set" in message, message
        kind, message = objects["broadcast_set"]
        assert kind == "TypeError" and "root rank 0" in message and "a set" in message, message
        assert objects["after"] == [0, 1, 2]

        grouped = r["grouped"]
        assert grouped["both"][0] == "ValueError", grouped
        assert grouped["process_set"][0] == "NotImplementedError", grouped
    job.wait_servers_exit()


@pytest.mark.timeout(90)
def test_horovod_collectives_one_worker_local_mode(cluster):
    job = cluster(1, start_servers=False)
    done = job.run_job("horovod_collectives_job", "alone", timeout=80)
    assert_all_ok(done, job)
    result = done[0].result
    assert not result["failures"], result["failures"]
    assert result["set"][0] == "TypeError" and "a set" in result["set"][1], result
    assert result["0-d"][0] == "ValueError" and "got a 0-d array" in result["0-d"][1], result
