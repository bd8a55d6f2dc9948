"""MXNet's gradient compression API (kv.set_gradient_compression, compression_params of gluon.Trainer
and Module) on the 'bpsgossip' store, on real processes; and what the store refuses, on every rank.
The workers run tests/jobs/mxnet_gradient_compression_job.py.

The strongest check runs the same push/pull job on MXNet's own dist_sync (its ps-lite scheduler and
server, 2 workers) and on ours: the pulled sums must be the same numbers, and those of MXNet's 2bit
formula computed here by hand (residual carried over three pushes).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from cluster import assert_all_ok, results_by_rank

STEPS, SIZES = 3, (37, 1000)


def by_hand(kind: str, threshold: float, workers: int = 2) -> list[list[np.ndarray]]:
    """MXNet's quantizers (gradient_compression-inl.h), one residual per worker and key: the sums pulled."""
    t = np.float32(threshold)
    residual = {}
    out = []
    for step in range(STEPS):
        sums = []
        for key, n in enumerate(SIZES):
            total = np.zeros(n, np.float32)
            for rank in range(workers):
                grad = _vectors(rank, step)[key]
                r = residual.get((rank, key), np.zeros(n, np.float32)) + grad
                if kind == "2bit":
                    sent = np.where(r >= t, t, np.where(r <= -t, -t, np.float32(0))).astype(np.float32)
                else:  # 1bit: above the threshold +1, else -1
                    sent = np.where(r > t, np.float32(1), np.float32(-1)).astype(np.float32)
                residual[rank, key] = (r - sent).astype(np.float32)
                total += sent
            sums.append(total)
        out.append(sums)
    return out


def _vectors(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step, 7])
    return [(rng.normal(size=n) * 0.4).astype(np.float32) for n in SIZES]


def run_mxnet_dist_sync(cluster, kind: str, threshold: float) -> list[dict]:
    """The kv job on MXNet's own parameter server (ps-lite scheduler and server from `import mxnet`)."""
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1", "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo"},
                  start_servers=False)
    for role in ("scheduler", "server"):
        job.spawn([sys.executable, "-c", "import mxnet"], {**job.env, "DMLC_ROLE": role}, f"mxnet_{role}")
    done = job.run_job("mxnet_gradient_compression_job", "kv", "dist_sync", kind, str(threshold), timeout=100)
    assert_all_ok(done, job)
    return results_by_rank(done)


@pytest.mark.timeout(150)
def test_2bit_sums_are_mxnet_dist_syncs(cluster):
    ours_job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = ours_job.run_job("mxnet_gradient_compression_job", "kv", "bpsgossip", "2bit", "0.5", timeout=100)
    assert_all_ok(done, ours_job)
    ours = results_by_rank(done)
    theirs = run_mxnet_dist_sync(cluster, "2bit", 0.5)
    expected = by_hand("2bit", 0.5)
    for rank in range(2):
        assert ours[rank]["pulled"] == theirs[rank]["pulled"], f"rank {rank}: ours and MXNet's dist_sync differ"
        for step in range(STEPS):
            for key in range(len(SIZES)):
                np.testing.assert_array_equal(np.array(ours[rank]["pulled"][step][key], np.float32),
                                              expected[step][key], err_msg=f"rank {rank} step {step} key {key}")
    # Not trivially zero or unquantized: every value is a multiple of the threshold and some are not 0.
    last = np.concatenate([np.array(v) for v in ours[0]["pulled"][-1]])
    assert set(np.unique(last)) <= {-1.0, -0.5, 0.0, 0.5, 1.0} and np.count_nonzero(last) > 100


@pytest.mark.timeout(150)
def test_1bit_is_mxnet_2s_formula_which_191_refuses(cluster):
    """MXNet 1.9.1 has no 1bit (its C++ refuses the type); ours follows MXNet 2.0's formula."""
    ours_job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = ours_job.run_job("mxnet_gradient_compression_job", "kv", "bpsgossip", "1bit", "0", timeout=100)
    assert_all_ok(done, ours_job)
    ours = results_by_rank(done)
    expected = by_hand("1bit", 0.0)
    for rank in range(2):
        for step in range(STEPS):
            for key in range(len(SIZES)):
                np.testing.assert_array_equal(np.array(ours[rank]["pulled"][step][key], np.float32),
                                              expected[step][key])
    theirs = run_mxnet_dist_sync(cluster, "1bit", 0.5)  # 1.9.1 refuses a threshold of 0 before the type
    assert all("Unknown type for gradient compression 1bit" in r["refused"] for r in theirs), theirs


@pytest.mark.timeout(120)
def test_gluon_trainer_with_2bit_compression_params(cluster):
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_job("mxnet_gradient_compression_job", "trainer", timeout=100)
    assert_all_ok(done, job)
    for result in results_by_rank(done):
        assert result["failures"] == [], result["failures"]
        assert result["store"] == "BpsGossip" and result["compression"] == "2bit threshold=0.05", result
        assert result["quantized"] > 50, result  # some gradients crossed the threshold
        # what the server received in a step: 2 bits a value from each worker, not float32
        assert result["step_bytes"] == [result["compressed"]] * 2, result
        assert result["compressed"] * 15 < result["float32"], result


@pytest.mark.timeout(120)
def test_distributed_trainer_takes_mxnets_dict(cluster):
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_job("mxnet_gradient_compression_job", "distributed", timeout=100)
    assert_all_ok(done, job)
    for result in results_by_rank(done):
        assert result["failures"] == [], result["failures"]
        assert result["mode"] == "allreduce" and result["quantized"] > 50, result


@pytest.mark.timeout(120)
def test_module_with_2bit_compression_params(cluster):
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_job("mxnet_gradient_compression_job", "module", timeout=100)
    assert_all_ok(done, job)
    for result in results_by_rank(done):
        assert result["failures"] == [], result["failures"]
        assert result["store"] == "BpsGossip" and result["compression"] == "2bit threshold=0.05", result
        assert result["quantized"] > 20, result


@pytest.mark.timeout(120)
def test_bad_settings_and_unsupported_features_fail_on_every_rank(cluster):
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_job("mxnet_gradient_compression_job", "errors", timeout=100)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["failures"] == [], result["failures"]
