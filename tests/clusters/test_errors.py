"""Every failure ends in a clear exception, on every rank, within seconds; afterwards every
worker exits and the scheduler and servers exit by themselves.

Worker scripts record each expected failure as [exception type, message, seconds taken]
and report them all at once; the test checks type, message and time.
"""

from __future__ import annotations

import re
import signal
import textwrap

import pytest
from cluster import assert_all_ok

CATCH = '''
import os, time, numpy as np, bps_gossip as bps
outcomes = {}

def expect_error(label, call):
    """Run call(); record [type, message, seconds] of what it raised (or 'no error')."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        outcomes[label] = [type(exc).__name__, str(exc), time.monotonic() - start]
    else:
        outcomes[label] = ["no error", "", time.monotonic() - start]
'''


def script(body: str) -> str:
    """A worker script: expect_error() and ``outcomes``, then ``body``."""
    return CATCH + textwrap.dedent(body)


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
    done = job.run_workers(script('''
        x = np.arange(4, dtype=np.float32)
        for label, call in [
            ("push_pull", lambda: bps.push_pull(x, "x")),
            ("push_pull_async", lambda: bps.push_pull_async(x, "x")),
            ("broadcast", lambda: bps.broadcast(x, "x")),
            ("broadcast_async", lambda: bps.broadcast_async(x, "x")),
            ("rank()", bps.rank), ("size()", bps.size), ("local_rank()", bps.local_rank),
            ("local_size()", bps.local_size), ("declare()", lambda: bps.declare("x")),
            ("barrier", bps.barrier), ("server_stats", bps.server_stats),
        ]:
            expect_error("before init: " + label, call)
        bps.init()
        rank = bps.rank()
        expect_error("name None", lambda: bps.push_pull(x, None))
        expect_error("name ''", lambda: bps.push_pull(x, ""))
        expect_error("broadcast name ''", lambda: bps.broadcast(x, ""))
        expect_error("declare name None", lambda: bps.declare(None))
        expect_error("complex64", lambda: bps.push_pull(x.astype(np.complex64), "cplx"))
        expect_error("bool", lambda: bps.push_pull(x > 1, "flags"))
        expect_error("broadcast bool", lambda: bps.broadcast(x > 1, "bflags"))
        expect_error("list", lambda: bps.push_pull([1.0, 2.0], "alist"))
        expect_error("out shape", lambda: bps.push_pull(x, "o1", out=np.empty(5, np.float32)))
        expect_error("out dtype", lambda: bps.push_pull(x, "o2", out=np.empty(4, np.float64)))
        expect_error("broadcast out shape", lambda: bps.broadcast(x, "o3", out=np.empty((2, 2), np.float32)))
        for root in (2, -1, 7, True, 0.0):
            expect_error(f"root {root!r}", lambda: bps.broadcast(x, "bad-root", root_rank=root))
        # none of the above reached the servers: the job goes on, and the names are fresh
        ok = bps.push_pull(x, "x", average=False)
        outcomes["still works"] = ok.tolist()
        lonely = bps.push_pull_async(x, f"lonely{rank}")  # no other rank ever pushes it
        bps.shutdown()
        expect_error("pending at shutdown", lambda: bps.synchronize(lonely))
        expect_error("after shutdown", lambda: bps.push_pull(x, "x"))
        report({"rank": rank, "outcomes": outcomes})
    '''))
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


