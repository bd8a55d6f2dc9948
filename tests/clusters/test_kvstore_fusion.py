"""The 'bpsgossip' KVStore fuses a step's gradients (mxnet_plugin.kvstore_fusion).

gluon.Trainer(kvstore='bpsgossip') and Module(kvstore='bpsgossip') hand the store the whole
step: the servers must see fused tensors (few rounds, not one per gradient), and the
trained weights must be bit-identical to the same training with one pushpull per key,
on every rank, for a network of many small layers with BatchNorm, hybridized or not.
The workers run tests/jobs/kvstore_fusion_job.py.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank

from mxnet_plugin.kvstore_fusion import StepFusion


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hybrid", [False, True], ids=["imperative", "hybridized"])
def test_trainer_and_module_fuse_and_match_separate_pushpulls(cluster, hybrid):
    job = cluster(2, env={"BPS_GOSSIP_HOST_REDUCE": "off"})  # the servers count the rounds (on one host they take none)
    done = job.run_job("kvstore_fusion_job", "fuse_and_match", str(hybrid), timeout=140)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert all(not r["failures"] for r in results), [(r["rank"], r["failures"]) for r in results]
    for r in results:
        assert r["fused"] == r["separate"], "fusion changed the trained weights"
        # 3 steps of one round per trained gradient, were nothing fused (the servers' count
        # includes the start-up broadcasts of both runs, the same number for both)
        assert r["rounds_fused"] < r["rounds_separate"] - 2 * r["trained"], r
        assert r["module_rounds"] < 3 * r["trained"], r
    # gradients are summed, BatchNorm's running statistics stay each rank's own (as with dist_sync)
    assert len({r["fused_trained"] for r in results}) == 1 and len({r["module"] for r in results}) == 1
    job.wait_servers_exit()


def test_plan_cuts_by_size_dtype_and_devices():
    import mxnet as mx

    pushed = []
    fusion = StepFusion("kv_", lambda key, arrays, priority: pushed.append(key))
    small = [mx.nd.zeros((8,)), mx.nd.zeros((8,)), mx.nd.zeros((8,), dtype="float64"), mx.nd.zeros((8,))]
    big = mx.nd.zeros((1 << 17,))  # 512 KiB: alone
    calls = [(0, [small[0]], 0), (1, [small[1]], -1), (2, [small[2]], -2), (3, [big], -3), (4, [small[3]], -4),
             (5, [mx.nd.zeros((8,)), mx.nd.zeros((8,))], -5)]
    fusion.plan(calls)
    assert [(indices, name) for indices, name, _ in fusion.buckets] == [
        ([0, 1], "kv_fused_0_2"), ([2], "kv_fused_2_1"), ([4], "kv_fused_4_1"), ([5], "kv_fused_5_1")]
    assert fusion.alone == [3]
    assert fusion.buckets[0][2] == "fused [kv_0(8,), kv_1(8,)]"
