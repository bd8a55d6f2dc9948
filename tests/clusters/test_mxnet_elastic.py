"""Elastic Gluon training on real processes: examples/train_digits_elastic.py with a
worker SIGKILLed mid-training, in allreduce and in gossip mode."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits_elastic.py"
# A longer timeout than the other tests': three processes importing MXNet on two cores.
ELASTIC_ENV = {"BPS_GOSSIP_ELASTIC": "1", "BPS_GOSSIP_MIN_WORKERS": "1", "BPS_GOSSIP_ELASTIC_TIMEOUT": "30",
               "BPS_GOSSIP_TIMEOUT": "30"}


def start_example(job, args: list[str], count: int, first: int = 0) -> list:
    procs = []
    for index in range(first, first + count):
        env = {**job.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index)}
        if index >= job.workers:  # a joiner: no slot of the initial job
            del env["DMLC_WORKER_ID"]
        proc = job.spawn([sys.executable, str(EXAMPLE), "--report-json", *args], env, f"digits{index}")
        proc.rank_hint = index
        procs.append(proc)
    return procs


def run_example(job, args: list[str], timeout: float = 150) -> list:
    return job.wait(start_example(job, args, job.workers), timeout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["allreduce", "gossip", "auto"])
def test_killed_worker_gluon_survivors_agree(cluster, mode):
    # auto: a decision every 3 steps, so that the kill and the restore fall among switches
    job = cluster(3, env={**ELASTIC_ENV, "BPS_GOSSIP_AUTO_WINDOW": "3", "BYTEPS_LOG_LEVEL": "INFO"})
    done = run_example(job, ["--mode", mode, "--epochs", "3", "--kill-rank", "2", "--kill-step", "12",
                             "--commit-every", "4"])
    survivors = [f for f in done if f.rank_hint != 2]
    killed = next(f for f in done if f.rank_hint == 2)
    assert killed.returncode == -9, job.dump()
    for f in survivors:
        assert f.returncode == 0, job.dump()
    results = [f.result for f in survivors]
    assert {r["size"] for r in results} == {2}
    assert len({r["fingerprint"] for r in results}) == 1, f"survivors' parameters differ: {results}"
    assert len({r["step"] for r in results}) == 1 and results[0]["epoch"] == 3
    assert all(r["accuracy"] > 0.85 for r in results), results
    assert all("now 2 workers" in f.stdout for f in survivors), job.dump()
    if mode == "auto":  # every survivor measured again at the new size, from the same step
        assert all("mode='auto' at step 0: gossip (the job changed to 2 workers" in f.stderr + f.stdout
                   for f in survivors), job.dump()
    job.wait_servers_exit()


@pytest.mark.timeout(200)
def test_gluon_worker_joins_with_current_state(cluster):
    job = cluster(2, env=ELASTIC_ENV)
    # Steps slow enough that the rest of the job (3 epochs, >= 8.6 s) outlasts the joiner's start-up
    # (importing MXNet) on a busy machine: a joiner that arrives after the job ended finds no scheduler.
    args = ["--mode", "allreduce", "--epochs", "4", "--commit-every", "4", "--step-sleep", "0.12"]
    first = start_example(job, args, 2)
    deadline = time.monotonic() + 60
    while "epoch 1/4" not in Path(first[0].out_file.name).read_text():  # training is under way
        assert time.monotonic() < deadline and first[0].poll() is None, job.dump()
        time.sleep(0.1)
    done = job.wait(first + start_example(job, args, 1, first=2), 150)
    for f in done:
        assert f.returncode == 0, job.dump()
    results = [f.result for f in done]
    assert {r["size"] for r in results} == {3}, results
    assert len({r["fingerprint"] for r in results}) == 1, f"ranks' parameters differ: {results}"
    assert {r["step"] for r in results} == {results[0]["step"]} and results[0]["epoch"] == 4
    assert all(r["accuracy"] > 0.85 for r in results), results
    assert all("now 3 workers" in f.stdout for f in done[:2]), job.dump()  # the joiner starts at 3
    job.wait_servers_exit()


@pytest.mark.timeout(120)
def test_kvstore_and_module_api_refused_in_elastic_jobs(cluster):
    """Neither keeps its state in an elastic State: a clear error at creation on every rank,
    not ranks drifting apart after the first change of workers."""
    job = cluster(2, env=ELASTIC_ENV)
    done = job.run_job("elastic_edges_job", "kvstore_and_module_api", timeout=90)
    for f in done:
        assert f.returncode == 0, job.dump()
        kvstore, optimizer = f.result
        assert "'bpsgossip' KVStore is not elastic" in kvstore and "GluonState" in kvstore, kvstore
        assert "DistributedOptimizer (the Module API) is not elastic" in optimizer, optimizer
    job.wait_servers_exit()
