"""One push per host (bps_gossip.host_groups): workers on one host reduce through shared memory and
their leader pushes for them. Two emulated hosts on loopback (workers advertising 127.0.0.1
and 127.0.0.2; both are this machine's loopback), so the default mode (auto) turns it on. The
workers run tests/jobs/host_reduce_job.py, and push_pull_job.py for the collectives."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank
from test_push_pull import SMALL_PARTS

AUTO = {"BPS_GOSSIP_HOST_REDUCE": "auto"}  # the default, whatever the test run's environment says
TWO_HOSTS = {0: {"DMLC_NODE_HOST": "127.0.0.1"}, 1: {"DMLC_NODE_HOST": "127.0.0.1"},
             2: {"DMLC_NODE_HOST": "127.0.0.2"}, 3: {"DMLC_NODE_HOST": "127.0.0.2"}}

def run(cluster, env, per_rank_env, workers=4, servers=1):
    job = cluster(workers, servers, {**AUTO, **env})
    done = job.run_job("host_reduce_job", "places", timeout=80, per_rank_env=per_rank_env)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    return results_by_rank(done)


@pytest.mark.timeout(100)
def test_two_hosts_push_once_each(cluster):
    results = run(cluster, {}, TWO_HOSTS)
    assert [r["leader"] for r in results] == [0, 0, 2, 2]
    assert all(r["hosting"] for r in results)
    assert len({r["digest"] for r in results}) == 1 and all(r["small"] == 6 for r in results)
    (stats,) = results[0]["stats"]
    # Only the leaders pushed: 5 rounds of "grad" (1.2 MB, one partition each) and one "small".
    assert stats["pushes"] == [6, 0, 6, 0], stats
    assert stats["socket_bytes"] < 2 * 6 * 1.3e6, stats  # rank 2's pushes came over TCP, rank 0's not


@pytest.mark.timeout(100)
def test_off_pushes_from_every_worker(cluster):
    results = run(cluster, {"BPS_GOSSIP_HOST_REDUCE": "off"}, TWO_HOSTS)
    assert [r["leader"] for r in results] == [0, 1, 2, 3] and not any(r["hosting"] for r in results)
    assert results[0]["stats"][0]["pushes"] == [6, 6, 6, 6]
    assert len({r["digest"] for r in results}) == 1


@pytest.mark.timeout(100)
def test_one_machine_is_summed_by_its_leader_and_the_servers_take_nothing(cluster):
    """One host holds the whole job: its leader's sums are the results (auto and on); off leaves
    every push to the servers, and every way gives the same bits."""
    auto = run(cluster, {}, {}, workers=3)
    assert [r["leader"] for r in auto] == [0, 0, 0] and all(r["hosting"] for r in auto)
    assert auto[0]["stats"][0]["pushes"] == [0, 0, 0], auto[0]["stats"]
    # "grad" (1.2 MB) is summed on the leader's summation threads; nobody else has any.
    assert [r["summation_threads"] for r in auto] == [True, False, False]
    forced = run(cluster, {"BPS_GOSSIP_HOST_REDUCE": "on"}, {}, workers=3)
    assert [r["leader"] for r in forced] == [0, 0, 0] and forced[0]["stats"][0]["pushes"] == [0, 0, 0]
    off = run(cluster, {"BPS_GOSSIP_HOST_REDUCE": "off"}, {}, workers=3)
    assert not any(r["hosting"] for r in off) and off[0]["stats"][0]["pushes"] == [6, 6, 6]
    assert all(r["small"] == 3 for r in auto + forced + off) and len({r["digest"] for r in auto + forced + off}) == 1


@pytest.mark.timeout(100)
def test_a_worker_without_shared_memory_turns_it_off_for_the_job(cluster):
    results = run(cluster, {"BPS_GOSSIP_HOST_REDUCE": "on"}, {**TWO_HOSTS, 3: {**TWO_HOSTS[3], "BPS_GOSSIP_SHM": "0"}})
    assert not any(r["hosting"] for r in results)
    assert results[0]["stats"][0]["pushes"] == [6, 6, 6, 6]


@pytest.mark.timeout(160)
@pytest.mark.parametrize("servers,env", [(1, {}), (2, {"BYTEPS_SCHEDULING_CREDIT": "1"})], ids=["1server", "2servers-credit1"])
def test_collectives_bit_exact_by_host(cluster, servers, env):
    """Every dtype, shape, output form, broadcast and asynchronous order of test_push_pull, with
    two hosts of two workers reducing by host."""
    job = cluster(4, servers, {**AUTO, **SMALL_PARTS, **env})
    done = job.run_job("push_pull_job", "collectives", timeout=140, per_rank_env=TWO_HOSTS)
    assert_all_ok(done, job)
    for f in done:
        assert f.result["checks"] > 900 and f.result["failures"] == [], (f.rank_hint, f.result["failures"])
    job.wait_servers_exit()


@pytest.mark.timeout(160)
def test_collectives_bit_exact_when_one_host_holds_the_job(cluster):
    """The same checks where the leader's sums are the results (no server takes a push)."""
    job = cluster(3, 1, {"BPS_GOSSIP_HOST_REDUCE": "on", **SMALL_PARTS})
    done = job.run_job("push_pull_job", "collectives", timeout=140)
    assert_all_ok(done, job)
    for f in done:
        assert f.result["checks"] > 900 and f.result["failures"] == [], (f.rank_hint, f.result["failures"])
    job.wait_servers_exit()


