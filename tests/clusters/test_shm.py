"""The shared-memory data path: the same bits as TCP, and no segment left behind."""

from __future__ import annotations

import time

import pytest
from cluster import assert_all_ok

from bps_gossip.transport import shm

EVERY_DTYPE = """
    import hashlib, numpy as np, bps_gossip as bps
    bps.init()
    rank, size = bps.rank(), bps.size()
    digests = {}
    for dtype in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64"):
        for shape in [(), (0,), (7,), (3, 5), (2, 3, 4), (2, 2, 3, 700)]:
            rng = np.random.RandomState(rank + 17 * len(shape))
            x = (rng.randint(0, 4, size=shape) + rank).astype(dtype)
            name = f"t.{dtype}.{len(shape)}.{np.prod(shape, dtype=int)}"
            summed = bps.push_pull(x, name, average=False)
            averaged = bps.push_pull(x, name + ".mean", average=True)
            root = bps.broadcast(x * 3, name + ".bcast", root_rank=size - 1)
            digests[name] = hashlib.sha1(summed.tobytes() + averaged.tobytes() + root.tobytes()).hexdigest()
    report(digests)
    bps.shutdown()
"""


def _segments(job: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}_{job}_*"))


@pytest.mark.timeout(180)
def test_shared_memory_gives_the_same_bits_as_tcp(cluster):
    results = {}
    for flag in ("1", "0"):
        # 2 servers, small partitions: multi-partition tensors on both, 3 workers
        job = cluster(3, servers=2, env={"BPS_GOSSIP_SHM": flag, "BYTEPS_PARTITION_BYTES": "4096"})
        done = job.run_workers(EVERY_DTYPE)
        assert_all_ok(done, job)
        results[flag] = [f.result for f in done]
        job.wait_servers_exit()
        assert _segments(str(job.port)) == []
    assert results["1"] == results["0"]
    assert all(r == results["1"][0] for r in results["1"])  # every rank got the same bits


@pytest.mark.timeout(120)
def test_shared_memory_is_used_and_cleaned_up_on_shutdown(cluster):
    job = cluster(2, env={"BPS_GOSSIP_SHM": "1"})
    done = job.run_workers(f"""
        import glob, numpy as np, bps_gossip as bps
        bps.init()
        bps.push_pull(np.ones(100000, np.float32), "big")
        report(len(glob.glob("/dev/shm/{shm.PREFIX}_{job.port}_*")))
        bps.shutdown()
    """)
    assert_all_ok(done, job)
    assert all(f.result >= 1 for f in done), "no shared-memory segment while running"
    job.wait_servers_exit()
    assert _segments(str(job.port)) == []


@pytest.mark.timeout(120)
def test_killed_worker_leaves_no_segment(cluster):
    job = cluster(3, env={"BPS_GOSSIP_SHM": "1"})
    done = job.run_workers("""
        import os, numpy as np, bps_gossip as bps
        bps.init()
        bps.push_pull(np.ones(50000, np.float32), "big")
        if bps.rank() == 1:
            os.kill(os.getpid(), 9)   # no unlink, no atexit
        try:
            bps.push_pull(np.ones(50000, np.float32), "big")
            report("no error")
        except bps.BpsGossipError as exc:
            report(type(exc).__name__)
        bps.shutdown()
    """)
    survivors = [f for f in done if f.rank_hint != 1]
    assert all(f.returncode == 0 and f.result == "PeerLostError" for f in survivors), job.dump()
    job.wait_servers_exit()
    deadline = time.monotonic() + 5
    while _segments(str(job.port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _segments(str(job.port)) == []


# Two tensors in one leased buffer (the second at an odd offset), several partitions each: each
# worker's in-place push_pulls leave the sums there, and no segment but the buffer is made.
LEASED = '''
import glob, os, numpy as np, bps_gossip as bps
from bps_gossip import testing
bps.init()
rank, size = bps.rank(), bps.size()
buf = bps.shared_buffer(4 * 9000 + 8)
a = np.frombuffer(buf, np.float32, count=5000, offset=0)
b = np.frombuffer(buf, np.float32, count=4000, offset=4 * 5000 + 8)
plain = np.arange(3000, dtype=np.float32)
for step in range(3):
    a[:] = np.arange(5000) * (rank + 1) + step
    b[:] = -np.arange(4000) * (rank + 1)
    bps.push_pull(a, "a", average=False, out=a)
    bps.push_pull(b, "b", average=False, out=b)
    total = sum(range(1, size + 1))
    assert np.array_equal(a, np.arange(5000, dtype=np.float32) * total + size * step), (rank, step, a[:4])
    assert np.array_equal(b, -np.arange(4000, dtype=np.float32) * total), (rank, step, b[:4])
mine = len(glob.glob(f"/dev/shm/bpsg_{os.environ['DMLC_PS_ROOT_PORT']}_{os.getpid()}_*"))
copied = bps.push_pull(a[:100], "copied", average=False)  # out of place: staged as before
assert np.array_equal(copied, a[:100] * size)
after = len(glob.glob(f"/dev/shm/bpsg_{os.environ['DMLC_PS_ROOT_PORT']}_{os.getpid()}_*"))
report({"leased": mine, "after": after, "hosting": testing.host_link().hosting})
bps.shutdown()
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env", [{"BPS_GOSSIP_HOST_REDUCE": "off"}, {}], ids=["server", "host-leader"])
def test_push_pulls_from_a_shared_buffer_need_no_other_segment(cluster, env):
    job = cluster(3, env={"BPS_GOSSIP_SHM": "1", "BYTEPS_PARTITION_BYTES": "4096", **env})
    done = job.run_workers(LEASED)
    assert_all_ok(done, job)
    results = [f.result for f in done]
    assert all(r["hosting"] == (not env) for r in results), results
    # one segment each (the buffer), before an out-of-place push_pull stages one more
    assert all(r["leased"] == 1 and r["after"] == 2 for r in results), results
    job.wait_servers_exit()
    assert _segments(str(job.port)) == []


@pytest.mark.timeout(60)
def test_shared_buffer_refuses_a_bad_size(cluster):
    job = cluster(1, env={"BPS_GOSSIP_SHM": "1", "BYTEPS_FORCE_DISTRIBUTED": "1"})
    done = job.run_workers('''
        import bps_gossip as bps
        bps.init()
        errors = []
        for bad in (0, -4, 2.5, True, "8"):
            try:
                bps.shared_buffer(bad)
            except ValueError as exc:
                errors.append(str(exc))
        report(errors)
        bps.shutdown()
    ''')
    assert_all_ok(done, job)
    assert len(done[0].result) == 5 and "positive int" in done[0].result[0]
