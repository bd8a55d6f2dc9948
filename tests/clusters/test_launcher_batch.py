"""bpslaunch as a task of srun or mpirun, with real processes on 127.0.0.1: the tests start the
tasks themselves with the variables srun or Open MPI's mpirun would give them (and, when
``mpirun`` is installed, let a real mpirun start them). Every process carries the test's tag
(see test_launcher.Job), so whatever is left is found and killed, also when a test fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from cluster import free_port
from test_launcher import LAUNCH, SUM_JOB, Job, job_command

_LAUNCHER_PREFIXES = ("SLURM", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL")


@pytest.fixture
def job(tmp_path):
    made = Job(tmp_path)
    for name in list(made.env):  # pytest itself may run inside srun or mpirun
        if name.startswith(_LAUNCHER_PREFIXES):
            del made.env[name]
    yield made
    made.close()


def parse_sums(stdout: str, host: str) -> dict[int, tuple[int, int, list[float]]]:
    """{prefix rank: (rank, size, sum)} from SUM_JOB's lines behind ``[rank@host] ``."""
    pattern = rf"^\[(\d+)@{re.escape(host)}\] OUT (\d+) (\d+) \[(.*)\] \d+$"
    return {int(m[1]): (int(m[2]), int(m[3]), [float(v) for v in m[4].split(",")])
            for m in re.finditer(pattern, stdout, re.M)}


def slurm_task(task: int, tasks: int, port: int) -> dict[str, str]:
    """What srun gives task ``task`` of a one-node step (the test picks the port)."""
    return {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(task),
            "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
            "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "DMLC_PS_ROOT_PORT": str(port)}


def openmpi_task(rank: int, size: int, port: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank), "OMPI_MCA_ess_base_jobid": "12345",
            "DMLC_PS_ROOT_PORT": str(port)}


def run_tasks(job: Job, envs: list[dict[str, str]], command: list[str]) -> list[tuple[int, str, str]]:
    procs = [job.start(command, env) for env in envs]
    return [job.finish(proc) for proc in procs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["slurm", "openmpi"])
def test_tasks_make_one_job(job, kind):
    port = free_port()
    make = slurm_task if kind == "slurm" else openmpi_task
    results = run_tasks(job, [make(task, 3, port) for task in range(3)], SUM_JOB)
    host = "localhost" if kind == "slurm" else os.uname().nodename
    for task, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        assert parse_sums(out, host) == {task: (task, 3, [3.0, 3.0, 3.0])}, out + err
        assert "Traceback" not in err
    assert f"scheduler at 127.0.0.1:{port}" in results[0][2]
    assert "no job secret" not in results[0][2]  # FAST_ENV gives one
    job.assert_nothing_left()  # the scheduler and the server ended with the workers


@pytest.mark.timeout(60)
def test_task_zero_serves_until_every_worker_is_done(job):
    port = free_port()
    command = job_command("rank_zero_done_first")  # the others 2 s later
    procs = [job.start(command, slurm_task(task, 3, port)) for task in range(3)]
    deadline = time.monotonic() + 30
    while "[0@localhost] DONE" not in job.output(procs[0])[0]:
        assert time.monotonic() < deadline and procs[0].poll() is None, job.output(procs[0])
        time.sleep(0.05)
    time.sleep(1.0)
    assert procs[0].poll() is None, "task 0 ended while the other workers still needed its scheduler"
    assert procs[2].poll() is None
    for proc in procs:
        code, out, err = job.finish(proc)
        assert code == 0, out + err
    job.assert_nothing_left()


@pytest.mark.timeout(60)
def test_a_failed_worker_ends_every_task(job):
    port = free_port()
    results = run_tasks(job, [slurm_task(task, 3, port) for task in range(3)], job_command("rank_one_fails_after_push"))
    codes = [code for code, _, _ in results]
    assert codes[1] == 3, results[1]
    assert codes[0] != 0 and codes[2] != 0, results  # the survivors see the loss
    assert "PeerLostError" in results[0][2]
    job.assert_nothing_left()


@pytest.mark.timeout(30)
def test_no_batch_env_and_dmlc_role_keep_bytepsmode(job):
    env = {**slurm_task(0, 3, free_port()), "SLURM_JOB_ID": "77"}
    script = job.script("import os; print('ROLE', os.environ.get('DMLC_ROLE'), os.environ.get('BYTEPS_LOCAL_SIZE'))")
    code, out, err = job.finish(job.start(["--no-batch-env", sys.executable, script], env))
    assert (code, out.strip()) == (0, "ROLE None 1"), out + err  # BytePS mode: one worker, as before
    code, out, err = job.finish(job.start([sys.executable, script], {**env, "DMLC_ROLE": "worker"}))
    assert (code, out.strip()) == (0, "ROLE worker 1"), out + err
    del env["SLURM_STEP_ID"]  # a batch script, not an srun step
    code, out, err = job.finish(job.start([sys.executable, script], env))
    assert (code, out.strip()) == (0, "ROLE None 1"), out + err
    assert "not in an srun step" in err
    job.assert_nothing_left()


