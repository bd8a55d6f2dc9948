"""bpslaunch with real processes on 127.0.0.1: local mode, BytePS mode, failures, signals.

Every process a test starts carries a unique BPSL_TEST_TAG in its environment (children
inherit it), so the test can find in /proc whatever the launcher left behind, assert
that nothing is, and kill it all at teardown even when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from cluster import FAST_ENV, JOBS, Cluster, free_port, read_output

from bps_gossip.config import OWNED_SECRET_VAR
from bps_gossip.launch import cli, supervisor
from bps_gossip.launch.local import LOWEST_PORT, ephemeral_ports
from bps_gossip.launch.sessions import kill_groups

pytestmark = pytest.mark.paths  # the newest Python of .ci/pythons runs these too

LAUNCH = [sys.executable, "-m", "bps_gossip.launch"]


def job_command(scenario: str, *args: str, module: str = "launcher_job") -> list[str]:
    """The command that runs ``scenario`` of tests/jobs/``module``.py (tests/jobs/job_tools.py)."""
    return [sys.executable, str(JOBS / f"{module}.py"), scenario, *args]


SUM_JOB = job_command("sum_of_ones")  # prints OUT rank size sum pid (parse_sums)


def tagged_pids(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``BPSL_TEST_TAG=tag``."""
    needle = f"BPSL_TEST_TAG={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours
            pass
    return pids


