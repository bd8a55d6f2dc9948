"""Placement (bps_gossip/placement.py): the plan as a pure function of (cores, workers, the user's
settings, the options), and what real processes get: bpslaunch -np's workers, scheduler and server,
and workers started another way that plan for themselves in bps.init()."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cluster import FAST_ENV, JOBS, assert_all_ok

from bps_gossip import placement
from bps_gossip.config import load_config
from bps_gossip.errors import ConfigError
from bps_gossip.launch.sessions import kill_groups
from bps_gossip.openmp_settings import TEAM_SPIN_COUNT
from bps_gossip.placement import Options, format_cpus, plan

LAUNCH = [sys.executable, "-m", "bps_gossip.launch"]
CPUS = sorted(os.sched_getaffinity(0))


def cores(n: int) -> list[int]:
    return list(range(n))


# -- the plan, a pure function -------------------------------------------------------------
def test_this_machine_two_workers_on_two_cores_reserve_nothing():
    """The default must not slow a 2-core machine: nothing reserved or pinned, one thread each."""
    placed = plan(cores(2), 2, {})
    assert not placed.pinned and placed.comm == () and placed.compute == ((), ())
    assert dict(placed.env) == {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    assert "nothing reserved: 2 core(s) for 2 worker(s) is fewer than 5 per worker" in placed.describe(0)


def test_a_worker_alone_on_a_small_host_leaves_communication_a_core():
    """As MXNet's own default (half the CPUs), not every core: its server and engine need one."""
    placed = plan(cores(2), 1, {})
    assert not placed.pinned and placed.env["OMP_NUM_THREADS"] == "1"
    assert plan(cores(4), 1, {}).threads == 2


