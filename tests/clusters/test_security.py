"""Authentication and sender identity on real processes (workers: tests/jobs/security_job.py;
under bpslaunch: launcher_job.py).

Without the job's secret a process completes no handshake: a worker or server says so
at once, and raw sockets reach nothing. With the secret but without a place in the
address book (an insider that never registered), pushes and gossip are refused: rank,
round size and generation come from the scheduler's book, never from the message.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cluster import assert_all_ok
from test_launcher import Job, job_command, parse_sums


@pytest.mark.timeout(90)
def test_a_process_without_the_secret_is_refused_everywhere(cluster):
    job = cluster(2)
    # Workers and a server with a wrong secret or none: a clear error within seconds.
    bad = job.run_job("security_job", "refused",
                      per_rank_env={0: {"BPS_GOSSIP_SECRET": "not-the-job-secret-at-all-" + "9f3a" * 8},
                                    1: {"BPS_GOSSIP_SECRET": None}},
                      timeout=30)
    wrong, missing = sorted(bad, key=lambda f: f.rank_hint)
    assert wrong.result[0] == "ConfigError" and "BPS_GOSSIP_SECRET is not the job's" in wrong.result[1], wrong
    assert missing.result[0] == "ConfigError" and "has no secret and the job has one" in missing.result[1], missing
    assert wrong.result[2] < 5 and missing.result[2] < 5
    rogue = job.spawn([sys.executable, "-m", "bps_gossip.server"],
                      {**job.env, "DMLC_ROLE": "server", "BPS_GOSSIP_SECRET": "rogue-" + "0a1b2c3d" * 4},
                      "rogue_server")
    assert rogue.wait(20) == 2
    assert "secure handshake" in job.dump()

    # The real workers: plain and wrong-key sockets to the scheduler, the server and a peer
    # get no answer and change nothing; the job's push_pull and gossip stay exact.
    done = job.run_job("security_job", "strangers", timeout=60)
    assert_all_ok(done, job)
    for f in done:
        assert f.result["heard"] == {"plain": [None] * 3, "wrong key": [None] * 3}, f.result
        assert f.result["sum"] == [3.0] * 4 and f.result["gossip"] == [0.5] * 3, f.result
    job.wait_servers_exit()
    assert job.scheduler.returncode == 0 and job.server_procs[0].returncode == 0, job.dump()


@pytest.mark.timeout(90)
def test_identity_comes_from_the_address_book(cluster):
    """Issue 12, items 4-7: an insider with the secret but no place in the book pushes a real
    tensor as rank 7 of 3, under another name, from a later generation, and gossips as rank 0:
    every push is refused (or held, then expired), and the job's sums and gossip stay exact."""
    job = cluster(2, env={"BPS_GOSSIP_TIMEOUT": "3"})
    done = job.run_job("security_job", "insider", timeout=60)
    assert_all_ok(done, job)
    for f in done:
        assert f.result["first"] == f.result["second"] == [3.0] * 4, f.result
        assert f.result["mixed"] == [0.5] * 3, f.result
    spoof = next(f.result["spoof"] for f in done if "spoof" in f.result)
    for op, kind, why in spoof[:2]:
        assert [op, kind] == ["error", "protocol"] and "no worker of generation 1" in why, spoof
    assert spoof[2][:2] == ["error", "timeout"] and "no address book of generation 6" in spoof[2][2], spoof
    assert next(f.result["gossip"] for f in done if "spoof" in f.result) is None
    assert "no peer of generation 1" in job.dump()  # the gossip was dropped and logged
    job.wait_servers_exit()


@pytest.mark.timeout(60)
def test_bpslaunch_makes_a_secret_per_job(tmp_path):
    launched = Job(tmp_path)
    try:
        env = {k: v for k, v in launched.env.items() if k != "BPS_GOSSIP_SECRET"}
        launched.env = env
        code, out, err = launched.finish(launched.start(["-np", "2", *job_command("secret_per_job")]))
        assert code == 0, out + err
        assert parse_sums(out)[1][2] == [2.0] * 3, out
        secrets = {tuple(line.split()[2:]) for line in out.splitlines() if " SECRET " in line}
        assert len(secrets) == 1, out  # one secret file for the whole job
        path, mode, keyed = next(iter(secrets))
        assert mode == "0o600" and keyed == "True", out
        assert not Path(path).exists()  # removed with the job
    finally:
        launched.close()

