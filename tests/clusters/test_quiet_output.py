"""Issue 33, item 9: what a job prints, counted line by line on real processes (bpslaunch,
scheduler, servers and workers on 127.0.0.1).

- No job secret: one line per job, from task 0's bpslaunch, under srun or mpirun (every
  scheduler, server and worker said it too: 6 lines for 3 tasks).
- Ctrl-C (SIGINT to bpslaunch's process group, as a terminal sends it): one line per worker
  (each printed a 20-40 line KeyboardInterrupt traceback through the library's waits).
- Ranks that build different models with deferred shapes: the TensorMismatchError with a short
  traceback (Gluon's DeferredInitializationError was chained before it: ~45 lines per worker).
- scripts/bench_host_reduce.py without a secret: one line (every process of every job said it:
  36 lines), where emulated hosts can run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import JOBS, free_port
from test_launcher import LAUNCH, SUM_JOB, Job, job_command
from test_launcher_batch import mpirun_argv, needs_mpirun, openmpi_task, parse_sums

NO_SECRET = "no job secret"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def job(tmp_path):
    """bpslaunch processes with the tests' secret (FAST_ENV), killed at the end."""
    made = Job(tmp_path)
    yield made
    made.close()


@pytest.fixture
def plain_job(tmp_path):
    """A Job whose environment has no secret (and nothing of a surrounding srun or mpirun)."""
    made = Job(tmp_path)
    for name in list(made.env):
        if name.startswith(("SLURM", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "BPS_GOSSIP_SECRET")):
            del made.env[name]
    yield made
    made.close()


@pytest.mark.timeout(60)
def test_no_secret_is_said_once_per_job_by_task_zero(plain_job):
    """Three tasks as Open MPI's mpirun starts them (its variables, no mpirun needed)."""
    port = free_port()
    procs = [plain_job.start(SUM_JOB, openmpi_task(task, 3, port)) for task in range(3)]
    results = [plain_job.finish(proc) for proc in procs]
    host = os.uname().nodename
    for task, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        assert parse_sums(out, host) == {task: (task, 3, [3.0, 3.0, 3.0])}, out + err
    said = [line for _, out, err in results for line in (out + err).splitlines() if NO_SECRET in line]
    assert len(said) == 1 and said[0].startswith(f"bpslaunch: {NO_SECRET}"), said
    assert NO_SECRET in results[0][2]
    plain_job.assert_nothing_left()


@needs_mpirun
@pytest.mark.timeout(60)
def test_no_secret_is_said_once_under_a_real_mpirun(plain_job):
    proc = subprocess.Popen(mpirun_argv(3) + LAUNCH + SUM_JOB,
                            env={**plain_job.env, "DMLC_PS_ROOT_PORT": str(free_port())}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    plain_job.procs.append(proc)
    proc.files = ()  # type: ignore[attr-defined]
    out, err = proc.communicate(timeout=45)
    if proc.returncode != 0 and "bpslaunch" not in err:  # mpirun itself failed before starting anything
        pytest.skip(f"mpirun does not run here: {err[-300:]}")
    assert proc.returncode == 0, out + err
    said = [line for line in (out + err).splitlines() if NO_SECRET in line]
    assert len(said) == 1 and said[0].startswith(f"bpslaunch: {NO_SECRET}"), said
    plain_job.assert_nothing_left()


# The lines of launcher_job.push_pull_forever's loop, where a Ctrl-C finds each worker.
LOOP = next(number for number, line in enumerate((JOBS / "launcher_job.py").read_text().splitlines(), 1)
            if "Ctrl-C lands here" in line)


@pytest.mark.timeout(60)
def test_ctrl_c_prints_one_line_per_worker(job):
    proc = job.start(["-np", "2", *job_command("push_pull_forever")])
    deadline = time.monotonic() + 40
    while job.output(proc)[0].count("READY") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, job.output(proc)
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the foreground group
    code, out, err = job.finish(proc)
    assert code == 128 + signal.SIGINT, out + err
    # (a worker still running when the other's exit reaches it may log that loss: not counted)
    lines = [line for line in (out + err).splitlines()
             if "READY" not in line and not re.match(r"\[\d\] \[bps_gossip worker .* was lost", line)]
    assert "Traceback" not in err, err
    assert "SIGKILL" not in err, err  # issue 46.8: the workers lived until SIGKILLed 3 s later
    for rank in range(2):
        said = [line for line in lines if line.startswith(f"[{rank}] ")]
        assert len(said) <= 1, said
        if said:  # where in the user's script (and in the library, if it was waiting there)
            assert re.match(rf"\[{rank}\] KeyboardInterrupt on rank {rank} at \S*launcher_job\.py:({LOOP}|{LOOP + 1}) ",
                            said[0]), said
    assert len(lines) <= 3, lines  # bpslaunch's "got SIGINT; stopping every process" and the workers'
    job.assert_nothing_left()


@pytest.mark.timeout(60)
def test_different_models_show_the_mismatch_with_a_short_traceback(cluster):
    job = cluster(2, 1)
    done = job.run_job("worker_process_job", "different_models", timeout=45)
    for finished in done:
        assert finished.returncode == 1, job.dump()
        # without the log lines of the engine (the other rank's exit may be logged at any time)
        err = [line for line in finished.stderr.splitlines() if not line.startswith("[bps_gossip ")]
        assert not any("DeferredInitializationError" in line or "During handling" in line for line in err), err
        end = [i for i, line in enumerate(err) if line.startswith("bps_gossip.errors.TensorMismatchError: ")]
        assert len(end) == 1 and "tensor 'parameter_dense0_weight'" in err[end[0]], err
        assert "(8, 4)" in err[end[0]] and "(9, 4)" in err[end[0]], err[end[0]]
        start = max(i for i, line in enumerate(err) if line.startswith("Traceback"))
        # from the user's frame (the scenario's; the job runner's two frames are above it)
        user = next(i for i, line in enumerate(err) if i > start and line.endswith(", in different_models"))
        assert 0 <= end[0] - user <= 14, err  # the user's line, Gluon's forward, the broadcast: nothing below


def netns_unavailable() -> str:
    """Why emulated hosts cannot run here ('' when they can): root and iproute2 (scripts/netns.py)."""
    sys.path.insert(0, str(SCRIPTS))
    import netns

    try:
        netns.check_prerequisites()
    except netns.NetnsError as exc:
        return f"emulated hosts unavailable: {exc}"
    return ""


@pytest.mark.timeout(120)
def test_bench_host_reduce_says_no_secret_once():
    """Two jobs of 6 processes on emulated hosts: 12 lines before (36 for the three kinds of job)."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    env = {name: value for name, value in os.environ.items() if not name.startswith(("BPS_GOSSIP_SECRET", "DMLC_"))}
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_host_reduce.py"), "--mbit", "1000", "--mib", "1",
                           "--steps", "1", "--what", "push_pull"], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    said = [line for line in (done.stdout + done.stderr).splitlines() if NO_SECRET in line]
    assert len(said) == 1, said
    assert "push_pull" in done.stdout, done.stdout
