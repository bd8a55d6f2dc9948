"""Every failure ends in a clear exception, on every rank, within seconds; afterwards every
worker exits and the scheduler and servers exit by themselves.

The workers run tests/jobs/errors_job.py, whose scenarios record each expected failure as
[exception type, message, seconds taken] and report them all at once; the test checks type,
message and time.
"""

from __future__ import annotations

import re
import signal

import pytest
from cluster import assert_all_ok


def check(outcome: list, kind: str, *fragments: str, within: float = 5.0) -> None:
    """Assert that one recorded outcome is a ``kind`` error whose message has every fragment."""
    name, message, seconds = outcome
    assert name == kind, outcome
    for fragment in fragments:
        assert fragment in message, (fragment, outcome)
    assert seconds < within, outcome


@pytest.mark.timeout(60)
def test_usage_errors(cluster):
    job = cluster(2, 1)
    done = job.run_job("errors_job", "usage_errors")
    assert_all_ok(done, job)
    for f in done:
        out = f.result["outcomes"]
        for label in ("push_pull", "push_pull_async", "broadcast", "broadcast_async", "rank()", "size()",
                      "local_rank()", "local_size()", "declare()", "barrier", "server_stats"):
            check(out["before init: " + label], "NotInitializedError", label.replace("_async", ""), "init()")
        for label in ("name None", "name ''", "broadcast name ''", "declare name None"):
            check(out[label], "ValueError", "name")
        check(out["complex64"], "TypeError", "'cplx'", "complex64")
        check(out["bool"], "TypeError", "'flags'", "bool")
        check(out["broadcast bool"], "TypeError", "'bflags'", "bool")
        check(out["list"], "TypeError", "'alist'", "list")
        check(out["out shape"], "ValueError", "'o1'", "(5,)", "(4,)")
        check(out["out dtype"], "ValueError", "'o2'", "float64", "float32")
        check(out["broadcast out shape"], "ValueError", "'o3'", "(2, 2)")
        for root in ("2", "-1", "7", "True", "0.0"):
            check(out[f"root {root}"], "ValueError", "'bad-root'", f"root_rank={root}", "size 2",
                  f"rank {f.rank_hint}")
        assert out["still works"] == [0.0, 2.0, 4.0, 6.0]
        check(out["after shutdown"], "NotInitializedError", "push_pull")
        # shut down locally, or failed first by the server because the other rank left
        assert out["pending at shutdown"][0] in ("NotInitializedError", "PeerLostError"), out
        assert out["pending at shutdown"][2] < 1, out
    job.wait_servers_exit()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 2)])
def test_tensor_mismatch_fails_every_rank(cluster, workers, servers):
    job = cluster(workers, servers, {"BYTEPS_PARTITION_BYTES": "4096"})
    done = job.run_job("errors_job", "mismatches", timeout=60)
    assert_all_ok(done, job)
    signatures = {
        "shape": ("'t-shape'", "(3, 4)", "(4, 3)"),
        "dtype": ("'t-dtype'", "float32 (6,)", "int32 (6,)"),
        "itemsize": ("'t-itemsize'", "float32 (3000,)", "float64 (3000,)"),
        "parts": ("'t-parts'", "(10000,)", "(100,)"),
        "zero-size": ("'t-zero'", "(3,)", "(0, 3)"),
        "average": ("'t-average'", "mean", "sum"),
        "root": ("'t-root'", "broadcast from root 0", "broadcast from root 1"),
        "push_pull vs broadcast": ("'t-kind'", "broadcast from root 0", "mean"),
        "async": ("'t-async'", "(20,)", "(30,)"),
    }
    messages = {}
    for f in done:
        out = f.result["outcomes"]
        for label, fragments in signatures.items():
            check(out[label], "TensorMismatchError", *fragments)
            ranks = set(re.findall(r"rank (\d+) pushed", out[label][1]))
            assert len(ranks) == 2 and len({int(r) % 2 for r in ranks}) == 2, out[label]  # both sides named
            messages.setdefault(label, set()).add(out[label][1].split(" [on rank")[0])
        sums = [[(workers - 1) * workers / 2] * 2] * 3
        assert out["good"] == sums and out["again"] == 12 * workers, out
    for label, texts in messages.items():
        # Every rank got the same story, up to which server (each sees its own partition's
        # first pusher, so may pair the odd rank with a different even one) told it.
        assert len(texts) <= servers, (label, texts)
    job.wait_servers_exit()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["push_pull", "pushed", "barrier"])
