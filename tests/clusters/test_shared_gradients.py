"""Gradients in shared memory (mxnet_plugin.shared_gradients): gluon.Trainer with the 'bpsgossip'
KVStore and DistributedTrainer's allreduce mode move the trained gradients into the worker's
shared memory at their first step (the Module API when it sets up its optimizer), so push_pulls to a server on this host copy nothing in or out.
The weights are bit for bit those of MXNet's own gradient arrays (BPS_GOSSIP_SHM_GRADIENTS=0).
The workers run tests/jobs/shared_gradients_job.py."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

from bps_gossip.transport import shm


def _run(cluster, flag: str) -> list[dict]:
    job = cluster(2, env={"BPS_GOSSIP_SHM": "1", "BPS_GOSSIP_SHM_GRADIENTS": flag})
    done = job.run_job("shared_gradients_job", "three_ways", timeout=100)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}_{job.port}_*"))  # the buffers' names went with the job
    return [f.result for f in done]


@pytest.mark.timeout(240)
def test_gradients_in_shared_memory_are_sent_in_place_with_the_same_results(cluster):
    shared, copied = _run(cluster, "1"), _run(cluster, "0")
    for mode in ("allreduce", "kvstore", "module"):
        assert all(all(r[mode]["shared"]) and len(r[mode]["shared"]) == 6 for r in shared), shared
        assert not any(any(r[mode]["shared"]) for r in copied), copied
        # the same bits on every rank and with MXNet's own gradient arrays
        assert len({r[mode]["digest"] for r in shared + copied}) == 1, (mode, [r[mode]["digest"][:8] for r in shared + copied])
    assert all(r["staged"] == [] for r in shared), shared  # nothing copied into another segment
    assert all(r["staged"] for r in copied), copied


@pytest.mark.timeout(60)
def test_a_bad_switch_is_refused(cluster):
    job = cluster(1, env={"BPS_GOSSIP_SHM_GRADIENTS": "maybe"})
    done = job.run_job("shared_gradients_job", "bad_switch")
    assert_all_ok(done, job)
    assert "BPS_GOSSIP_SHM_GRADIENTS='maybe'" in done[0].result
