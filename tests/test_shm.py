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
