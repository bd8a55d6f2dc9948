"""Real-process clusters on 127.0.0.1 for the tests: a scheduler, servers, workers.

Every process runs in its own session so that the whole group can be killed; the
``cluster`` fixture (conftest.py) kills whatever is left when a test ends, also on
failure. Workers run a Python snippet and report results as JSON on a line that
starts with ``RESULT `` (see :func:`report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from bps_gossip.launch.local import free_port
from bps_gossip.launch.sessions import kill_groups, start_in_session
from bps_gossip.transport import shm

FAST_ENV = {
    "BPS_GOSSIP_TIMEOUT": "10",
    "BPS_GOSSIP_HEARTBEAT_INTERVAL": "0.2",
    "BPS_GOSSIP_HEARTBEAT_TIMEOUT": "2",
    "BYTEPS_LOG_LEVEL": "WARNING",
    # A cluster whose test was killed before its workers all started ends by itself.
    "BPS_GOSSIP_START_TIMEOUT": "60",
    # Every socket authenticated and encrypted, as under bpslaunch (which makes a secret per job).
    "BPS_GOSSIP_SECRET": "tests-" + "0123456789abcdef" * 2,
}

JOBS = Path(__file__).resolve().parent / "jobs"  # the job modules the cluster tests run
PRELUDE = '''
import json, sys
def report(value):
    """Print one JSON result line for the test to read."""
    print("RESULT " + json.dumps(value), flush=True)
'''



@dataclasses.dataclass
class Finished:
    """What one worker process left behind."""

    rank_hint: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def results(self) -> list[Any]:
        """Every value the worker passed to report(), in order."""
        return [json.loads(line[7:]) for line in self.stdout.splitlines() if line.startswith("RESULT ")]

    @property
    def result(self) -> Any:
        """The single value the worker reported."""
        values = self.results
        assert len(values) == 1, f"expected one RESULT line, got {len(values)}:\n{self.stdout}\n{self.stderr}"
        return values[0]


class Cluster:
    """One job: scheduler and servers start at once; workers run a snippet."""

    def __init__(self, tmp_path: Path, workers: int, servers: int = 1, env: dict[str, str] | None = None,
                 start_servers: bool = True) -> None:
        self.tmp_path = tmp_path
        self.workers = workers
        self.servers = servers
        self.port = free_port()
        self.env = {name: value for name, value in {**os.environ, **FAST_ENV, **(env or {})}.items()
                    if value is not None}  # None: unset
        self.env.update({
            "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(self.port),
            "PYTHONUNBUFFERED": "1",
        })
        self.procs: list[subprocess.Popen] = []
        self.scheduler: subprocess.Popen | None = None
        self.server_procs: list[subprocess.Popen] = []
        if start_servers:
            self.scheduler = self.spawn_role("scheduler")
            self.server_procs = [self.spawn_role("server") for _ in range(servers)]

    def spawn(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        """Start a process in its own session, output captured to files in tmp_path."""
        out = open(self.tmp_path / f"{name}.out", "w+")
        err = open(self.tmp_path / f"{name}.err", "w+")
        proc = start_in_session(argv, env, stdout=out, stderr=err)
        proc.out_file, proc.err_file = out, err  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def spawn_role(self, role: str) -> subprocess.Popen:
        """Start a scheduler or server process."""
        env = {**self.env, "DMLC_ROLE": role}
        index = sum(1 for p in self.procs if getattr(p, "role", None) == role)
        proc = self.spawn([sys.executable, "-m", f"bps_gossip.{role}"], env, f"{role}{index}")
        proc.role = role  # type: ignore[attr-defined]
        return proc

    def start_workers(self, code: str, count: int | None = None, env: dict[str, str] | None = None,
                      per_rank_env: dict[int, dict[str, str | None]] | None = None) -> list[subprocess.Popen]:
        """Start ``count`` workers (default: all) running ``code`` with report() defined (an
        environment value of None unsets the variable). New tests use :meth:`start_job`."""
        script = self.tmp_path / f"worker_{len(self.procs)}.py"
        script.write_text(PRELUDE + textwrap.dedent(code))
        return self._start([sys.executable, str(script)], count, env, per_rank_env)

    def start_job(self, job: str, scenario: str, *args: str, count: int | None = None,
                  env: dict[str, str] | None = None,
                  per_rank_env: dict[int, dict[str, str | None]] | None = None) -> list[subprocess.Popen]:
        """Start ``count`` workers (default: all) running scenario ``scenario`` of
        tests/jobs/``job``.py with ``args`` (see tests/jobs/job_tools.py)."""
        return self._start([sys.executable, str(JOBS / f"{job}.py"), scenario, *map(str, args)], count, env,
                           per_rank_env)

    def run_job(self, job: str, scenario: str, *args: str, timeout: float = 60, **kwargs: Any) -> list[Finished]:
        """Start all workers on a job's scenario (:meth:`start_job`) and wait for them."""
        return self.wait(self.start_job(job, scenario, *args, **kwargs), timeout)

    def _start(self, argv: list[str], count: int | None, env: dict[str, str] | None,
               per_rank_env: dict[int, dict[str, str | None]] | None) -> list[subprocess.Popen]:
        procs = []
        for index in range(self.workers if count is None else count):
            worker_env = {**self.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index),
                          **(env or {}), **((per_rank_env or {}).get(index, {}))}
            worker_env = {name: value for name, value in worker_env.items() if value is not None}  # None: unset
            proc = self.spawn(argv, worker_env, f"worker{index}_{len(self.procs)}")
            proc.rank_hint = index  # type: ignore[attr-defined]
            procs.append(proc)
        return procs

    def wait(self, procs: list[subprocess.Popen], timeout: float = 60) -> list[Finished]:
        """Wait for ``procs``; return what each printed. Fails the test on a timeout."""
        deadline = time.monotonic() + timeout
        finished = []
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"process {proc.args} did not finish within {timeout} s:\n{self.dump()}") from None
            finished.append(Finished(getattr(proc, "rank_hint", -1), proc.returncode, read_output(proc.out_file),
                                     read_output(proc.err_file)))
        return finished

    def run_workers(self, code: str, timeout: float = 60, **kwargs: Any) -> list[Finished]:
        """Start all workers on ``code`` and wait for them."""
        return self.wait(self.start_workers(code, **kwargs), timeout)

    def wait_servers_exit(self, timeout: float = 15) -> None:
        """Assert that the scheduler and servers exit by themselves within ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in [p for p in (self.scheduler, *self.server_procs) if p is not None]:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{proc.role} did not exit by itself:\n{self.dump()}") from None

    def dump(self) -> str:
        """Everything every process printed, for failure messages."""
        parts = []
        for proc in self.procs:
            parts.append(f"--- {proc.args} rc={proc.poll()}\n{read_output(proc.out_file)}{read_output(proc.err_file)}")
        return "\n".join(parts)

    def kill_all(self) -> None:
        """Kill every process this cluster started (and their children)."""
        kill_groups(self.procs)

    def close(self) -> None:
        """Kill what is left, remove the job's shared memory, and close the output files."""
        self.kill_all()
        self.leftover_segments = shm.sweep(str(self.port))
        for proc in self.procs:
            proc.out_file.close()
            proc.err_file.close()


def read_output(handle: Any) -> str:
    """Everything written so far to ``handle``, a file a child process writes to. Read at
    explicit offsets: the child shares the file's offset, and a seek here would make its next
    write land over what it wrote before (a test then sees lines vanish)."""
    chunks, offset = [], 0
    while True:
        chunk = os.pread(handle.fileno(), 1 << 20, offset)
        if not chunk:
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)
        offset += len(chunk)


def results_by_rank(finished: list[Finished]) -> list[Any]:
    """Every worker's reported result (a dict with "rank"), in rank order."""
    return sorted((f.result for f in finished), key=lambda r: r["rank"])


def assert_all_ok(finished: list[Finished], cluster: Cluster) -> None:
    """Fail with every process's output unless all exited 0."""
    bad = [f for f in finished if f.returncode != 0]
    assert not bad, f"workers failed: {[(f.rank_hint, f.returncode) for f in bad]}\n{cluster.dump()}"
