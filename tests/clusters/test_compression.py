"""Gradient compression against a numpy re-implementation written here, as BytePS's own
tests do: each compressor alone, then real push_pulls (worker: momentum, error feedback,
compress; server: decompress, sum, error feedback, compress; worker: decompress) equal to
the reference computed from every rank's gradients. The workers run tests/jobs/compression_job.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cluster import assert_all_ok

from bps_gossip.compat import zip_exact
from bps_gossip.compression import (
    CompressionSpec,
    PartitionState,
    codec_from_header,
    compress_on_worker,
    rng_for,
)
from bps_gossip.errors import ProtocolError

# -- the reference: what each compressor computes, written from BytePS's description ----------


def ref_onebit(x, scaling):
    scale = np.float32(np.abs(x).sum(dtype=np.float64) / x.size) if scaling else np.float32(1)
    return np.where(x < 0, -scale, scale).astype(np.float32)


def ref_topk(x, k):
    order = sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))[:k]
    out = np.zeros_like(x)
    out[order] = x[order]
    return out


def ref_randomk(x, k, rng):
    picked = rng.integers(0, x.size, k)
    out = np.zeros_like(x)
    out[picked] = x[picked]
    return out


def ref_dithering(x, s, natural, l2, rng):
    norm = math.sqrt(float(np.sum(np.abs(x).astype(np.float64) ** 2))) if l2 else float(np.abs(x).max())
    norm = float(np.float32(norm))
    if norm == 0:
        return np.zeros_like(x)
    top = 2 ** (s - 1) if natural else s
    draws = rng.random(x.size)
    out = np.zeros_like(x)
    for i, value in enumerate(x):
        u = abs(float(value)) / norm * top
        if natural:
            low = 0.0 if math.ceil(u) <= 1 else 2 ** math.ceil(math.log2(math.ceil(u))) / 2
            width = max(low, 1.0)
            level = low + width * (draws[i] < (u - low) / width)
        else:
            level = math.floor(u) + (draws[i] < u - math.floor(u))
        out[i] = math.copysign(min(level, top), -1.0 if value < 0 else 1.0) * np.float32(norm / np.float32(top))
    return out


def ref_compress(params, x, rng):
    kind = params["compressor"]
    if kind == "onebit":
        return ref_onebit(x, params.get("scaling", False))
    k = params["k"]
    kept = max(1, min(int(k * x.size) if k < 1 else int(k), x.size))
    if kind == "topk":
        return ref_topk(x, kept)
    if kind == "randomk":
        return ref_randomk(x, kept, rng)
    return ref_dithering(x, int(k), params.get("natural", False), params.get("l2", False), rng)


SPECS = [
    {"compressor": "onebit"},
    {"compressor": "onebit", "scaling": True},
    {"compressor": "onebit", "scaling": True, "ef": True},
    {"compressor": "topk", "k": 5},
    {"compressor": "topk", "k": 0.25, "ef": True},
    {"compressor": "randomk", "k": 7, "seed": 3},
    {"compressor": "randomk", "k": 0.5, "seed": 1, "ef": True, "momentum": 0.9},
    {"compressor": "dithering", "k": 4, "seed": 2},
    {"compressor": "dithering", "k": 3, "seed": 5, "natural": True, "l2": True, "ef": True},
    {"compressor": "topk", "k": 3, "momentum": 0.9},
]
IDS = ["-".join(f"{k}={v}" for k, v in spec.items()) for spec in SPECS]


def make_spec(params):
    return CompressionSpec(**params)


@pytest.mark.parametrize("params", SPECS, ids=IDS)
def test_each_compressor_matches_the_reference(params):
    spec = make_spec(params)
    rng = np.random.default_rng(0)
    for n in (1, 2, 33, 257):
        x = rng.normal(size=n).astype(np.float32)
        x[n // 2] = 0.0
        codec = spec.codec(n)
        data = codec.compress(x, rng_for(spec.seed or 9, 0, n, 0))
        assert data.dtype == np.uint8 and data.size == codec.nbytes
        expected = ref_compress(params, x, rng_for(spec.seed or 9, 0, n, 0))
        np.testing.assert_allclose(codec.decompress(data), expected, rtol=1e-6, atol=1e-7)


def test_compressed_sizes():
    n = 1 << 20
    assert make_spec({"compressor": "onebit"}).codec(n).nbytes == 4 + n // 8  # ~1/32 of float32
    assert make_spec({"compressor": "topk", "k": 0.01}).codec(n).nbytes == 8 * int(0.01 * n)
    assert make_spec({"compressor": "dithering", "k": 4}).codec(n).nbytes == 4 + n


def test_dithering_is_unbiased():
    x = np.linspace(-1, 1, 9).astype(np.float32)
    for natural in (False, True):
        codec = make_spec({"compressor": "dithering", "k": 2, "natural": natural}).codec(x.size)
        rng = np.random.default_rng(1)
        mean = np.mean([codec.decompress(codec.compress(x, rng)) for _ in range(4000)], axis=0)
        np.testing.assert_allclose(mean, x, atol=0.03)


@pytest.mark.parametrize("params,why", [
    ({"compressor": "fourbit"}, "not one of"), ({"compressor": "topk", "k": 0}, "positive"),
    ({"compressor": "dithering", "k": 2.5}, "integer"), ({"compressor": "topk", "momentum": 1.5}, "momentum"),
    ({"compressor": "randomk", "seed": -1}, "seed")])
def test_bad_settings_are_clear_errors(params, why):
    with pytest.raises(ValueError, match=why):
        make_spec(params)


@pytest.mark.parametrize("header,count", [
    ({"name": "onebit", "n": 10, "k": 0, "scaling": True, "ef": False, "seed": None, "natural": False, "l2": False}, 99),
    ({"name": "topk", "n": 10, "k": 11, "scaling": False, "ef": False, "seed": None, "natural": False, "l2": False}, 88),
    ({"name": "dithering", "n": 1 << 40, "k": 2, "scaling": False, "ef": False, "seed": None, "natural": False,
      "l2": False}, 10),
    ({"name": "zip", "n": 1, "k": 1}, 8), ({"name": "topk", "n": 1.5}, 8), ("topk", 8)])
def test_server_rejects_bad_codec_headers(header, count):
    with pytest.raises(ProtocolError):
        codec_from_header({"codec": header}, count)


# -- real push_pulls ----------------------------------------------------------------------------

STEPS = 4
SIZE = 40000  # float32: 160 KB, above BYTEPS_MIN_COMPRESS_BYTES; 3 partitions of 64 KB
PARTITION_BYTES = 65536


def gradients(rank, step):
    return np.random.default_rng([rank, step]).normal(size=SIZE).astype(np.float32)


def reference_run(params, workers):
    """What every rank must get at each step, from the reference compressors."""
    ef, mu, seed = params.get("ef", False), params.get("momentum"), params.get("seed")
    chunk = PARTITION_BYTES // 4
    bounds = [(start, min(start + chunk, SIZE)) for start in range(0, SIZE, chunk)]
    momentum = {(r, p): np.zeros(b - a, np.float32) for r in range(workers) for p, (a, b) in enumerate(bounds)}
    error = {key: np.zeros_like(value) for key, value in momentum.items()}
    server_error = {p: np.zeros(b - a, np.float32) for p, (a, b) in enumerate(bounds)}
    results = []
    for step in range(STEPS):
        out = np.zeros(SIZE, np.float32)
        for p, (a, b) in enumerate(bounds):
            total = np.zeros(b - a, np.float32)
            for r in range(workers):
                g = gradients(r, step)[a:b].copy()
                if mu is not None:
                    momentum[r, p] = np.float32(mu) * momentum[r, p] + g
                    g = g + np.float32(mu) * momentum[r, p]
                if ef:
                    g = g + error[r, p]
                sent = ref_compress(params, g, rng_for(seed, p, step, 0))
                if ef:
                    error[r, p] = g - sent
                total += sent
            if ef:
                total = total + server_error[p]
            merged = ref_compress(params, total, rng_for(seed, p, step, 1))
            if ef:
                server_error[p] = total - merged
            out[a:b] = merged
        results.append(out)
    return results


@pytest.mark.timeout(120)
def test_compressed_push_pull_equals_the_reference(cluster):
    specs = [spec for spec in SPECS if spec["compressor"] != "randomk" or "seed" in spec]
    job = cluster(2, 2, {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES)})
    done = job.run_job("compression_job", "compressed_push_pull", json.dumps(specs), STEPS, SIZE, timeout=100)
    assert_all_ok(done, job)
    first, second = (f.result for f in done)
    assert json.dumps(first) == json.dumps(second)  # every rank gets the same bytes
    assert first["small"] == [1.0] * 10  # below BYTEPS_MIN_COMPRESS_BYTES: exact
    for params, rounds in zip_exact(specs, first["rounds"]):
        for step, (got, expected) in enumerate(zip_exact(rounds, reference_run(params, 2))):
            np.testing.assert_allclose(np.array(got, np.float32), expected, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{params} step {step}")


def test_worker_state_carries_error_and_momentum():
    spec = make_spec({"compressor": "topk", "k": 1, "ef": True, "momentum": 0.5})
    state = PartitionState()
    codec = spec.codec(3)
    first = codec.decompress(compress_on_worker(spec, codec, np.array([1, 2, 3], np.float32), state, None))
    # momentum: m = g; g' = g + 0.5 m = 1.5 g -> [1.5, 3, 4.5]; topk keeps 4.5; the rest is the error
    np.testing.assert_allclose(first, [0, 0, 4.5])
    np.testing.assert_allclose(state.error, [1.5, 3, 0])
    np.testing.assert_allclose(state.momentum, [1, 2, 3])


@pytest.mark.timeout(90)
def test_byteps_trace_file(cluster, tmp_path):
    job = cluster(2, 1, {"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "2", "BYTEPS_TRACE_END_STEP": "4",
                         "BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES)})
    trace_dirs = {rank: {"BYTEPS_TRACE_DIR": str(tmp_path / f"rank{rank}")} for rank in range(2)}
    done = job.run_job("compression_job", "trace_push_pulls", per_rank_env=trace_dirs, timeout=60)
    assert_all_ok(done, job)
    for rank in range(2):
        trace = json.loads((tmp_path / f"rank{rank}" / "0" / "comm.json").read_text())
        events = trace["traceEvents"]
        assert trace["displayTimeUnit"] == "ms" and all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
        by_stage = {}
        for e in events:
            stage = "total" if e["name"] == e["pid"] else e["name"][len(e["pid"]) + 1:]
            by_stage.setdefault((e["pid"], stage), []).append(e)
        assert len(by_stage["Comm.small", "total"]) == 3  # steps 2, 3 and 4
        assert len(by_stage["Comm.big", "total"]) == 3
        assert len(by_stage["Comm.big", "COMPRESS"]) == 3 * 3  # 3 partitions of 64 KB
        assert len(by_stage["Comm.big", "PUSH_PULL"]) == 9 and len(by_stage["Comm.big", "DECOMPRESS"]) == 3
        assert len(by_stage["Comm.small", "QUEUE"]) == 3 and ("Comm.small", "COMPRESS") not in by_stage
        for total in by_stage["Comm.big", "total"]:
            inside = [e for e in by_stage["Comm.big", "PUSH_PULL"] if total["ts"] <= e["ts"] <= total["ts"] + total["dur"]]
            assert len(inside) == 3


@pytest.mark.timeout(90)
def test_byteps_trace_file_has_gossip_rounds(cluster, tmp_path):
    """Issue 23, item 14: BYTEPS_TRACE_ON in DistributedTrainer's default (gossip) mode wrote
    nothing. Gossip rounds are traced like push_pulls: a total per round, with SEND and MIX
    inside it (compressed gossip: the total only)."""
    job = cluster(2, 1, {"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "2", "BYTEPS_TRACE_END_STEP": "4"})
    trace_dirs = {rank: {"BYTEPS_TRACE_DIR": str(tmp_path / f"rank{rank}")} for rank in range(2)}
    done = job.run_job("compression_job", "trace_gossip", per_rank_env=trace_dirs, timeout=60)
    assert_all_ok(done, job)
    for rank in range(2):
        events = json.loads((tmp_path / f"rank{rank}" / "0" / "comm.json").read_text())["traceEvents"]
        stages = [e["name"] for e in events if e["pid"] == "Comm.gossip.trainer"]
        assert stages.count("Comm.gossip.trainer") == 3, stages  # rounds 2, 3 and 4
        assert stages.count("Comm.gossip.trainer.SEND") == 3 and stages.count("Comm.gossip.trainer.MIX") == 3
        totals = [e for e in events if e["name"] == "Comm.gossip.trainer"]
        for stage in (e for e in events if e["name"].endswith((".SEND", ".MIX"))):
            assert any(t["ts"] <= stage["ts"] <= t["ts"] + t["dur"] for t in totals)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("params", [{"compressor": "topk", "k": 0.1}, {"compressor": "onebit", "scaling": True},
                                    {"compressor": "dithering", "k": 4, "seed": 1}], ids=["topk", "onebit", "dithering"])
def test_compressed_gossip_keeps_the_sum_and_reaches_consensus(cluster, params):
    """CHOCO on a ring of 3: without local updates the sum over ranks never changes and the
    models converge to the average of the starting points."""
    job = cluster(3, 1)
    done = job.run_job("compression_job", "choco", json.dumps(params), timeout=100)
    assert_all_ok(done, job)
    for f in done:
        result = f.result
        for total in result["sums"]:
            np.testing.assert_allclose(total, result["initial"], atol=1e-3)
        # the ranks start about 0.8 apart (RMS); onebit's single scale per buffer leaves a small floor
        assert result["distances"][-1] < (0.1 if params["compressor"] == "onebit" else 0.01), result
