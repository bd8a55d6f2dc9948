"""Gluon model-zoo CNNs through every mxnet_plugin entry point, on real processes.

Convolution weights hold oneDNN layouts after an inference forward (MXNet's CPU build);
tests/jobs/cnn_job.py runs one before every phase and between training steps. Allreduce
mode and the KVStore must give the parameters of one process training on every
rank's batch (BatchNorm's statistics are per batch, so the reference sums per-rank
gradients), broadcasts leave ranks bit-identical, gossip ranks stay finite and draw
together once the learning rate is 0; with compression_params, allreduce ranks stay identical
and compressed (CHOCO) gossip, each parameter compressed on its own, draws them together too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from cluster import assert_all_ok

JOB = Path(__file__).resolve().parents[1] / "jobs" / "cnn_job.py"
NETWORKS = ["resnet18_v1", "mobilenet0.25", "bn_dropout"]
TRAINING_PHASES = ["allreduce_overlap1", "allreduce_overlap0", "kvstore", "module"]


def run_job(cluster, network: str, hybridize: bool) -> dict[str, list[dict]]:
    """Run tests/jobs/cnn_job.py on 2 workers; return each phase's results by rank."""
    job = cluster(2)
    procs = []
    for index in range(2):
        env = {**job.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index), "OMP_NUM_THREADS": "1"}
        proc = job.spawn([sys.executable, str(JOB), network, str(int(hybridize))], env, f"cnn{index}")
        proc.rank_hint = index
        procs.append(proc)
    done = job.wait(procs, timeout=280)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    phases: dict[str, list[dict]] = {}
    for finished in sorted(done, key=lambda f: f.rank_hint):
        for result in finished.results:
            phases.setdefault(result["phase"], []).append(result)
    return phases


# resnet18_v1 (about 25 s a run on 2 cores) hybridized only: imperative runs on the other two
CASES = [(network, hybridize) for network in NETWORKS for hybridize in (False, True)
         if (network, hybridize) != ("resnet18_v1", False)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("network,hybridize", CASES,
                         ids=[f"{n}-{'hybridized' if h else 'imperative'}" for n, h in CASES])
def test_every_entry_point_trains_cnn(cluster, network, hybridize):
    phases = run_job(cluster, network, hybridize)

    broadcast = phases["broadcast"]
    assert broadcast[0]["before"] != broadcast[1]["before"], "ranks should start from different seeds"
    assert broadcast[0]["after"] == broadcast[1]["after"] == broadcast[0]["before"], "not root's values"

    for name in TRAINING_PHASES:
        results = phases[name]
        assert results[0]["digest"] == results[1]["digest"], f"{name}: ranks differ"
        assert not results[0]["mismatch"], f"{name} differs from one process's training: {results[0]['mismatch']}"
    assert all(r["finite"] for r in phases["allreduce_overlap1"])
    # in-engine push_pulls: the gradients were moved into shared memory and stayed there
    assert all(r["shared"] for r in phases["allreduce_overlap1"] + phases["kvstore"])
    assert not any(r["shared"] for r in phases["allreduce_overlap0"])

    gossip = phases["gossip"]
    for r in gossip:
        assert r["finite"]
        assert all(np.isfinite(r["distances"]))
        assert r["distances"][-1] < r["distances"][0], r["distances"]
    assert gossip[0]["distances"] == gossip[1]["distances"]  # a collective: one value
    assert gossip[0]["averaged"] == gossip[1]["averaged"], "average_parameters() left ranks apart"
    assert all(r["statistics_moved"] for r in gossip), "BatchNorm's running statistics never moved"

    compressed = phases["compressed_allreduce"]
    assert compressed[0]["digest"] == compressed[1]["digest"], "compressed allreduce left ranks apart"
    assert all(r["finite"] for r in compressed)
    choco = phases["compressed_gossip"]
    for r in choco:
        assert r["mode"] == "gossip" and r["finite"] and all(np.isfinite(r["distances"]))
        # bounded, and falling by the end (the BatchNorm statistics first follow the noise, ~1.7x)
        assert max(r["distances"]) < 4 * r["distances"][0], f"compressed gossip diverged: {r['distances']}"
        assert r["distances"][-1] < max(r["distances"]), f"compressed gossip never drew together: {r['distances']}"
    assert choco[0]["averaged"] == choco[1]["averaged"], "average_parameters() left ranks apart"

    state = phases["elastic_state"]
    assert state[0]["synced"] == state[1]["synced"], "GluonState.sync() left ranks apart"
    for r in state:
        assert r["restored"] == r["synced"], "restore() did not return to the commit"
        assert r["epoch"] == 0 and r["finite"]