def on_two_hosts(cluster, scenario: str, *args: str) -> list:
    """Run host_reduce_job's ``scenario`` on 4 workers of two emulated hosts; every one must exit 0."""
    job = cluster(4, 1, AUTO)
    done = job.run_job("host_reduce_job", scenario, *args, timeout=80, per_rank_env=TWO_HOSTS)
    assert_all_ok(done, job)
    return done


@pytest.mark.timeout(100)
@pytest.mark.parametrize("leader_late", [False, True], ids=["leader-first", "local-first"])
def test_a_mismatch_inside_a_host_fails_every_rank(cluster, leader_late):
    done = on_two_hosts(cluster, "mismatch", str(leader_late))
    for f in done:
        error = f.result["error"]
        assert error is not None and "'bad'" in error and "(5,)" in error and "(6,)" in error, (f.rank_hint, error)


@pytest.mark.timeout(100)
def test_compressed_tensors_are_pushed_by_every_worker(cluster):
    done = on_two_hosts(cluster, "compressed_and_plain")
    values = {f.result["packed"] for f in done}
    assert len(values) == 1 and abs(values.pop() - 2.5) < 1e-5


@pytest.mark.timeout(150)
def test_a_dead_leader_is_replaced_and_training_stays_exact(cluster):
    """Elastic: host B's leader (rank 1 of A={0}, B={1,2,3}) is SIGKILLed mid-training; the
    survivors roll back, B's lowest surviving rank leads it, and the parameters stay exact."""
    import sys

    from test_elastic import ELASTIC_ENV, EPOCHS, JOB, SAMPLES, check_job

    job = cluster(4, env={**AUTO, **ELASTIC_ENV})
    procs = []
    for index in range(4):
        env = {**job.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index), "EPOCHS": str(EPOCHS),
               "SAMPLES": str(SAMPLES), "BATCH": "4", "KILL_RANK": "1", "KILL_STEP": "5",
               "DMLC_NODE_HOST": "127.0.0.1" if index == 0 else "127.0.0.2"}
        proc = job.spawn([sys.executable, str(JOB)], env, f"elastic{index}")
        proc.rank_hint = index
        procs.append(proc)
    done = job.wait(procs, timeout=120)
    killed = {f.rank_hint for f in done if f.returncode == -9}
    assert killed == {1}, job.dump()
    check_job(done, job, killed)
    places = {}
    for f in done:
        if f.rank_hint != 1:
            assert any(r[0] == "restored" for r in f.results), job.dump()
            final, host = (next(r for r in f.results if r[0] == kind) for kind in ("final", "host"))
            places[f.rank_hint] = (final[4], host[1], host[2])  # (new rank, hosting, leader)
    assert all(hosting for _, hosting, _ in places.values()), places
    new_rank = {hint: rank for hint, (rank, _, _) in places.items()}
    assert places[2][2] == places[3][2] == min(new_rank[2], new_rank[3]), places  # B's new leader
    assert places[0][2] == new_rank[0], places
    job.wait_servers_exit()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_gossip_goes_by_host_and_every_worker_of_a_host_holds_one_model(cluster, hybridize):
    """DistributedTrainer's default mode on two hosts of two, mobilenet0.25: exact within a host,
    one message per host pair between the leaders (tests/unit/test_gossip_hosts.py counts them)."""
    done = sorted(on_two_hosts(cluster, "gossip_by_host", str(hybridize)), key=lambda f: f.result["rank"])
    results = [f.result for f in done]
    assert all(r["averager"] == "HostAverager" and r["finite"] for r in results), results
    # Two hosts: each round the leaders swap halves, an exact average, so all four hold one model
    # (flat gossip leaves them apart: 3 of its 4 messages a round cross between the hosts).
    assert len({r["trained"] for r in results}) == 1
    assert all(r["distance"] == 0.0 for r in results)
    assert len({r["averaged"] for r in results}) == 1


@pytest.mark.timeout(120)
def test_gossip_stays_flat_without_host_reduce(cluster):
    job = cluster(4, 1, {"BPS_GOSSIP_HOST_REDUCE": "off"})
    done = job.run_job("host_reduce_job", "gossip_by_host", "False", timeout=80, per_rank_env=TWO_HOSTS)
    assert_all_ok(done, job)
    results = [f.result for f in sorted(done, key=lambda f: f.result["rank"])]
    assert all(r["averager"] == "GossipAverager" and r["finite"] for r in results), results
    assert len({r["trained"] for r in results}) > 1 and results[0]["distance"] > 0
    assert len({r["averaged"] for r in results}) == 1