@pytest.mark.timeout(30)
def test_bad_layout_is_a_clear_error(job):
    env = {**openmpi_task(1, 4, free_port()), "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    code, out, err = job.finish(job.start([sys.executable, "-c", "pass"], env))
    assert code == 2 and "DMLC_PS_ROOT_URI is not set" in err and "mpirun -x DMLC_PS_ROOT_URI=host1" in err, err


MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (apt-get install openmpi-bin)")


def mpirun_argv(count: int) -> list[str]:
    argv = [MPIRUN or "mpirun", "--oversubscribe", "-np", str(count)]
    if os.geteuid() == 0:
        argv.insert(1, "--allow-run-as-root")
    return argv


@needs_mpirun
@pytest.mark.timeout(60)
def test_real_mpirun(job):
    check = subprocess.run(mpirun_argv(1) + [sys.executable, "-c", (
        "import os; from bps_gossip.launch import batch; p = batch.layout(os.environ); "
        "print('LAYOUT', p.manager, p.size, p.root_port is not None)")],
        env=job.env, capture_output=True, text=True, timeout=30)
    if "LAYOUT" not in check.stdout:
        pytest.skip(f"mpirun does not run here: {check.stdout[-300:]} {check.stderr[-300:]}")
    assert "LAYOUT openmpi 1 True" in check.stdout  # a port derives from what the real mpirun exports
    proc = subprocess.Popen(mpirun_argv(3) + LAUNCH + SUM_JOB,
                            env={**job.env, "DMLC_PS_ROOT_PORT": str(free_port())}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    job.procs.append(proc)
    proc.files = ()  # type: ignore[attr-defined]
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, out + err
    found = parse_sums(out, os.uname().nodename)
    assert found == {rank: (rank, 3, [3.0, 3.0, 3.0]) for rank in range(3)}, out + err
    job.assert_nothing_left()


def slurm_usable() -> str:
    """Why a real srun cannot run here ('' when it can): srun installed and a controller answering."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "srun is not installed (scripts/slurm_local.sh sets up a one-node Slurm)"
    conf = os.environ.get("SLURM_CONF", "")
    if not conf or not os.path.isfile(conf):
        # Without a configuration file Slurm's tools look their controller up in DNS: no probe
        # leaves this machine, so only a deliberately set SLURM_CONF (slurm_local.sh's) is tried.
        return "SLURM_CONF names no configuration file (scripts/slurm_local.sh sets up a one-node Slurm)"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "sinfo does not answer"
    if done.returncode != 0 or not re.search(r"idle|mixed|allocated", done.stdout):
        return f"no usable Slurm node: {(done.stdout + done.stderr).strip()[-200:]}"
    return ""


@pytest.mark.timeout(90)
def test_real_srun(job):
    why = slurm_usable()
    if why:
        pytest.skip(why)
    port = free_port()  # srun passes the environment on to every task
    env = {**job.env, "DMLC_PS_ROOT_PORT": str(port)}
    if os.environ.get("SLURM_CONF"):
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    proc = subprocess.Popen(["srun", "-n", "3", "-O", "--kill-on-bad-exit=1", *LAUNCH, *SUM_JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    job.procs.append(proc)
    proc.files = ()  # type: ignore[attr-defined]
    out, err = proc.communicate(timeout=75)
    assert proc.returncode == 0, out + err
    node = re.search(r"^\[0@([^\]]+)\] OUT", out, re.M)
    assert node, out + err
    assert parse_sums(out, node[1]) == {rank: (rank, 3, [3.0, 3.0, 3.0]) for rank in range(3)}, out + err
    assert f"slurm task 0 of 3: 1 node(s), 1 server(s), scheduler at 127.0.0.1:{port}" in err
    job.assert_nothing_left()


@pytest.mark.timeout(30)
def test_a_scheduler_port_in_use_is_named_with_what_to_do(tmp_path):
    """Issue 23, item 5: every task of a step derives the same scheduler port, so the scheduler
    cannot move to another one alone; when the port is taken (another job or step on the node) it
    says which port and what to set, and exits 2 at once."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "BPS_GOSSIP_SECRET": "0123456789abcdef" * 2}
        done = subprocess.run([sys.executable, "-m", "bps_gossip.scheduler"], env=env, capture_output=True,
                              text=True, timeout=20)
    assert done.returncode == 2, done.stderr
    assert f"(127.0.0.1:{port})" in done.stderr and "export DMLC_PS_ROOT_PORT=<a free port>" in done.stderr, done.stderr
