"""scripts/bench_scale.py (issue 34, item 3): its presets are the Gluon models' real gradients,
what it pushes is what mxnet_plugin's fusion would push, the bound is the formula its docstring
and docs/performance-many-workers.md state, and one tiny run goes end to end (2 workers, 2 servers, planned placement, 1 step)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_scale  # noqa: E402

from bps_gossip.protocol.data import partitions  # noqa: E402


def test_presets_are_the_models_gradients():
    """Counted with MXNet 1.9.1 (classes=10): trained parameters and their total size."""
    resnet, mobilenet = bench_scale.PRESETS["resnet18_v1"], bench_scale.PRESETS["mobilenet0.25"]
    assert (len(resnet), sum(resnet)) == (62, 11_181_642)
    assert (len(mobilenet), sum(mobilenet)) == (83, 215_642)
    assert resnet[:4] == [9408, 64, 64, 36864] and resnet[-2:] == [5120, 10]
    assert bench_scale.PRESETS["4mib8"] == [131072] * 8  # 4 MiB of float32 in 8 tensors


@pytest.mark.parametrize("preset", sorted(bench_scale.PRESETS))
def test_fusion_pushes_every_gradient_once_as_the_plugin_would(preset):
    sizes = bench_scale.PRESETS[preset]
    pushed = bench_scale.pushed_tensors(sizes)
    assert sum(count for _, count, _ in pushed) == sum(sizes)
    assert len({name for name, _, _ in pushed}) == len(pushed)
    alone = [count for name, count, _ in pushed if name.startswith("grad")]
    assert sorted(alone) == sorted(s for s in sizes if 4 * s > bench_scale.SMALL_BYTES)
    for name, count, _ in pushed:
        if name.startswith("bucket"):  # cut once it holds BUCKET_BYTES: at most one gradient more
            assert 4 * count < bench_scale.BUCKET_BYTES + bench_scale.SMALL_BYTES
    unfused = bench_scale.pushed_tensors(sizes, fuse=False)
    assert [count for _, count, _ in unfused] == sizes[::-1]  # backward's order: the last layer first
    assert unfused[-1][2] == 0 and unfused[0][2] == -(len(sizes) - 1)  # the first layer: highest priority


def test_resnet18_pushes_13_gradients_alone_and_one_bucket():
    pushed = bench_scale.pushed_tensors(bench_scale.PRESETS["resnet18_v1"])
    assert len(pushed) == 14 and [name for name, _, _ in pushed].count("bucket0_49") == 1


def test_the_bound_is_two_copies_per_worker_and_one_sum():
    # 4 workers of 1 MB: 8 MB copied at 1 ns/byte, 4 MB summed at 0.5 ns/byte
    assert bench_scale.memory_bound(4, 1_000_000, 1e-9, 0.5e-9) == pytest.approx(8e-3 + 2e-3)


@pytest.mark.parametrize("buffers,elements", [(2, 5), (3, bench_scale.BLOCK + 7), (5, 3 * bench_scale.BLOCK)])
def test_blocked_sum_is_the_sum(buffers, elements):
    rng = np.random.default_rng(buffers)
    data = [rng.integers(-100, 100, elements).astype(np.float32) for _ in range(buffers)]
    out = np.full(elements, np.nan, np.float32)
    bench_scale.blocked_sum(data, out)
    assert np.array_equal(out, np.sum(data, axis=0, dtype=np.float32))


def test_measured_bandwidth_is_positive_and_bounded_in_memory():
    found = bench_scale.measure_bandwidth(3, 1 << 16, repeats=2)
    assert found["copy_s_per_byte"] > 0 and found["sum_s_per_byte"] > 0 and found["buffers"] == 3
    assert bench_scale.buffer_count(64, bench_scale.MEASURE_BYTES // 4) == 2  # two sets of two
    assert bench_scale.buffer_count(64, bench_scale.MEASURE_BYTES // 64) == 32
    assert bench_scale.buffer_count(8, 1 << 20) == 8


def test_server_loads_follow_the_workers_placement():
    pushed = bench_scale.pushed_tensors(bench_scale.PRESETS["resnet18_v1"])
    total = 4 * sum(count for _, count, _ in pushed)
    for servers in (1, 2, 4):
        loads = bench_scale.server_loads(pushed, servers, 4096000)
        assert len(loads) == servers and sum(loads) == total
    name, count, _ = pushed[0]
    parts = partitions(count, 4, 4096000)
    assert len(parts) == 3  # a 9.4 MB gradient: three partitions, on three consecutive servers
    for placement in ("plan", "hash"):
        loads = bench_scale.server_loads([(name, count, 0)], 3, 4096000, placement)
        assert sorted(loads) == sorted(4 * part for _, part in parts)
    hashed, planned = (bench_scale.server_loads(pushed, 4, 4096000, p) for p in ("hash", "plan"))
    assert max(hashed) / total > 0.5 and max(planned) / total < 0.26  # the names' hash, and the plan


def test_wakeups_count_a_process_sleeping_and_woken():
    before = bench_scale.process_wakeups(os.getpid())
    time.sleep(0.01)  # a sleep is a voluntary context switch
    assert bench_scale.process_wakeups(os.getpid()) > before
    assert bench_scale.process_wakeups(2**22 + 12345) == 0  # no such process: nothing, no error


@pytest.mark.parametrize("argv,error", [
    (["--host-reduce", "auto"], "--host-reduce takes off and on"),
    (["--workers", "1,2"], "--workers needs counts of at least 2"),
    (["--steps", "0"], "--steps and --passes must be at least 1"),
    (["--placement", "random"], "--placement takes plan and hash"),
])
def test_bad_options_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit):
        bench_scale.parse_args(argv)
    assert error in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_tiny_run_prints_its_table_and_json(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--preset", "4mib8",
                             "--workers", "2", "--servers", "2", "--host-reduce", "off", "--steps", "1",
                             "--passes", "1", "--warmup", "0", "--compute-ms", "1", "--json", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:  # SIGTERM: the script's own cleanup kills its clusters
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, output
    assert "overhead ms/step" in output and "bound ms/step" in output
    (record,) = json.loads(out.read_text())["results"]
    assert (record["workers"], record["servers"], record["host_reduce"], record["placement"]) == (2, 2, "off", "plan")
    # 8 tensors of 512 KiB planned over 2 servers: 4 each (the names' hash put 5 on one)
    assert record["overhead_ms"] > 0 and record["bound_ms"] > 0 and record["busiest_server_share"] == 0.5
    assert record["server_cpu_ms"] > 0 and record["server_wakeups"] > 0 and record["worker_wakeups"] > 0