class Job:
    """Starts bpslaunch processes for one test; output goes to files in tmp_path."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.tag = uuid.uuid4().hex
        self.env = {**os.environ, **FAST_ENV, "BPSL_TEST_TAG": self.tag, "PYTHONUNBUFFERED": "1"}
        for name in list(self.env):
            if name.startswith(("DMLC_", "BYTEPS_LOCAL")):
                del self.env[name]
        self.procs: list[subprocess.Popen] = []

    def script(self, body: str) -> str:
        path = self.tmp_path / f"script{len(self.procs)}_{uuid.uuid4().hex[:6]}.py"
        path.write_text(textwrap.dedent(body))
        return str(path)

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        name = f"launch{len(self.procs)}"
        out = open(self.tmp_path / f"{name}.out", "w+")
        err = open(self.tmp_path / f"{name}.err", "w+")
        proc = subprocess.Popen(LAUNCH + args, env={**self.env, **(env or {})}, stdout=out, stderr=err,
                                start_new_session=True)
        proc.files = (out, err)  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def output(proc: subprocess.Popen) -> tuple[str, str]:
        out, err = proc.files  # type: ignore[attr-defined]
        return read_output(out), read_output(err)

    def finish(self, proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
        """Wait for ``proc``; return its exit code, stdout and stderr."""
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"bpslaunch {proc.args} did not finish: {self.output(proc)}") from None
        return (proc.returncode, *self.output(proc))

    def assert_nothing_left(self, within: float = 3.0) -> None:
        deadline = time.monotonic() + within
        while (left := tagged_pids(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes left behind: {[_cmdline(pid) for pid in left]}"

    def close(self) -> None:
        kill_groups(self.procs)
        for proc in self.procs:
            for handle in proc.files:  # type: ignore[attr-defined]
                handle.close()
        for pid in tagged_pids(self.tag):  # whatever escaped the launcher's process groups
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid}: gone"


@pytest.fixture
def job(tmp_path):
    made = Job(tmp_path)
    yield made
    made.close()


def parse_sums(stdout: str) -> dict[int, tuple[int, int, list[float], int]]:
    """{prefix rank: (rank, size, sum, pid)} from the OUT lines of SUM_JOB."""
    found = {}
    for match in re.finditer(r"^\[(\d+)\] OUT (\d+) (\d+) (\[.*\]) (\d+)$", stdout, re.M):
        found[int(match[1])] = (int(match[2]), int(match[3]), json.loads(match[4]), int(match[5]))
    return found


def assert_pids_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 2)])
def test_local_mode_end_to_end(job, workers, servers):
    args = ["-np", str(workers)] + (["--num-servers", str(servers)] if servers != 1 else [])
    code, out, err = job.finish(job.start(args + SUM_JOB))
    assert code == 0, out + err
    found = parse_sums(out)
    assert sorted(found) == list(range(workers)), out + err
    for prefix, (rank, size, total, _) in found.items():
        assert (rank, size, total) == (prefix, workers, [float(workers)] * 3)
    assert "Traceback" not in err
    assert_pids_gone([pid for *_, pid in found.values()])
    job.assert_nothing_left()  # the scheduler and servers too


@pytest.mark.timeout(30)
@pytest.mark.parametrize("separator", [[], ["--"]])
def test_single_worker_runs_alone_and_keeps_its_flags(job, separator):
    code, out, err = job.finish(job.start(["-np", "1", *separator, *job_command("sum_then_argv"),
                                           "--flag", "-np", "7", "--", "x"]))
    assert code == 0, out + err
    assert parse_sums(out)[0][:3] == (0, 1, [1.0, 1.0, 1.0])
    assert "[0] ARGV ['--flag', '-np', '7', '--', 'x']" in out
    assert "scheduler" not in out + err  # no scheduler, no server
    job.assert_nothing_left()


@pytest.mark.timeout(30)
def test_progress_bars_stay_whole_behind_their_prefix(job):
    code, out, err = job.finish(job.start(["-np", "2", *job_command("progress_bars")]))
    assert code == 0, out + err
    lines = err.splitlines()  # the captured file reads '\r' as a line end too
    for rank in range(2):
        assert [line for line in lines if line.startswith(f"[{rank}] progress")] == \
            [f"[{rank}] progress {step}/3" for step in range(1, 4)], repr(err)
        assert f"[{rank}] done" in out.splitlines()
    assert all(line.startswith(("[0] ", "[1] ", "bpslaunch")) for line in lines if line), repr(err)


@pytest.mark.timeout(30)
def test_output_dir_and_timestamps(job, tmp_path):
    logs = tmp_path / "logs"
    code, out, err = job.finish(job.start(["--output-dir", str(logs), "--timestamps", "-np", "2", *SUM_JOB]))
    assert code == 0, out + err
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "server0.log", "worker0.log", "worker1.log"]
    for rank in range(2):
        own = (logs / f"worker{rank}.log").read_text()
        assert own.startswith(f"OUT {rank} 2 [2.0, 2.0, 2.0]"), own  # the process's own lines, no prefix
    assert re.search(r"^\d\d:\d\d:\d\d \[0\] OUT 0 2", out, re.M), out


@pytest.mark.timeout(30)
def test_mode_flag_sets_the_trainer_default(job):
    # it registers: workers that never do fail the job (tests/clusters/test_launch_failures.py)
    code, out, err = job.finish(job.start(["--mode", "allreduce", "-np", "2", *job_command("print_mode")]))
    assert code == 0 and out.count("MODE allreduce") == 2, out + err
    code, out, err = job.finish(job.start(["--mode", "fast", "-np", "2", *job_command("print_mode")]))
    assert code == 2 and "invalid choice: 'fast'" in err, out + err


@pytest.mark.timeout(120)
def test_the_example_follows_the_mode_flag(job):
    """Issue 23, item 8: `bpslaunch --mode allreduce ... examples/train_digits.py` trained with
    gossip (the example's own --mode default); it follows BPS_GOSSIP_MODE now."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
    code, out, err = job.finish(job.start(["--mode", "allreduce", "-np", "2", sys.executable, str(example),
                                           "--epochs", "1", "--hidden", "16"]), timeout=100)
    assert code == 0 and out.count("final test accuracy (allreduce, 2 workers") == 2, out + err


@pytest.mark.timeout(30)
def test_failing_worker_stops_the_job(job):
    start = time.monotonic()
    code, out, err = job.finish(job.start(["-np", "2", *job_command("rank_one_exits")]))
    assert code == 3, out + err
    assert time.monotonic() - start < 15
    assert "worker 1" in err and "code 3" in err
    assert_pids_gone([int(pid) for pid in re.findall(r"^\[\d\] PID (\d+)$", out, re.M)])
    job.assert_nothing_left()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_everything(job, sig):
    # Rank 0 ignores SIGINT and SIGTERM on the SIGTERM run: the launcher must escalate to SIGKILL.
    proc = job.start(["-np", "2", *job_command("ready_until_signal", str(int(sig == signal.SIGTERM)))])
    deadline = time.monotonic() + 20
    while job.output(proc)[0].count("READY") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, job.output(proc)
        time.sleep(0.1)
    os.kill(proc.pid, sig)
    code, out, err = job.finish(proc, timeout=15)
    assert code == 128 + sig, out + err
    assert_pids_gone([int(pid) for pid in re.findall(r"READY (\d+)", out)])
    if sig == signal.SIGTERM:  # said, with whom: the escalation is no accident
        assert "worker 0 still running 3 s after SIGTERM: SIGKILL" in err, err
    else:  # a worker that exits on the signal is never SIGKILLed
        assert "SIGKILL" not in err, err
    job.assert_nothing_left()


@pytest.mark.timeout(60)
def test_byteps_mode_end_to_end(job):
    port = free_port()
    env = {"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": str(port)}
    scheduler = job.start([], {**env, "DMLC_ROLE": "scheduler"})
    server = job.start([], {**env, "DMLC_ROLE": "server"})
    worker = job.start(SUM_JOB, {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_SIZE": "2"})
    code, out, err = job.finish(worker)
    assert code == 0, out + err
    found = parse_sums(out)
    assert {prefix: value[:3] for prefix, value in found.items()} == {
        0: (0, 2, [2.0] * 3), 1: (1, 2, [2.0] * 3)}, out + err
    for proc in (scheduler, server):  # they exit by themselves once the workers are gone
        code, out, err = job.finish(proc, timeout=10)
        assert code == 0, out + err
    job.assert_nothing_left()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("env,args,variable", [
    ({"DMLC_ROLE": "bogus"}, [], "DMLC_ROLE"),
    ({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "abc"}, ["python", "x.py"], "DMLC_NUM_WORKER"),
    ({"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "2"}, [], "DMLC_PS_ROOT_PORT"),
    ({"DMLC_ROLE": "worker", "BYTEPS_LOCAL_SIZE": "0"}, ["python", "x.py"], "BYTEPS_LOCAL_SIZE"),
    ({"DMLC_ROLE": "worker"}, [], "no command"),
    ({}, ["--num-servers", "2", "python", "x.py"], "-np"),
    ({"BPS_GOSSIP_TIMEOUT": "soon"}, ["-np", "2", "python", "x.py"], "BPS_GOSSIP_TIMEOUT"),
    ({}, ["-np", "2", "no-such-command-here"], "no-such-command-here"),
])
def test_bad_environment_is_a_clear_error(job, env, args, variable):
    start = time.monotonic()
    code, out, err = job.finish(job.start(args, env), timeout=15)
    assert code != 0
    assert variable in err, err
    assert time.monotonic() - start < 10
    job.assert_nothing_left()


def test_help_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for word in ("-np", "--num-servers", "DMLC_ROLE", "BYTEPS_LOCAL_SIZE", "Exit status"):
        assert word in text
    assert supervisor.exit_code(-signal.SIGKILL) == 137 and supervisor.exit_code(3) == 3


@pytest.mark.timeout(60)
def test_sigkill_of_bpslaunch_leaves_no_process_and_no_secret(job):
    """Issue 22, item 7: SIGKILL gives bpslaunch no time to stop anyone; the kernel's
    parent-death signal does, and the scheduler removes the secret file bpslaunch made."""
    job.env.pop("BPS_GOSSIP_SECRET", None)  # bpslaunch makes one, in a file
    proc = job.start(["-np", "2", *job_command("ready_with_secret_file")])
    deadline = time.monotonic() + 30
    while job.output(proc)[0].count("READY") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, job.output(proc)
        time.sleep(0.1)
    ready = re.findall(r"READY (\d+) (\S+)", job.output(proc)[0])
    secret = Path(ready[0][1])
    assert secret.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while (tagged_pids(job.tag) or secret.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, _ in ready:  # gone, or a zombie nobody reaps (bpslaunch, their parent, is dead)
        assert _state(int(pid)) in ("gone", "Z"), pid
    job.assert_nothing_left()
    assert not secret.exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum,removed", [(signal.SIGTERM, False), (signal.SIGHUP, True)])
def test_the_scheduler_removes_the_secret_only_when_its_launcher_died(tmp_path, signum, removed):
    """CI, 1 run in about 9: the scheduler removed bpslaunch's secret file as an elastic job
    ended, and a replacement bpslaunch had just started read a missing file (a traceback). An
    ordinary stop (SIGTERM) leaves the file to bpslaunch, which removes it after its last worker;
    SIGHUP, the parent-death signal bpslaunch arms, means bpslaunch was killed."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    cluster = Cluster(tmp_path, workers=1, start_servers=False,
                      env={"BPS_GOSSIP_SECRET": None, "BPS_GOSSIP_SECRET_FILE": str(secret),
                           OWNED_SECRET_VAR: "1"})
    try:
        proc = cluster.spawn_role("scheduler")
        deadline = time.monotonic() + 20
        while not _listening(cluster.port):  # its handlers are set before it binds
            assert proc.poll() is None and time.monotonic() < deadline, cluster.dump()
            time.sleep(0.1)
        proc.send_signal(signum)
        assert proc.wait(10) == 128 + signum, cluster.dump()
        assert secret.exists() != removed, cluster.dump()
    finally:
        cluster.close()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


@pytest.mark.timeout(30)
def test_a_bad_variable_leaves_no_secret_file(job):
    """Issue 23, item 10: exit status 2 left the secret file bpslaunch had already written."""
    job.env.pop("BPS_GOSSIP_SECRET", None)  # bpslaunch makes one, in a file
    before = set(Path(tempfile.gettempdir()).glob("bpsg_secret_*"))
    code, out, err = job.finish(job.start(["-np", "2", sys.executable, job.script("print(1)\n")],
                                          env={"BPS_GOSSIP_TIMEOUT": "abc"}))
    assert code == 2 and "BPS_GOSSIP_TIMEOUT" in err, out + err
    assert set(Path(tempfile.gettempdir()).glob("bpsg_secret_*")) == before


def test_free_port_is_never_one_the_kernel_hands_out_for_port_0():
    """CI, Python 3.13: free_port() returned a port the kernel had handed out for a probe's port 0;
    a server started beside the scheduler bound port 0 and got it first, then answered the workers'
    registrations ('unknown op register') while the scheduler could not bind. Below the ephemeral
    range no port-0 bind can take it."""
    low, high = ephemeral_ports()
    picks = {free_port() for _ in range(50)}
    assert all(LOWEST_PORT <= port < low for port in picks), (sorted(picks), low, high)
    assert len(picks) > 10  # spread over the range, not one port every time
    for port in list(picks)[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when picked


@pytest.mark.timeout(30)
def test_bpslaunch_removes_what_a_killed_worker_left_in_shared_memory_and_says_how_much(capsys):
    """Issue 46.12: a SIGKILLed worker cannot unlink its segments; bpslaunch, which started it and
    knows its pid, removes exactly that process's segments of that job, and says how many."""
    port = free_port()
    makes = ("import os, sys, time; from pathlib import Path\n"
             "for i in range(2): Path(f'/dev/shm/bpsg_{sys.argv[1]}_{os.getpid()}_t{i}').write_bytes(b'x')\n"
             "print('MADE', flush=True); time.sleep(60)\n")
    other = Path(f"/dev/shm/bpsg_{port}_1_kept")  # another process's segment of the same job: not its
    other.write_bytes(b"x")
    try:
        with supervisor.Supervisor() as sup:
            child = sup.start([sys.executable, "-c", makes, str(port)], {**os.environ, "DMLC_PS_ROOT_PORT": str(port)},
                              "worker", "worker 7", "[7] ")
            made = sorted(Path("/dev/shm").glob(f"bpsg_{port}_{child.proc.pid}_*"))
            deadline = time.monotonic() + 20
            while len(made) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
                made = sorted(Path("/dev/shm").glob(f"bpsg_{port}_{child.proc.pid}_*"))
            assert len(made) == 2
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
            assert sup.reap() == [child]
            assert not any(path.exists() for path in made) and other.exists()
        err = capsys.readouterr().err
        assert (f"bpslaunch: removed 2 shared-memory segment(s) that worker 7 (pid {child.proc.pid}, "
                "code 137 (killed by SIGKILL)) left in /dev/shm") in err, err
    finally:
        other.unlink(missing_ok=True)


def test_bpslaunch_mode_beside_byteps_enable_async_names_the_flag(monkeypatch, capsys):
    """Issue 46.9: the error named BPS_GOSSIP_MODE, a variable the user never set (--mode did);
    bpslaunch now refuses the pair itself, before starting anything, naming --mode."""
    monkeypatch.setenv("BYTEPS_ENABLE_ASYNC", "1")
    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    assert cli.main(["-np", "2", "--mode", "allreduce", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "bpslaunch: --mode allreduce conflicts with BYTEPS_ENABLE_ASYNC=1" in err and "BPS_GOSSIP_MODE" not in err
