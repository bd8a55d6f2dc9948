"""Training through mxnet_plugin on real processes: every rank trains on different data,
and every rank must end with exactly the same weights, equal (to float tolerance) to one
process training on the concatenated batches. Covers DistributedTrainer in allreduce
mode, DistributedOptimizer under the Module API and gluon.Trainer with
kvstore='bpsgossip'. The workers run tests/jobs/mxnet_training_job.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from cluster import assert_all_ok, results_by_rank

from bps_gossip.compat import zip_exact


def assert_same_training(results: list[dict], key: str = "final") -> None:
    """Every rank holds bit-identical weights, close to the single-process reference."""
    assert len({r[key + "_digest"] for r in results}) == 1, f"ranks differ after training ({key})"
    reference = [np.array(w) for w in results[0]["reference"]]
    for r in results:
        for got, want in zip_exact(r[key], reference):
            np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [2, 4])
def test_distributed_trainer_allreduce_matches_one_process(cluster, workers):
    job = cluster(workers)
    done = job.run_job("mxnet_training_job", "allreduce", timeout=140)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert [r["rank"] for r in results] == list(range(workers))
    assert all(not r["failures"] for r in results), [r["failures"] for r in results]
    assert len({r["initial_digest"] for r in results}) == 1, "deferred parameters were not broadcast"
    assert_same_training(results)
    job.wait_servers_exit()


@pytest.mark.timeout(120)
def test_distributed_optimizer_module_api(cluster):
    job = cluster(2)
    done = job.run_job("mxnet_training_job", "module_api", timeout=110)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    assert results[0]["before_digest"] != results[1]["before_digest"]  # ranks really started apart
    assert len({r["initial_digest"] for r in results}) == 1
    assert results[0]["initial_digest"] == results[0]["before_digest"]  # root's values
    assert len({r["fp16_digest"] for r in results}) == 1
    assert_same_training(results)
    assert_same_training(results, "multi")
    job.wait_servers_exit()


@pytest.mark.timeout(120)
def test_gluon_trainer_with_bpsgossip_kvstore(cluster):
    job = cluster(2)
    done = job.run_job("mxnet_training_job", "kvstore", timeout=110)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    assert_same_training(results)
    for key in ("instance", "module"):
        for r in results:
            r["reference"] = r[key + "_reference"]
        assert_same_training(results, key)
    job.wait_servers_exit()