def test_dead_worker_fails_the_others(cluster, where):
    job = cluster(3, 2, {"BYTEPS_PARTITION_BYTES": "4096"})
    done = job.run_job("errors_job", "death", where, timeout=40)
    assert done[1].returncode == -signal.SIGKILL, job.dump()
    assert_all_ok([done[0], done[2]], job)
    for f in (done[0], done[2]):
        out = f.result["outcomes"]
        for label in ("first", "second"):
            name, message, seconds = out[label]
            assert name in ("PeerLostError", "CommTimeoutError"), out[label]
            assert "worker rank 1" in message, out[label]
            assert seconds < (6 if label == "first" else 2), out[label]
    job.wait_servers_exit()


@pytest.mark.timeout(60)
def test_dead_server_fails_the_workers(cluster):
    # Host reduce off: on one host the servers otherwise take only compressed pushes.
    job = cluster(2, 2, {"BYTEPS_PARTITION_BYTES": "4096", "BPS_GOSSIP_HOST_REDUCE": "off"})
    victim = job.server_procs[0].pid
    done = job.run_job("errors_job", "dead_server", victim, timeout=40)
    assert_all_ok(done, job)
    for f in done:
        out = f.result["outcomes"]
        check(out["first"], "PeerLostError", "server rank", f"pid {victim}", "'after-death'", within=6)
        check(out["second"], "PeerLostError", "server rank", f"pid {victim}", within=1)
    job.wait_servers_exit()