MISMATCHES = CATCH + '''
bps.init()
rank, size = bps.rank(), bps.size()
odd = rank % 2 == 1
f32 = np.float32
cases = [  # label, this rank's call
    ("shape", lambda: bps.push_pull(np.ones((4, 3) if odd else (3, 4), f32), "t-shape")),
    ("dtype", lambda: bps.push_pull(np.ones(6, np.int32 if odd else f32), "t-dtype")),
    ("itemsize", lambda: bps.push_pull(np.ones(3000, np.float64 if odd else f32), "t-itemsize")),
    ("parts", lambda: bps.push_pull(np.ones(100 if odd else 10000, f32), "t-parts")),
    ("zero-size", lambda: bps.push_pull(np.ones((0, 3) if odd else (3,), f32), "t-zero")),
    ("average", lambda: bps.push_pull(np.ones(5, f32), "t-average", average=not odd)),
    ("root", lambda: bps.broadcast(np.ones(5, f32), "t-root", root_rank=rank % 2)),
    ("push_pull vs broadcast", lambda: (bps.broadcast if odd else bps.push_pull)(np.ones(5, f32), "t-kind")),
]
for label, call in cases:
    expect_error(label, call)
# asynchronous: a mismatch among correct operations in flight fails only its own handle
good = [bps.push_pull_async(np.full(2000, rank, f32), f"t-good{i}", average=False) for i in range(3)]
bad = bps.push_pull_async(np.ones(20 if odd else 30, f32), "t-async")
expect_error("async", lambda: bps.synchronize(bad))
outcomes["good"] = [bps.synchronize(h)[:2].tolist() for h in good]
# the job is not broken: the names work again once the shapes agree
outcomes["again"] = bps.push_pull(np.ones((3, 4), f32), "t-shape", average=False).sum().item()
report({"rank": rank, "outcomes": outcomes})
bps.shutdown()
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 2)])
def test_tensor_mismatch_fails_every_rank(cluster, workers, servers):
    job = cluster(workers, servers, {"BYTEPS_PARTITION_BYTES": "4096"})
    done = job.run_workers(MISMATCHES, timeout=60)
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


DEATH = CATCH + '''
bps.init()
rank = bps.rank()
bps.push_pull(np.ones(3, np.float32), "warm-up")
bps.barrier()
if rank == 1:
    if WHERE == "pushed":  # its partitions reach the servers before it dies
        bps.push_pull_async(np.ones(10000, np.float32), "after-death")
        time.sleep(0.5)
    os.kill(os.getpid(), 9)
time.sleep(0.2)
if WHERE == "pushed" and rank == 2:
    time.sleep(3)  # pushes only after the servers heard of the death
if WHERE in ("push_pull", "pushed"):
    expect_error("first", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death"))
else:
    expect_error("first", bps.barrier)
expect_error("second", lambda: bps.push_pull(np.ones(3, np.float32), "after-death-2"))
report({"rank": rank, "outcomes": outcomes})
bps.shutdown()
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["push_pull", "pushed", "barrier"])
def test_dead_worker_fails_the_others(cluster, where):
    job = cluster(3, 2, {"BYTEPS_PARTITION_BYTES": "4096"})
    done = job.run_workers(f"WHERE = {where!r}\n" + DEATH, timeout=40)
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
    done = job.run_workers(script(f'''
        bps.init()
        rank = bps.rank()
        bps.push_pull(np.ones(3, np.float32), "warm-up")
        bps.barrier()
        if rank == 0:
            os.kill({victim}, 9)
        # 10 partitions: some live on the dead server
        expect_error("first", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death"))
        expect_error("second", lambda: bps.push_pull(np.ones(10000, np.float32), "after-death-2"))
        report({{"rank": rank, "outcomes": outcomes}})
        bps.shutdown()
    '''), timeout=40)
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
    done = job.run_workers(script(f'''
        from bps_gossip.compression import CompressionSpec
        bps.init()
        rank = bps.rank()
        onebit = CompressionSpec("onebit")
        bps.push_pull(np.ones(64, np.float32), "warm-up", compression=onebit)
        bps.barrier()
        if rank == 0:
            os.kill({victim}, 9)
        expect_error("compressed", lambda: bps.push_pull(np.ones(64, np.float32), "after-death", compression=onebit))
        summed = bps.push_pull(np.full(1000, rank + 1, np.float32), "summed", average=False)
        report({{"rank": rank, "outcomes": outcomes, "summed": sorted(set(summed.tolist()))}})
        bps.shutdown()
    '''), timeout=40)
    assert_all_ok(done, job)
    for f in done:
        check(f.result["outcomes"]["compressed"], "PeerLostError", "server rank", f"pid {victim}", within=8)
        assert f.result["summed"] == [3.0], f.result


