"""DistributedTrainer(mode='async') on real processes: with a straggler among 4 workers the others
do not wait for it and the model reaches allreduce's accuracy; the stored weights add every change;
bad pushes fail at once with a clear error. The workers run tests/jobs/async_job.py."""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import pytest
from cluster import assert_all_ok, results_by_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import elastic_trials  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 400


@pytest.mark.timeout(300)
def test_a_straggler_does_not_hold_back_the_others_and_accuracy_matches_allreduce(cluster, tmp_path):
    job = cluster(4)
    folder = tmp_path / "progress"
    folder.mkdir()
    done = job.run_job("async_job", "straggler", str(EXAMPLES), str(folder), str(STEPS), timeout=280)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    fast, slow = results[:3], results[3]
    for result in fast:
        ran = result["async"]
        assert ran["mode"] == "async" and ran["steps"] == STEPS, ran
        # when this rank finished, the straggler (0.2 s a step) was far behind: nobody waited for it
        assert ran["others_at_finish"][3] < STEPS // 2, ran
    assert slow["async"]["steps"] < STEPS // 2, slow
    digests = {result["async"]["digest"] for result in results}
    assert len(digests) == 1, digests  # after a barrier and flush() every rank holds the stored weights
    accuracy, reference = results[0]["async"]["accuracy"], results[0]["allreduce"]["accuracy"]
    assert reference > 0.85, results[0]
    assert accuracy >= reference - 0.015, results[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"])  # the payload and the reply in the worker's segment, or as frames
def test_the_stored_weights_add_every_change(cluster, shm):
    job = cluster(3, servers=2, env={"BPS_GOSSIP_SHM": shm, "BYTEPS_PARTITION_BYTES": "4096"})
    done = job.run_job("async_job", "arithmetic")
    assert_all_ok(done, job)
    results = results_by_rank(done)
    final = results[0]["final"]
    # after a barrier: every change of every rank (2 x (1 + 2 + 3)) in every partition, on the init payload
    # of whichever rank reached that partition's server first (each rank's init adds rank * 0.5)
    offsets = {value - base for (low, high), base in zip(final, (22.0, 32.0)) for value in (low, high)}
    assert offsets <= {0.0, 0.5, 1.0}, results
    for result in results:
        assert result["final"] == final, results
        (low, high), _ = result["start"]
        # a rank that came later got the stored weights, other ranks' changes in them (no waiting)
        assert 10.0 <= low <= high <= 23.0, result
        assert result["first"][0][0] >= low + result["rank"] + 1, result  # at least its own change, at once


@pytest.mark.timeout(120)
def test_bad_pushes_fail_at_once_and_change_nothing(cluster):
    job = cluster(2)
    done = job.run_job("async_job", "bad_pushes")
    assert_all_ok(done, job)
    first, second = results_by_rank(done)
    mismatch = second["mismatch"]
    assert "tensor 'w'" in mismatch and "does not match the stored weights" in mismatch and "(3,)" in mismatch, mismatch
    assert "rank 1" in mismatch
    op, kind, why = first["stranger"]
    assert [op, kind] == ["error", "protocol"] and "no worker of generation" in why, first
    assert first["final"] == second["final"] == [1.0] * 4


@pytest.mark.timeout(200)
def test_elastic_async_survives_a_killed_worker():
    """bpslaunch -np 3 --min-np 2, mode='async' (tests/jobs/gluon_elastic_job.py): rank 1 is SIGKILLed
    at step 4; the other two reset, take the servers' weights and finish every epoch, every sample
    committed once (elastic_trials.check); bpslaunch's replacement may join and train too."""
    trial = elastic_trials.run_trial(elastic_trials.Trial("async", "KILL", 1, 4), timeout=180)
    assert trial.ok, f"{trial.describe()}\n{trial.output}"
    finals = [r for values in elastic_trials.results(trial.output).values() for r in values if r[0] == "final"]
    # the survivors finish, in a job of 2, or of 3 where bpslaunch's replacement joined in time
    assert len(finals) >= 2 and len({f[5] for f in finals}) == 1 and finals[0][5] == len(finals), finals


def _wait_for_commit(proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.out_file.flush()
        if '"commit"' in Path(proc.out_file.name).read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no commit within {timeout} s")


@pytest.mark.timeout(150)
def test_a_worker_joining_an_async_job_takes_the_stored_weights_and_trains(cluster):
    """An elastic job of 2 in mode='async' (tests/jobs/gluon_elastic_job.py); a third worker joins at a
    commit, takes the servers' weights and trains; every sample of every epoch is committed once."""
    job = cluster(2, env={"BPS_GOSSIP_ELASTIC": "1", "BPS_GOSSIP_MIN_WORKERS": "1",
                          "BPS_GOSSIP_ELASTIC_TIMEOUT": "20"})
    settings = {"MODE": "async", "EPOCHS": "2", "SAMPLES": "96", "BATCH": "4", "COMMIT_EVERY": "3",
                "STEP_SLEEP": "0.3", "DMLC_ROLE": "worker"}  # the joiner (importing MXNet) arrives before the end
    argv = [sys.executable, str(elastic_trials.JOB)]
    first = [job.spawn(argv, {**job.env, **settings, "DMLC_WORKER_ID": str(index)}, f"async_elastic{index}")
             for index in range(2)]
    _wait_for_commit(first[0])
    joiner = job.spawn(argv, {**job.env, **settings}, "async_elastic_joiner")
    done = job.wait(first + [joiner], timeout=120)
    assert all(f.returncode == 0 for f in done), job.dump()
    finals = [next(r for r in f.results if r[0] == "final") for f in done]
    assert all(final[5] == 3 for final in finals), finals  # every rank ended in a job of 3
    assert any(r[0] == "commit" for r in done[2].results), f"the joiner never trained: {done[2].results}\n{job.dump()[-3000:]}"
    seen = collections.Counter((e, i) for f in done for r in f.results if r[0] == "commit" for e, i in r[1])
    assert seen == collections.Counter((e, i) for e in range(2) for i in range(96)), seen