@pytest.mark.timeout(60)
def test_on_one_host_a_dead_server_fails_only_the_compressed_push_pulls_it_carries(cluster):
    """One host holds the job: its leader sums push_pull, the server takes only compressed pushes."""
    job = cluster(2, 1, {"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    victim = job.server_procs[0].pid
    done = job.run_job("errors_job", "dead_server_on_one_host", victim, timeout=40)
    assert_all_ok(done, job)
    for f in done:
        check(f.result["outcomes"]["compressed"], "PeerLostError", "server rank", f"pid {victim}", within=8)
        assert f.result["summed"] == [3.0], f.result


@pytest.mark.timeout(60)
def test_dead_scheduler_fails_the_workers(cluster):
    job = cluster(2, 1)
    victim = job.scheduler.pid
    done = job.run_job("errors_job", "dead_scheduler", victim, timeout=40)
    assert_all_ok(done, job)
    for f in done:
        out = f.result["outcomes"]
        check(out["first"], "PeerLostError", "scheduler", f"127.0.0.1:{job.port}", within=6)
        check(out["second"], "PeerLostError", "scheduler", within=1)
        check(out["barrier"], "PeerLostError", "scheduler", within=1)
    job.wait_servers_exit()


@pytest.mark.timeout(30)
def test_unreachable_scheduler(cluster):
    # Nothing listens on job.port: the worker waits for a connection up to BPS_GOSSIP_START_TIMEOUT.
    job = cluster(2, 1, {"BPS_GOSSIP_TIMEOUT": "1", "BPS_GOSSIP_START_TIMEOUT": "2"}, start_servers=False)
    done = job.run_job("errors_job", "unreachable_scheduler", count=1, timeout=15)
    assert_all_ok(done, job)
    for label in ("init", "again"):
        check(done[0].result[label], "CommTimeoutError", f"tcp://127.0.0.1:{job.port}", "2.0 s",
              "BPS_GOSSIP_START_TIMEOUT", within=3.5)
    assert done[0].result["initialized"] is False and done[0].result["leaked"] == 0


BAD_ENV = [
    ("DMLC_NUM_WORKER", "abc"),
    ("DMLC_NUM_WORKER", "0"),
    ("DMLC_NUM_SERVER", "-1"),
    ("DMLC_PS_ROOT_PORT", "70000"),
    ("DMLC_PS_ROOT_PORT", "port"),
    ("DMLC_PS_ROOT_URI", "tcp://host"),
    ("DMLC_WORKER_ID", "9"),
    ("DMLC_ROLE", "boss"),
    ("DMLC_ROLE", "server"),
    ("BYTEPS_LOCAL_RANK", "4"),
    ("BYTEPS_PARTITION_BYTES", "0"),
    ("BYTEPS_FORCE_DISTRIBUTED", "maybe"),
    ("BYTEPS_LOG_LEVEL", "LOUD"),
    ("BPS_GOSSIP_TIMEOUT", "soon"),
    ("BPS_GOSSIP_HEARTBEAT_TIMEOUT", "0.1"),
]


@pytest.mark.timeout(60)
def test_bad_environment_at_init(cluster):
    job = cluster(2, 1, start_servers=False)
    done = job.run_job("errors_job", "bad_environment", *(f"{var}={value}" for var, value in BAD_ENV), count=1,
                       timeout=30)
    assert_all_ok(done, job)
    out = done[0].result
    for var, value in BAD_ENV:
        check(out[f"{var}={value}"], "ConfigError", var, within=1)
    assert out["initialized"] is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_bad_environment_for_scheduler_and_server(cluster, role):
    job = cluster(2, 1, {"BYTEPS_SERVER_ENGINE_THREAD": "many"}, start_servers=False)
    proc = job.spawn_role(role)
    proc.wait(20)
    err = job.dump()
    assert proc.returncode == 2, err
    assert f"bps_gossip {role}: BYTEPS_SERVER_ENGINE_THREAD='many' is not an integer" in err


@pytest.mark.timeout(60)
def test_worker_count_disagreeing_with_the_scheduler(cluster):
    job = cluster(2, 1)
    done = job.run_job("errors_job", "init_fails", count=1, env={"DMLC_NUM_WORKER": "3"}, timeout=30)
    assert_all_ok(done, job)
    check(done[0].result["init"], "ConfigError", "DMLC_NUM_WORKER=3 at the worker but 2 at the scheduler")


@pytest.mark.timeout(60)
def test_two_workers_with_the_same_worker_id(cluster):
    job = cluster(2, 1, {"BPS_GOSSIP_START_TIMEOUT": "3"})
    done = job.run_job("errors_job", "init_fails", per_rank_env={1: {"DMLC_WORKER_ID": "0"}}, timeout=30)
    assert_all_ok(done, job)
    kinds = sorted(f.result["init"][0] for f in done)
    assert kinds == ["ConfigError", "JobFailedError"], job.dump()
    for f in done:
        name, message, seconds = f.result["init"]
        if name == "ConfigError":  # the second to register is refused at once
            assert "DMLC_WORKER_ID" in message and "BYTEPS_LOCAL_RANK=0" in message, message
            assert seconds < 2, f.result
        else:  # the first waits for a rendezvous that cannot complete; the scheduler ends it
            assert "BPS_GOSSIP_START_TIMEOUT=3" in message and seconds < 4.5, f.result


@pytest.mark.timeout(60)
def test_rendezvous_that_never_completes_ends_the_job(cluster):
    """BPS_GOSSIP_START_TIMEOUT: one of two workers never comes; everybody hears why and exits."""
    job = cluster(2, env={"BPS_GOSSIP_START_TIMEOUT": "3", "BPS_GOSSIP_TIMEOUT": "30"})
    done = job.run_job("errors_job", "rendezvous_never_completes", count=1, timeout=40)
    kind, why = done[0].result
    assert kind == "JobFailedError", done[0].result
    assert "BPS_GOSSIP_START_TIMEOUT=3" in why and "1 of DMLC_NUM_SERVER=1" in why and "1 worker process" in why, why
    job.wait_servers_exit(timeout=10)
    assert job.scheduler.returncode == 1 and job.server_procs[0].returncode != 0, job.dump()
    assert "START_TIMEOUT" in job.dump()


@pytest.mark.timeout(60)
def test_scheduler_and_server_without_workers_end(cluster):
    """A BytePS-mode job whose only worker runs alone (no BYTEPS_FORCE_DISTRIBUTED) never registers."""
    job = cluster(1, env={"BPS_GOSSIP_START_TIMEOUT": "2"})
    done = job.run_job("errors_job", "alone")
    assert_all_ok(done, job)
    assert done[0].result == [1.0, 1.0]
    job.wait_servers_exit(timeout=15)
    assert job.scheduler.returncode == 1


@pytest.mark.timeout(90)
def test_worker_dead_before_the_rendezvous_frees_its_place(cluster):
    """A worker that registers and dies while the job waits for the others must not hold
    its place: a replacement with the same DMLC_WORKER_ID completes the job."""
    job = cluster(2)
    doomed = job.start_job("errors_job", "register_and_die", count=1)
    assert job.wait(doomed, 30)[0].returncode == -signal.SIGKILL, job.dump()
    done = job.run_job("errors_job", "sum_of_ones", timeout=60)
    assert_all_ok(done, job)
    assert [f.result for f in done] == [[2.0] * 4] * 2
    assert "is gone before the rendezvous (its process exited)" in job.dump()
    job.wait_servers_exit()