@pytest.mark.timeout(60)
def test_dead_scheduler_fails_the_workers(cluster):
    job = cluster(2, 1)
    victim = job.scheduler.pid
    done = job.run_workers(script(f'''
        bps.init()
        rank = bps.rank()
        bps.push_pull(np.ones(3, np.float32), "warm-up")
        bps.barrier()
        # through the server: both ranks have their barrier's answer before the scheduler dies
        bps.push_pull(np.ones(3, np.float32), "both past the barrier")
        if rank == 0:
            os.kill({victim}, 9)
        def loop():  # push_pulls go on (the server lives) until the scheduler's silence is noticed
            for i in range(100000):
                bps.push_pull(np.ones(3, np.float32), "loop")
                time.sleep(0.01)
        expect_error("first", loop)
        expect_error("second", lambda: bps.push_pull(np.ones(3, np.float32), "after"))
        expect_error("barrier", bps.barrier)
        report({{"rank": rank, "outcomes": outcomes}})
        bps.shutdown()
    '''), timeout=40)
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
    done = job.run_workers(script('''
        expect_error("init", bps.init)
        time.sleep(0.3)  # ZeroMQ closes a socket's descriptors in the background
        fds = len(os.listdir("/proc/self/fd"))
        expect_error("again", bps.init)  # a retry fails the same way and leaks nothing
        time.sleep(0.3)
        outcomes["leaked"] = len(os.listdir("/proc/self/fd")) - fds
        outcomes["initialized"] = bps.is_initialized()
        report(outcomes)
    '''), count=1, timeout=15)
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
    done = job.run_workers(script(f'''
        for var, value in {BAD_ENV!r}:
            saved = os.environ.get(var)
            os.environ[var] = value
            expect_error(f"{{var}}={{value}}", bps.init)
            os.environ[var] = saved if saved is not None else ""
        outcomes["initialized"] = bps.is_initialized()
        report(outcomes)
    '''), count=1, timeout=30)
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
    done = job.run_workers(script('''
        expect_error("init", bps.init)
        report(outcomes)
    '''), count=1, env={"DMLC_NUM_WORKER": "3"}, timeout=30)
    assert_all_ok(done, job)
    check(done[0].result["init"], "ConfigError", "DMLC_NUM_WORKER=3 at the worker but 2 at the scheduler")


@pytest.mark.timeout(60)
def test_two_workers_with_the_same_worker_id(cluster):
    job = cluster(2, 1, {"BPS_GOSSIP_START_TIMEOUT": "3"})
    done = job.run_workers(script('''
        expect_error("init", bps.init)
        report(outcomes)
    '''), per_rank_env={1: {"DMLC_WORKER_ID": "0"}}, timeout=30)
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
    done = job.run_workers("""
        import bps_gossip as bps
        try:
            bps.init()
            report(["joined"])
        except bps.BpsGossipError as exc:
            report([type(exc).__name__, str(exc)])
    """, count=1, timeout=40)
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
    done = job.run_workers("""
        import numpy as np, bps_gossip as bps
        bps.init()
        report(bps.push_pull(np.ones(2), "alone").tolist())
        bps.shutdown()
    """)
    assert_all_ok(done, job)
    assert done[0].result == [1.0, 1.0]
    job.wait_servers_exit(timeout=15)
    assert job.scheduler.returncode == 1


@pytest.mark.timeout(90)
def test_worker_dead_before_the_rendezvous_frees_its_place(cluster):
    """A worker that registers and dies while the job waits for the others must not hold
    its place: a replacement with the same DMLC_WORKER_ID completes the job."""
    job = cluster(2)
    doomed = job.start_workers("""
        import os, threading, time, bps_gossip as bps
        threading.Thread(target=bps.init, daemon=True).start()
        time.sleep(2)   # registered, waiting for worker 1
        os.kill(os.getpid(), 9)
    """, count=1)
    assert job.wait(doomed, 30)[0].returncode == -signal.SIGKILL, job.dump()
    done = job.run_workers("""
        import numpy as np, bps_gossip as bps
        bps.init()
        report(bps.push_pull(np.ones(4, np.float32), "x", average=False).tolist())
        bps.shutdown()
    """, timeout=60)
    assert_all_ok(done, job)
    assert [f.result for f in done] == [[2.0] * 4] * 2
    assert "is gone before the rendezvous (its process exited)" in job.dump()
    job.wait_servers_exit()