def test_outnumbering_threads_sleep_when_idle():
    """2 workers x 2 threads on 2 cores: spinning OpenMP threads starve the other team."""
    placed = plan(cores(2), 2, {"OMP_NUM_THREADS": "2"})
    assert placed.env["OMP_WAIT_POLICY"] == "PASSIVE" and "idle ones sleep" in placed.describe(0)
    placed = plan(cores(2), 2, {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"})
    assert "OMP_WAIT_POLICY" not in placed.env and "the user's OMP_WAIT_POLICY=active kept" in placed.describe(0)
    assert "OMP_WAIT_POLICY" not in plan(cores(2), 4, {"OMP_NUM_THREADS": "1"}).env  # no team, nothing spins


def test_a_team_that_has_its_cores_spins_longer_before_sleeping():
    """Issue 47: libgomp's idle threads sleep after 300000 spins, and waking them between MXNet's
    small parallel regions cost one worker x 2 threads on 2 cores 1.1-1.5x; ACTIVE (spinning
    forever) made idle OpenMP processes beside a worker take its cores. A bounded spin where each
    team has its cores; nothing where there is no team; the user's settings win."""
    for ncores, workers in ((4, 1), (16, 2), (16, 8), (64, 8)):
        placed = plan(cores(ncores), workers, {})
        assert placed.threads >= 2 and placed.env["GOMP_SPINCOUNT"] == TEAM_SPIN_COUNT, (ncores, workers)
        assert "OMP_WAIT_POLICY" not in placed.env and "spin a few ms before sleeping" in placed.describe(0)
    placed = plan(cores(2), 1, {"OMP_NUM_THREADS": "2"})  # the layout measured: one worker on both cores
    assert placed.env["GOMP_SPINCOUNT"] == TEAM_SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in plan(cores(2), 2, {}).env  # one thread each: no team to keep awake
    for mine in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        placed = plan(cores(16), 2, mine)
        assert "GOMP_SPINCOUNT" not in placed.env and "OMP_WAIT_POLICY" not in placed.env
        assert f"the user's {next(iter(mine))}={next(iter(mine.values()))} kept" in placed.describe(0)


def test_sixteen_cores_two_workers_every_core_computes():
    placed = plan(cores(16), 2, {})
    assert placed.pinned
    assert placed.compute == (tuple(range(0, 7)), tuple(range(7, 14)))
    assert placed.comm == (14, 15)
    assert placed.env["OMP_NUM_THREADS"] == "7"
    assert "local rank 1 computes on cpus 7-13" in placed.describe(1)
    assert "on cpus 14-15" in placed.summary()


@pytest.mark.parametrize("ncores", [1, 2, 3, 4, 8, 10, 16, 24, 64])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_shares_are_equal_disjoint_and_inside_the_cores(ncores, workers):
    placed = plan(cores(ncores), workers, {})
    reserving = ncores >= workers * (placement.MIN_COMPUTE_CORES + 1)
    assert placed.pinned == reserving
    assert "OMP_WAIT_POLICY" not in placed.env, "our own thread counts never outnumber the cores"
    assert ("GOMP_SPINCOUNT" in placed.env) == (placed.threads >= 2), "a team on its cores spins longer"
    if not reserving:  # each its share, never more than MXNet's own default (half the CPUs)
        assert placed.comm == () and placed.threads == max(1, min(ncores // workers, ncores // 2))
        return
    shares = [set(share) for share in placed.compute]
    assert len({len(share) for share in shares}) == 1, "every worker computes on as many cores"
    assert len(shares[0]) >= placement.MIN_COMPUTE_CORES and placed.threads == len(shares[0])
    everything = set().union(*shares, placed.comm)
    assert everything == set(range(ncores)), "no core left idle"
    assert sum(map(len, shares)) + len(placed.comm) == ncores, "no core given twice"
    assert len(placed.comm) >= workers  # one a worker, plus what an even split leaves over


def test_sixty_four_cores_eight_workers():
    placed = plan(cores(64), 8, {})
    assert placed.compute[7] == tuple(range(49, 56)) and placed.comm == tuple(range(56, 64))
    assert placed.threads == 7


def test_many_workers_on_few_cores_share_without_pinning():
    placed = plan(cores(16), 8, {})
    assert not placed.pinned and placed.env["OMP_NUM_THREADS"] == "2"
    placed = plan(cores(2), 8, {})
    assert not placed.pinned and placed.env["OMP_NUM_THREADS"] == "1"


def test_the_users_thread_counts_win():
    placed = plan(cores(16), 2, {"OMP_NUM_THREADS": "8"})
    assert "OMP_NUM_THREADS" not in placed.env and placed.threads == 8
    assert not placed.pinned, "8 x 2 threads fill 16 cores: nothing left to reserve"
    assert "the user's OMP_NUM_THREADS=8 kept" in placed.describe(0)
    placed = plan(cores(16), 2, {"OMP_NUM_THREADS": "2"})  # cores to spare: reserved, the user's 2 threads each
    assert placed.pinned and placed.threads == 2 and "OMP_NUM_THREADS" not in placed.env
    assert not plan(cores(2), 1, {"OMP_NUM_THREADS": "1"}).pinned, "small hosts are never pinned by default"
    placed = plan(cores(16), 2, {"MXNET_CPU_WORKER_NTHREADS": "2"})  # two operators at once: half the threads
    assert placed.env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": TEAM_SPIN_COUNT}
    placed = plan(cores(16), 2, {"OMP_NUM_THREADS": "lots"})  # not ours to fix: kept, planned as if unset
    assert "OMP_NUM_THREADS" not in placed.env and placed.pinned
    assert "OMP_NUM_THREADS=lots kept (not a positive number: planned as if unset)" in placed.describe(0)


def test_the_users_affinity_is_where_the_plan_places():
    """taskset -c 4-11 bpslaunch ...: only those CPUs are used, and the log says why."""
    placed = plan(list(range(4, 12)), 1, {}, machine_cpus=16)
    assert placed.compute == ((4, 5, 6, 7, 8, 9, 10),) and placed.comm == (11,)
    assert "within the 8 of 16 CPUs this job may use (cpus 4-11" in placed.describe(0)


def test_the_option_chooses_the_reservation():
    placed = plan(cores(64), 2, {}, Options(comm_cores=0))
    assert not placed.pinned and placed.env["OMP_NUM_THREADS"] == "32"
    assert "BPS_GOSSIP_COMM_CORES=0 asked: nothing reserved" in placed.describe(0)
    placed = plan(cores(16), 2, {}, Options(comm_cores=4))
    assert placed.compute == (tuple(range(0, 6)), tuple(range(6, 12))) and placed.comm == (12, 13, 14, 15)
    placed = plan(cores(2), 2, {}, Options(comm_cores=1))  # forced where the default reserves nothing
    assert placed.compute == ((0,), (0,)) and placed.comm == (1,) and placed.threads == 1
    assert "2 workers share 1 compute core(s)" in placed.describe(0)


def test_affinity_off_keeps_the_thread_counts():
    placed = plan(cores(16), 2, {}, Options(affinity=False))
    assert not placed.pinned and placed.compute == ((), ()) and placed.env["OMP_NUM_THREADS"] == "7"
    assert "--no-affinity" in placed.describe(0)


def test_hyperthreads_of_one_core_count_once():
    siblings = {cpu: cpu % 8 for cpu in range(16)}  # cpu i and i + 8 share a core, as Linux numbers them
    placed = plan(cores(16), 1, {}, siblings=siblings)
    assert placed.cores == 8 and placed.threads == 7
    assert placed.comm == (7, 15) and placed.compute == (tuple(range(0, 7)) + tuple(range(8, 15)),)


def test_a_cpu_quota_limits_threads_and_pins_nothing():
    placed = plan(cores(64), 2, {}, quota=4)
    assert not placed.pinned and placed.env["OMP_NUM_THREADS"] == "2"
    assert "CPU quota of 4 core(s)" in placed.describe(0)


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "two"])
def test_bad_comm_cores_is_a_clear_error(value):
    with pytest.raises(ConfigError, match=r"BPS_GOSSIP_COMM_CORES=.* \(bpslaunch --comm-cores\) must be 'auto'"):
        load_config({"BPS_GOSSIP_COMM_CORES": value})


def test_comm_cores_that_leave_nothing_to_compute_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"BPS_GOSSIP_COMM_CORES=2 \(bpslaunch --comm-cores\) leaves no core"):
        plan(cores(2), 2, {}, Options(comm_cores=2))


def test_options_parse():
    assert placement.options({}) == Options()
    assert placement.options({"BPS_GOSSIP_COMM_CORES": " AUTO "}) == Options()
    assert placement.options({"BPS_GOSSIP_COMM_CORES": "3", "BPS_GOSSIP_AFFINITY": "off"}) == Options(3, False)
    with pytest.raises(ConfigError, match="BPS_GOSSIP_AFFINITY='maybe' is not a boolean"):
        load_config({"BPS_GOSSIP_AFFINITY": "maybe"})


def test_the_launchers_record_round_trips():
    placed = plan(cores(16), 2, {})
    env = placement.worker_env(placed, 1)
    assert env["OMP_NUM_THREADS"] == "7" and placement.start_cpus(env) == frozenset(range(7, 14))
    assert placement.start_cpus(placement.service_env(placed)) == frozenset({14, 15})
    assert placement.start_cpus(placement.worker_env(plan(cores(2), 2, {}), 0)) is None
    with pytest.raises(ConfigError, match="BPS_GOSSIP_PLACED="):
        placement.start_cpus({"BPS_GOSSIP_PLACED": '{"cpus": "all"}'})
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert placement.parse_cpus("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]


# -- real processes --------------------------------------------------------------------------
PROBE = [sys.executable, str(JOBS / "placement_job.py"), "probe"]  # prints PROBE {json}: what one worker sees


def launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 60,
           taskset: int | None = None):
    """Run bpslaunch with ``args`` and PROBE (on CPU ``taskset`` only, as the user's affinity);
    return (exit code, {local rank: probe}, its output)."""
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL", "OMP_",
                                                                            "MXNET_CPU", "BPS_GOSSIP_"))},
                **FAST_ENV, "BYTEPS_LOG_LEVEL": "INFO", **(env or {})}
    proc = subprocess.Popen(LAUNCH + args + PROBE, env=full_env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=None if taskset is None else lambda: os.sched_setaffinity(0, {taskset}))
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_groups([proc])
    probes = {}
    for line in out.splitlines():
        if " PROBE " in line:
            found = json.loads(line.split(" PROBE ", 1)[1])
            probes[found["local_rank"]] = found
    return proc.returncode, probes, out + err


