"""DistributedTrainer(mode='async') on real processes: with a straggler among 4 workers the others
do not wait for it and the model reaches allreduce's accuracy; the stored weights add every change;
bad pushes fail at once with a clear error. The workers run tests/jobs/async_job.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cluster import assert_all_ok, results_by_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import elastic_trials  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 200


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
def test_the_stored_weights_add_every_change(cluster):
    job = cluster(3, servers=2)
    done = job.run_job("async_job", "arithmetic")
    assert_all_ok(done, job)
    assert any(f.result["start"] == [10.0, 20.0] for f in done)  # the first init came from one rank's payload
    for result in results_by_rank(done):
        start, first = result["start"], result["first"]
        # a rank that came later got the stored weights, other ranks' changes in them (no waiting)
        assert start[1] - start[0] == 10.0 and 10.0 <= start[0] <= 22.0, result
        assert first[0] >= start[0] + result["rank"] + 1, result  # at least its own change, at once
        assert result["final"] == [10.0 + 2 * 6, 20.0 + 2 * 6], result  # every change of every rank


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
    committed once (elastic_trials.check)."""
    trial = elastic_trials.run_trial(elastic_trials.Trial("async", "KILL", 1, 4), timeout=180)
    assert trial.ok, f"{trial.describe()}\n{trial.output}"
    finals = [r for values in elastic_trials.results(trial.output).values() for r in values if r[0] == "final"]
    assert len(finals) == 2 and all(f[5] == 2 for f in finals), finals  # two workers finished, in a job of 2
