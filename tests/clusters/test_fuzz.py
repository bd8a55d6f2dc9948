"""Untrusted input on real processes: thousands of malformed messages to the scheduler, a
server and a worker's gossip port (tests/jobs/fuzz_job.py); every process stays up and the
next push_pull and gossip round are exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cluster import assert_all_ok, results_by_rank

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fuzz_job.py"


@pytest.mark.timeout(120)
def test_malformed_messages_crash_nothing(cluster):
    job = cluster(2)
    procs = []
    for index in range(2):
        env = {**job.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index),
               "FUZZ_SCHEDULER": f"tcp://127.0.0.1:{job.port}"}
        proc = job.spawn([sys.executable, str(JOB)], env, f"fuzz{index}")
        proc.rank_hint = index
        procs.append(proc)
    done = job.wait(procs, timeout=100)
    assert_all_ok(done, job)
    results = results_by_rank(done)
    assert sum(r["sent"] for r in results) > 2000
    for r in results:
        assert r["sum"] == [3.0] * 5
        assert r["gossip"] == [0.5] * 3  # two workers, one round: the exact average
    job.wait_servers_exit()
    assert "Traceback" not in job.dump(), job.dump()
    assert job.scheduler.returncode == 0 and all(p.returncode == 0 for p in job.server_procs), job.dump()
