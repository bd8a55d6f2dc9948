"""push_pull, broadcast, barrier and partition placement on real clusters.

Each cluster shape runs one job (tests/jobs/push_pull_job.py) that makes hundreds of checks (every dtype,
0-d to 4-d and zero-size shapes, tensors smaller and larger than the partition size,
every output form, asynchronous calls in rank-dependent orders) and reports the ones
that failed. Values are small integers, so sums are exact and results are compared
bit for bit; broadcast payloads are random bits, -0.0 and NaN payloads included.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

pytestmark = pytest.mark.paths  # the newest Python of .ci/pythons runs these too

SMALL_PARTS = {"BYTEPS_PARTITION_BYTES": "4096"}


SHAPES = [
    pytest.param(1, 0, {}, id="1worker-local"),
    pytest.param(1, 1, {"BYTEPS_FORCE_DISTRIBUTED": "1"}, id="1worker-forced-1server"),
    pytest.param(2, 1, {}, id="2workers-1server"),
    pytest.param(2, 2, {"BPS_GOSSIP_SHM": "0"}, id="2workers-2servers-zmq"),
    pytest.param(3, 2, {}, id="3workers-2servers"),  # one host: summed by its leader, the servers take none
    pytest.param(3, 2, {"BPS_GOSSIP_HOST_REDUCE": "off"}, id="3workers-2servers-shm-to-servers"),
    pytest.param(4, 1, {}, id="4workers-1server"),
    pytest.param(4, 2, {"BPS_GOSSIP_SHM": "0", "BYTEPS_SCHEDULING_CREDIT": "1"}, id="4workers-2servers-zmq-credit1"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,servers,env", SHAPES)
def test_collectives_bit_exact(cluster, workers, servers, env):
    local = servers == 0
    job = cluster(workers, max(servers, 1), {**SMALL_PARTS, **env}, start_servers=not local)
    done = job.run_job("push_pull_job", "collectives", timeout=120)
    assert_all_ok(done, job)
    for f in done:
        result = f.result
        assert result["rank"] == f.rank_hint and result["size"] == workers
        assert result["checks"] > 900, result
        assert result["failures"] == [], (f.rank_hint, result["failures"])
    if not local:
        job.wait_servers_exit()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm,host_reduce", [("1", "off"), ("0", "auto"), ("1", "auto")],
                         ids=["shm-servers", "tcp-servers", "shm-host-leader"])
def test_large_partitions_credit_and_server_pool(cluster, shm, host_reduce):
    job = cluster(3, 2, {"BYTEPS_PARTITION_BYTES": "1200000", "BYTEPS_SCHEDULING_CREDIT": "2",
                         "BYTEPS_SERVER_ENGINE_THREAD": "2", "BPS_GOSSIP_SHM": shm,
                         "BPS_GOSSIP_HOST_REDUCE": host_reduce})
    done = job.run_job("push_pull_job", "big_partitions", timeout=60)
    assert_all_ok(done, job)
    for f in done:
        assert f.result == {"checks": 6, "failures": []}, f.result
    job.wait_servers_exit()


@pytest.mark.timeout(60)
def test_partitions_spread_over_servers(cluster):
    job = cluster(2, 2, {**SMALL_PARTS, "BPS_GOSSIP_HOST_REDUCE": "off"})  # on one host the leader would sum them all
    done = job.run_job("push_pull_job", "spread")
    assert_all_ok(done, job)
    for f in done:
        result = f.result
        assert result["ok"]
        stats = result["stats"]
        assert [s["rank"] for s in stats] == [0, 1]
        big = [set(s["parts"].get(result["big"], [])) for s in stats]
        assert big[0] and big[1], f"every partition landed on one server: {big}"
        assert big[0] | big[1] == set(range(10)) and not big[0] & big[1], big
        small = [result["small"] in s["parts"] for s in stats]
        assert small.count(True) == 1, stats
    job.wait_servers_exit()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 3])
def test_barrier_waits_for_every_rank(cluster, workers):
    job = cluster(workers, 1, start_servers=workers > 1)
    done = job.run_job("push_pull_job", "barrier")
    assert_all_ok(done, job)
    times = [f.result["times"] for f in done]
    for i in range(3):
        last_arrival = max(t[i][0] for t in times)
        first_release = min(t[i][1] for t in times)
        assert first_release >= last_arrival, (i, times)
        if workers > 1:  # the slowest rank slept 0.5 s longer than the fastest
            assert max(t[i][1] - t[i][0] for t in times) >= 0.4, (i, times)
    if workers > 1:
        job.wait_servers_exit()


@pytest.mark.timeout(90)
def test_thousands_of_partitions_in_flight(cluster):
    # ~6000 partitions of one tensor plus 2000 small tensors, all queued at once: the engine
    # must keep heart-beating and reading results while it sends, and no reply may be dropped.
    job = cluster(2, 1, {**SMALL_PARTS, "BPS_GOSSIP_SHM": "0"})
    done = job.run_job("push_pull_job", "thousands_in_flight", timeout=75)
    assert_all_ok(done, job)
    for f in done:
        assert f.result == {"huge": True, "tiny": True}
    job.wait_servers_exit()


@pytest.mark.timeout(120)
def test_shared_memory_and_tcp_workers_in_one_round(cluster):
    """Ranks 0 and 1 push through shared memory, rank 2 over TCP: the server's sum lives in a
    worker's region, which that worker reuses for its next push as soon as it has read it, so
    the TCP worker's copy must be taken before anyone hears of the result."""
    job = cluster(3)
    done = job.run_job("push_pull_job", "mixed_paths", timeout=110, per_rank_env={2: {"BPS_GOSSIP_SHM": "0"}})
    assert_all_ok(done, job)
    for result in (f.result for f in done):
        assert not result["failures"], result
    job.wait_servers_exit()
