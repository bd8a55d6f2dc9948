"""Communication overlapped with backward (mxnet_plugin.overlap), on real processes.

Every rank trains on different data; the overlapped path (push_pull inside MXNet's
engine) must give bit-identical weights to the non-overlapped one (host buffers, the
caller waits), on every rank, and both must match one process training on the
concatenated batches. Covers DistributedTrainer(mode='allreduce') and gluon.Trainer
with the 'bpsgossip' KVStore; then a shape mismatch inside the engine must surface on
every rank as an exception naming the tensor, within seconds. The workers run
tests/jobs/mxnet_overlap_job.py.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank
from test_mxnet_training import assert_same_training

pytestmark = pytest.mark.paths  # the newest Python of .ci/pythons runs these too


@pytest.mark.timeout(150)
def test_overlap_trains_to_the_same_weights(cluster):
    job = cluster(2)
    done = job.run_job("mxnet_overlap_job", "training", timeout=140)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    for kind in ("trainer", "kvstore"):
        for r in results:
            # bit-exact: the same sums in the same order, only the moment they run differs
            assert r[kind + "_digest"] == r[kind + "_plain_digest"], f"rank {r['rank']}: {kind} overlap differs"
            r["reference"] = r[kind + "_reference"]
        assert_same_training(results, kind)
    assert len({r["multi_digest"] for r in results}) == 1
    assert len({r["after_shutdown_digest"] for r in results}) == 1
    job.wait_servers_exit()


@pytest.mark.timeout(90)
def test_overlap_mismatch_raises_on_every_rank(cluster):
    job = cluster(2)
    done = job.run_job("mxnet_overlap_job", "mismatch", timeout=80)
    assert_all_ok(done, job)
    for r in (f.result for f in done):
        assert not r["failures"], r
        assert r["caught"], f"rank {r['rank']}: no exception from step()"
        step, kind, msg, seconds = r["caught"][0]
        assert kind == "TensorMismatchError", r["caught"]
        assert "mismatched_weight" in msg and "(3, 4)" in msg and "(4, 4)" in msg, msg
        assert step == 1, f"rank {r['rank']}: raised at step {step}, expected the step after the failure"
        assert seconds < 8, f"rank {r['rank']} waited {seconds:.1f} s"
        assert r["weight_kept"], "the weight was updated from the failed gradient"
    job.wait_servers_exit()
