"""The shared-memory data path: the same bits as TCP, and no segment left behind. The workers run
tests/jobs/shm_job.py."""

from __future__ import annotations

import time

import pytest
from cluster import assert_all_ok

from bps_gossip.transport import shm


def _segments(job: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}_{job}_*"))


@pytest.mark.timeout(180)
def test_shared_memory_gives_the_same_bits_as_tcp(cluster):
    results = {}
    for flag in ("1", "0"):
        # 2 servers, small partitions: multi-partition tensors on both, 3 workers
        job = cluster(3, servers=2, env={"BPS_GOSSIP_SHM": flag, "BYTEPS_PARTITION_BYTES": "4096"})
        done = job.run_job("shm_job", "every_dtype")
        assert_all_ok(done, job)
        results[flag] = [f.result for f in done]
        job.wait_servers_exit()
        assert _segments(str(job.port)) == []
    assert results["1"] == results["0"]
    assert all(r == results["1"][0] for r in results["1"])  # every rank got the same bits


@pytest.mark.timeout(120)
def test_shared_memory_is_used_and_cleaned_up_on_shutdown(cluster):
    job = cluster(2, env={"BPS_GOSSIP_SHM": "1"})
    done = job.run_job("shm_job", "segments_while_running", f"/dev/shm/{shm.PREFIX}_{job.port}_*")
    assert_all_ok(done, job)
    assert all(f.result >= 1 for f in done), "no shared-memory segment while running"
    job.wait_servers_exit()
    assert _segments(str(job.port)) == []


@pytest.mark.timeout(120)
def test_killed_worker_leaves_no_segment(cluster):
    job = cluster(3, env={"BPS_GOSSIP_SHM": "1"})
    done = job.run_job("shm_job", "killed_worker")
    survivors = [f for f in done if f.rank_hint != 1]
    assert all(f.returncode == 0 and f.result == "PeerLostError" for f in survivors), job.dump()
    job.wait_servers_exit()
    deadline = time.monotonic() + 5
    while _segments(str(job.port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _segments(str(job.port)) == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env", [{"BPS_GOSSIP_HOST_REDUCE": "off"}, {}], ids=["server", "host-leader"])
def test_push_pulls_from_a_shared_buffer_need_no_other_segment(cluster, env):
    job = cluster(3, env={"BPS_GOSSIP_SHM": "1", "BYTEPS_PARTITION_BYTES": "4096", **env})
    done = job.run_job("shm_job", "leased")
    assert_all_ok(done, job)
    results = [f.result for f in done]
    assert all(r["hosting"] == (not env) for r in results), results
    # one segment each (the buffer), before an out-of-place push_pull stages one more
    assert all(r["leased"] == 1 and r["after"] == 2 for r in results), results
    job.wait_servers_exit()
    assert _segments(str(job.port)) == []


@pytest.mark.timeout(60)
def test_shared_buffer_refuses_a_bad_size(cluster):
    job = cluster(1, env={"BPS_GOSSIP_SHM": "1", "BYTEPS_FORCE_DISTRIBUTED": "1"})
    done = job.run_job("shm_job", "bad_sizes")
    assert_all_ok(done, job)
    assert len(done[0].result) == 5 and "positive int" in done[0].result[0]
