"""Checkpoints on every entry point (tests/jobs/checkpoints_job.py, docs/checkpoints.md): 2N steps
straight against N steps, a save on rank 0, a new job that loads (on every rank, or on rank 0 and
broadcasts) and N more steps. Both must give the same losses and weights on every rank: the
parameters, the optimizer's momentum and its update counters all came back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cluster import assert_all_ok, results_by_rank

N = 4


def _run(cluster, entry, phase, folder, load="every"):
    job = cluster(2, 1)
    done = job.run_job("checkpoints_job", "run", entry, phase, str(N), str(folder), load, timeout=150)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    return results_by_rank(done)


ENTRIES = ["kvstore", "module", "allreduce", "gossip"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("entry", ENTRIES)
def test_training_continues_from_a_checkpoint(cluster, tmp_path, entry):
    """One straight run and one saved run, then a restart per way of loading (on every rank; on
    rank 0 and broadcast): the straight run is the reference of both (one job less each)."""
    straight = _run(cluster, entry, "straight", tmp_path)
    _run(cluster, entry, "first", tmp_path)
    for load in ("every", "root"):
        _check(straight, _run(cluster, entry, "second", tmp_path, load), entry, load)


def _check(straight: list, resumed: list, entry: str, load: str) -> None:
    # Gossip keeps each rank's momentum its own: loaded from rank 0's file alone, rank 1 goes on
    # with rank 0's momentum, close to the straight run but not the same (the losses and the norm
    # of all weights within 5%). Every other case continues exactly.
    close = (entry, load) == ("gossip", "root")
    tolerance = {"rtol": 0.05, "atol": 1e-3} if close else {"rtol": 1e-5, "atol": 1e-6}
    for whole, second in zip(straight, resumed):
        assert len(whole["losses"]) == 2 * N and len(second["losses"]) == N
        np.testing.assert_allclose(second["losses"], whole["losses"][N:], **tolerance,
                                   err_msg=f"rank {whole['rank']}, loaded on {load}: losses after the restart")
        assert whole["weights"].keys() == second["weights"].keys()
        if close:  # the norm of all weights together
            norms = [np.linalg.norm([values[0] for values in run["weights"].values()]) for run in (second, whole)]
            np.testing.assert_allclose(*norms, **tolerance, err_msg=f"rank {whole['rank']}: weights' norm")
            continue
        for name, values in whole["weights"].items():
            np.testing.assert_allclose(second["weights"][name], values, **tolerance,
                                       err_msg=f"rank {whole['rank']}, loaded on {load}: {name} after the restart")


@pytest.mark.timeout(300)
def test_async_training_continues_from_the_servers_model(cluster, tmp_path):
    """docs/checkpoints.md's async recipe: barrier, flush (every rank takes the servers' weights),
    save on rank 0 (and each rank its own momentum). The order of asynchronous pushes differs
    from run to run, so no run is the reference of another: the new job's first loss on each rank
    must be the saved model's on that batch (it starts from the servers' model, not from a rank's
    own), and after its own barrier and flush every rank holds one model."""
    first = _run(cluster, "async", "first", tmp_path)
    assert len({json.dumps(r["weights"]) for r in first}) == 1, "the saved model is not every rank's"
    for load in ("every", "root"):
        second = _run(cluster, "async", "second", tmp_path, load)
        for before, after in zip(first, second):
            np.testing.assert_allclose(after["losses"][0], before["next_loss"], rtol=1e-5,
                                       err_msg=f"rank {before['rank']}, loaded on {load}: the first loss")
            assert np.isfinite(after["losses"]).all()
        assert len({json.dumps(r["weights"]) for r in second}) == 1, f"loaded on {load}: ranks end apart"