@pytest.mark.timeout(90)
@pytest.mark.skipif(len(CPUS) < 2, reason="a reservation needs 2 CPUs")
def test_bpslaunch_places_workers_servers_and_communication_threads():
    code, probes, output = launch(["-np", "2", "--comm-cores", "1"])
    assert code == 0, output
    expected = placement.plan_here(2, {}, Options(comm_cores=1))
    assert expected.pinned
    for rank in (0, 1):
        got = probes[rank]
        assert got["main"] == sorted(expected.compute[rank]), output  # compute: inherited by OpenMP's threads
        assert got["engine"] == got["zmq"] == sorted(expected.comm), output
        assert got["services"] == {"scheduler": sorted(expected.comm), "server": sorted(expected.comm)}, output
        assert got["omp"] == str(expected.threads) and got["mxnet"] == "1"
        assert f"placement: 2 worker(s) on {expected.cores} core(s): local rank {rank} computes on cpus" in output
    assert "bpslaunch: placement: communication (scheduler, servers" in output


@pytest.mark.timeout(90)
def test_bpslaunch_keeps_the_users_threads_and_says_so():
    code, probes, output = launch(["-np", "2"], {"OMP_NUM_THREADS": "3"})
    assert code == 0, output
    expected = placement.plan_here(2, {"OMP_NUM_THREADS": "3"}, Options())
    for rank in (0, 1):
        assert probes[rank]["omp"] == "3" and probes[rank]["mxnet"] == "1"
        assert probes[rank]["main"] == sorted(expected.compute[rank] or CPUS)
    assert output.count("the user's OMP_NUM_THREADS=3 kept") == 2, output


