"""A worker killed with SIGKILL cannot unlink its shared-memory segments, and nothing else
unlinks them for it by default (they are not on Python's resource tracker, whose cleanup
reports every segment as "leaked"). Whoever started the worker on its host sweeps them when
it exits: bpslaunch's supervisor (every local, batch and joining worker) and
bps_gossip.launch.remote (workers on ssh hosts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import JOBS, free_port

from bps_gossip.launch.supervisor import Supervisor
from bps_gossip.transport import shm

# A worker that makes a segment of the job named by DMLC_PS_ROOT_PORT, as a pushing worker does,
# says its name, and dies without cleaning up.
DOOMED_WORKER = [sys.executable, str(JOBS / "worker_process_job.py"), "doomed_segment"]


def segments_of(job: str) -> list[str]:
    return sorted(path.name for path in shm.SHM_DIR.glob(f"{shm.PREFIX}_{job}_*"))


@pytest.mark.timeout(60)
def test_supervisor_sweeps_a_killed_workers_segments(tmp_path, capfd):
    job = str(free_port())
    env = {**os.environ, "DMLC_PS_ROOT_PORT": job}
    try:
        with Supervisor() as sup:
            sup.start(DOOMED_WORKER, env, "worker", "worker 0", "[0] ")
            assert sup.wait(fail_fast=True) == 128 + 9
        name = capfd.readouterr().out.split()[-1]
        assert name.startswith(f"{shm.PREFIX}_{job}_"), name
        assert segments_of(job) == []
    finally:
        shm.sweep(job)


@pytest.mark.timeout(60)
def test_remote_end_sweeps_a_killed_workers_segments(tmp_path):
    job = str(free_port())
    spec = {"argv": DOOMED_WORKER, "cwd": str(tmp_path),
            "env": {"DMLC_PS_ROOT_PORT": job, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}}
    remote = None
    try:
        # Its stdin stays open, as ssh's does while bpslaunch runs (its end would stop the command).
        remote = subprocess.Popen([sys.executable, "-m", "bps_gossip.launch.remote"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert remote.stdin is not None
        remote.stdin.write((json.dumps(spec) + "\n").encode())
        remote.stdin.flush()
        out, err = remote.stdout.read(), remote.stderr.read()  # type: ignore[union-attr]
        assert remote.wait(timeout=50) == 128 + 9, err.decode()
        assert out.decode().startswith(f"{shm.PREFIX}_{job}_"), out
        assert segments_of(job) == []
    finally:
        if remote is not None and remote.poll() is None:
            remote.kill()
        if remote is not None:
            remote.wait()
            remote.stdin.close()  # type: ignore[union-attr]
        shm.sweep(job)
