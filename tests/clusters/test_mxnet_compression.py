"""DistributedTrainer with BytePS's compression_params on real processes.

Two workers train a small network (one weight above BYTEPS_MIN_COMPRESS_BYTES, the rest
below) for a few SGD steps; every rank also replays the whole job locally: every rank's
gradients from the same batches, divided by batch x workers, through momentum, error
feedback and the compressors (worker and server side) of bps_gossip.compression, which
tests/clusters/test_compression.py checks against a numpy re-implementation. The trained weights
must equal the replay and be identical on both ranks. The workers run
tests/jobs/mxnet_compression_job.py.
"""

from __future__ import annotations

import json

import pytest
from cluster import assert_all_ok

CASES = [
    {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True, "k": 1, "fp16": False},
    {"compressor": "topk", "ef": "vanilla", "momentum": "", "scaling": False, "k": 0.1, "fp16": False},
    {"compressor": "dithering", "ef": "", "momentum": "", "k": 4, "seed": 3, "partition": "natural",
     "normalize": "l2"},
    {"compressor": "randomk", "ef": "vanilla", "momentum": "nesterov", "k": 100, "seed": 7},
    {"compressor": "", "ef": "", "momentum": "", "scaling": False, "k": 1, "fp16": True},
    {"compressor": "", "ef": "", "momentum": "", "scaling": False, "k": 1, "fp16": False},  # BytePS's "none"
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("params", CASES, ids=[c["compressor"] or ("fp16" if c.get("fp16") else "none") for c in CASES])
def test_trainer_with_compression_params_equals_the_replay(cluster, params):
    # The compressor cases choose allreduce through BPS_GOSSIP_MODE (gossip would compress by CHOCO);
    # fp16 alone switches to allreduce with a warning; no compression stays in the default gossip mode.
    env = {"OMP_NUM_THREADS": "1", **({"BPS_GOSSIP_MODE": "allreduce"} if params["compressor"] else {})}
    job = cluster(2, 1, env)
    done = job.run_job("mxnet_compression_job", "replay", json.dumps(params), timeout=150)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["checksum"] == second["checksum"], (first, second)  # identical models
    compressing = bool(params["compressor"] or params.get("fp16"))
    assert first["mode"] == ("allreduce" if compressing else "gossip"), first
    assert any("allreduce" in w for w in first["warned"]) == bool(params.get("fp16") and not params["compressor"]), first
    if params["compressor"] or params.get("fp16"):
        assert first["diff"] < 1e-6 and first["off"] > 1e-5, first  # the replay, and not the exact run


@pytest.mark.timeout(120)
def test_gossip_mode_compresses_its_messages(cluster):
    """The default mode with a compressor: CHOCO gossip; the models stay close, the optimizer
    keeps its momentum (nesterov and ef apply to gradients only), and an exact average ends equal."""
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1"})
    done = job.run_job("mxnet_compression_job", "gossip", timeout=100)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["mode"] == "gossip" and first["momentum"] == 0.9, first
    assert first["last"] < first["first"] and 0 < first["distance"] < 0.05, first
    assert first["after"] < 1e-6 and abs(first["checksum"] - second["checksum"]) < 1e-3, (first, second)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [[], ["--compressor", "onebit", "--ef", "vanilla", "--compress-momentum", "nesterov",
                                       "--scaling"], ["--compressor", "topk", "--k", "100"]],
                         ids=["none", "onebit", "topk"])
def test_byteps_gc_example_calls(cluster, argv):
    """BytePS's compression example, as a user would run it with allreduce chosen from outside
    (BPS_GOSSIP_MODE, i.e. bpslaunch --mode allreduce): ranks end identical."""
    job = cluster(2, 1, {"OMP_NUM_THREADS": "1", "BPS_GOSSIP_MODE": "allreduce"})
    done = job.run_job("mxnet_compression_job", "gc_example", *argv, timeout=100)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert first["acc"] == second["acc"] == 3.0 and first["mode"] == "allreduce"
    assert first["checksum"] == second["checksum"], (first, second)