@pytest.mark.timeout(90)
@pytest.mark.skipif(len(CPUS) < 2, reason="needs a CPU to leave out")
def test_bpslaunch_keeps_the_users_affinity_and_says_so():
    """taskset -c C bpslaunch ...: every process stays on C."""
    code, probes, output = launch(["-np", "2"], taskset=CPUS[-1])
    assert code == 0, output
    for rank in (0, 1):
        assert probes[rank]["main"] == probes[rank]["engine"] == [CPUS[-1]], output
        assert probes[rank]["services"] == {"scheduler": [CPUS[-1]], "server": [CPUS[-1]]}
    assert output.count(f"within the 1 of {placement.host_cpus()[2]} CPUs this job may use (cpus {CPUS[-1]}: "
                        "the user's or batch system's affinity, kept)") == 2, output


@pytest.mark.timeout(90)
def test_no_affinity_pins_nothing():
    code, probes, output = launch(["-np", "2", "--comm-cores", "1", "--no-affinity"])
    assert code == 0, output
    for rank in (0, 1):
        assert probes[rank]["main"] == probes[rank]["engine"] == CPUS
        assert probes[rank]["services"] == {"scheduler": CPUS, "server": CPUS}
    assert "BPS_GOSSIP_AFFINITY=0 (bpslaunch --no-affinity): nothing pinned" in output
    assert "bpslaunch: placement:" not in output


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, env, message", [
    (["--comm-cores", "x"], {}, "BPS_GOSSIP_COMM_CORES='x' (bpslaunch --comm-cores) must be 'auto'"),
    (["--comm-cores", "-2"], {}, "BPS_GOSSIP_COMM_CORES='-2' (bpslaunch --comm-cores) must be 'auto'"),
    (["--comm-cores", str(len(CPUS))], {}, f"BPS_GOSSIP_COMM_CORES={len(CPUS)} (bpslaunch --comm-cores) leaves no core"),
    ([], {"BPS_GOSSIP_AFFINITY": "maybe"}, "BPS_GOSSIP_AFFINITY='maybe' is not a boolean"),
])
def test_bad_options_fail_at_start(args, env, message):
    code, probes, output = launch(["-np", "2", *args], env, timeout=20)
    assert code == 2 and not probes, output
    assert f"bpslaunch: {message}" in output


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(CPUS) < 2, reason="a reservation needs 2 CPUs")
def test_a_worker_started_another_way_places_itself(cluster):
    """Workers started without bpslaunch plan from the address book in bps.init(); one whose OpenMP
    runtime is loaded already (as mxnet loads it) reserves nothing, since its thread count is set."""
    usable, _, machine = placement.host_cpus()
    if len(usable) < machine:
        pytest.skip("this process's affinity is narrower than the machine's: a worker would keep it")
    job = cluster(2, env={"BPS_GOSSIP_COMM_CORES": "1", "BYTEPS_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": None})
    finished = job.run_job("placement_job", "place_myself")  # worker 1 loads libgomp before init()
    assert_all_ok(finished, job)
    expected = placement.plan_here(2, {}, Options(comm_cores=1))
    placed, loaded = finished
    got = placed.result
    assert got["main"] == sorted(expected.compute[got["local_rank"]]) and got["engine"] == sorted(expected.comm)
    assert got["omp"] == str(expected.threads)
    assert loaded.result["main"] == loaded.result["engine"] == CPUS and loaded.result["omp"] is None
    assert "an OpenMP runtime loaded before init() chose its own thread count" in loaded.stderr
