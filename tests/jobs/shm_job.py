"""The shared-memory data path (tests/clusters/test_shm.py): digests of every dtype's
collectives, segments while running, a killed worker, push_pulls from a leased shared buffer,
and shared_buffer()'s bad sizes."""

from __future__ import annotations

import glob
import hashlib
import os

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import testing


def every_dtype() -> None:
    """push_pull (sum and mean) and broadcast of every dtype and shape: a digest of each."""
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


def segments_while_running(pattern: str) -> None:
    """One push_pull of 400 KB: how many files match ``pattern`` (the job's segments) meanwhile."""
    bps.init()
    bps.push_pull(np.ones(100000, np.float32), "big")
    report(len(glob.glob(pattern)))
    bps.shutdown()


def killed_worker() -> None:
    """Rank 1 dies (no unlink, no atexit) after one push_pull; the others report what the next raised."""
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


def my_segments() -> int:
    """How many shared-memory segments this process has made in this job."""
    return len(glob.glob(f"/dev/shm/bpsg_{os.environ['DMLC_PS_ROOT_PORT']}_{os.getpid()}_*"))


def leased() -> None:
    """Two tensors in one leased buffer (the second at an odd offset), several partitions each:
    in-place push_pulls leave the sums there; segments made before and after an out-of-place one."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    buf = bps.shared_buffer(4 * 9000 + 8)
    a = np.frombuffer(buf, np.float32, count=5000, offset=0)
    b = np.frombuffer(buf, np.float32, count=4000, offset=4 * 5000 + 8)
    for step in range(3):
        a[:] = np.arange(5000) * (rank + 1) + step
        b[:] = -np.arange(4000) * (rank + 1)
        bps.push_pull(a, "a", average=False, out=a)
        bps.push_pull(b, "b", average=False, out=b)
        total = sum(range(1, size + 1))
        assert np.array_equal(a, np.arange(5000, dtype=np.float32) * total + size * step), (rank, step, a[:4])
        assert np.array_equal(b, -np.arange(4000, dtype=np.float32) * total), (rank, step, b[:4])
    mine = my_segments()
    copied = bps.push_pull(a[:100], "copied", average=False)  # out of place: staged as before
    assert np.array_equal(copied, a[:100] * size)
    after = my_segments()
    report({"leased": mine, "after": after, "hosting": testing.host_link().hosting})
    bps.shutdown()


def bad_sizes() -> None:
    """shared_buffer() of each bad size: the ValueErrors' messages."""
    bps.init()
    errors = []
    for bad in (0, -4, 2.5, True, "8"):
        try:
            bps.shared_buffer(bad)
        except ValueError as exc:
            errors.append(str(exc))
    report(errors)
    bps.shutdown()


if __name__ == "__main__":
    run({"every_dtype": every_dtype, "segments_while_running": segments_while_running,
         "killed_worker": killed_worker, "leased": leased, "bad_sizes": bad_sizes})
