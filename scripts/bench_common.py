"""Shared plumbing of the benchmarks: clusters of real processes on 127.0.0.1, a line
protocol between the driver and its workers, and table/JSON helpers.

Every benchmarked *system* (ours, MXNet's dist_sync, ...) gets its own scheduler,
servers and worker processes, all alive for a whole cluster configuration. The
driver sends the same JSON command to every worker of one system, then reads one
JSON reply from each; systems that are not being driven sit blocked on stdin and
cost no CPU. That is what lets the benchmarks interleave systems pass by pass and
still give each system its own environment (one System line per variant).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Dict, Tuple

from bps_gossip import placement
from bps_gossip.compat import zip_exact
from bps_gossip.launch.local import free_port
from bps_gossip.launch.sessions import kill_groups, start_in_session

REPLY_PREFIX = "@@BENCH "  # marks protocol lines: MXNet and ps-lite may print to stdout too
STARTUP_TIMEOUT = 180.0  # seconds for a cluster to come up (import mxnet x N on 2 cores)


class BenchError(RuntimeError):
    """A failed benchmark: wrong result, dead process or timeout. Aborts the run."""


@dataclasses.dataclass(frozen=True)
class System:
    """One column of the results: how to start its cluster and what its workers run.

    ``kind`` is 'bps' (our scheduler/servers, workers through mxnet_plugin), 'mxnet'
    (ps-lite scheduler/servers started by ``import mxnet``) or 'local' (workers only, no
    communication: the ceiling the others are measured against). ``env`` goes to every
    process of the system, so a variant such as ``BPS_GOSSIP_SHM=0`` is one more line.
    ``mode`` is a free-form worker setting (e.g. the trainer mode).
    """

    name: str
    kind: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    mode: str = ""


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """Workers and servers of one configuration, written like '2w1s'."""

    workers: int
    servers: int

    @property
    def label(self) -> str:
        """Short label for tables."""
        return f"{self.workers}w{self.servers}s"


def parse_configs(text: str, min_workers: int = 2) -> list[ClusterShape]:
    """'2w1s,4w1s' (or '2x1,4x1') -> shapes (``min_workers``: 1 for a lone worker whose
    communication is forced through a local server)."""
    shapes = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        body = item.replace("w", "x").replace("s", "").replace("xx", "x")
        try:
            workers, servers = (int(v) for v in body.split("x"))
        except ValueError:
            raise SystemExit(f"bad configuration {item!r}: use e.g. 2w1s or 2x1") from None
        if workers < min_workers or servers < 1:
            raise SystemExit(f"bad configuration {item!r}: needs >= {min_workers} workers and >= 1 server")
        shapes.append(ClusterShape(workers, servers))
    return shapes


_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'4K', '64KiB', '1M', '4096' -> bytes (powers of 1024)."""
    raw = text.strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise SystemExit(f"bad size {text!r}: use e.g. 4K, 64K, 1M, 16M")
    return int(digits) * _UNITS[unit]


def format_size(nbytes: int) -> str:
    """Bytes -> '4 KiB', '16 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"



def median(values: Sequence[float]) -> float:
    """Median (the machine has noisy CPU steal: medians, not means)."""
    return float(statistics.median(values))


def shm_understood() -> bool:
    """True once bps_gossip's config parses BPS_GOSSIP_SHM (the shared-memory data path)."""
    import bps_gossip.config as config

    return "BPS_GOSSIP_SHM" in Path(config.__file__).read_text()


def horovod_note() -> str | None:
    """None when horovod.mxnet imports, else why the Horovod column is skipped."""
    try:
        import horovod.mxnet  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising anything
        return f"Horovod skipped: horovod.mxnet is not importable ({type(exc).__name__}: {exc})"
    return "Horovod skipped: horovod.mxnet imports, but this benchmark does not launch Horovod jobs yet"


# -- CPU by thread ------------------------------------------------------------------------
# Where a process's CPU went, thread by thread: /proc/<pid>/task/<tid>/stat names the thread
# (the OS name: ours are set by bps_gossip.thread_names, libzmq names its own) and holds its
# utime + stime in clock ticks (10 ms); schedstat's first field is the same time on a CPU in
# nanoseconds, used where the kernel has it.

COMM_THREAD_PREFIXES = ("bpsg-", "ZMQbg/")  # bps_gossip's threads, and ZeroMQ's I/O and reaper threads
CPU_CLASSES = ("compute", "comm", "other")
_TICK_SECONDS = 1.0 / os.sysconf("SC_CLK_TCK")

ThreadTimes = Dict[int, Tuple[str, float]]  # tid -> (OS thread name, CPU seconds so far)


def parse_stat(text: str) -> tuple[str, float]:
    """One /proc/<pid>/task/<tid>/stat line -> (thread name, utime + stime in seconds)."""
    head, _, rest = text.rpartition(")")  # the name may hold spaces and ')': it ends at the last ')'
    fields = rest.split()  # fields[0] is field 3 (state): utime and stime are fields 14 and 15
    return head.partition("(")[2], (int(fields[11]) + int(fields[12])) * _TICK_SECONDS


def parse_schedstat(text: str) -> float:
    """/proc/<pid>/task/<tid>/schedstat -> seconds on a CPU (its first field, in nanoseconds)."""
    return int(text.split()[0]) / 1e9


def _schedstat_readable() -> bool:
    try:
        parse_schedstat(Path(f"/proc/self/task/{os.getpid()}/schedstat").read_text())
    except (OSError, ValueError, IndexError):
        return False
    return True


CPU_SOURCE = "schedstat" if _schedstat_readable() else "stat"  # what read_threads reads the time from


def read_threads(pid: int | str = "self") -> ThreadTimes:
    """Every live thread of ``pid``: tid -> (OS name, CPU seconds so far); {} once it has exited.
    A thread that ends between the listing and the reading is left out."""
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        try:
            with open(f"{base}/{tid}/stat") as stat:
                name, seconds = parse_stat(stat.read())
            if CPU_SOURCE == "schedstat":
                with open(f"{base}/{tid}/schedstat") as sched:
                    seconds = parse_schedstat(sched.read())
        except (OSError, ValueError, IndexError):
            continue
        threads[int(tid)] = (name, seconds)
    return threads


def process_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads together (0.0 once it has exited)."""
    return sum(seconds for _, seconds in read_threads(pid).values())


def named_comm_threads(threads: ThreadTimes) -> set[int]:
    """The threads whose OS name says they communicate: bps_gossip's and ZeroMQ's."""
    return {tid for tid, (name, _) in threads.items() if name.startswith(COMM_THREAD_PREFIXES)}


def classify_thread(name: str, tid: int, main_name: str, comm_tids: Collection[int]) -> str:
    """'comm' for a thread of the communication library (``comm_tids``: named as ours or
    ZeroMQ's, or started by MXNet's ``kv.create``), 'compute' for one under the process's own
    name ``main_name`` (the Python main thread; MXNet's engine and OpenMP threads inherit it),
    'other' for the rest (e.g. a thread started by one of ours, which inherits our name)."""
    if tid in comm_tids:
        return "comm"
    return "compute" if name == main_name else "other"


def cpu_split(before: ThreadTimes, after: ThreadTimes, main_name: str, comm_tids: Collection[int]) -> dict[str, float]:
    """CPU seconds by class (CPU_CLASSES) between two readings of one process. A thread born
    in between counts from zero; one that ended in between is missing (its time is lost)."""
    split = dict.fromkeys(CPU_CLASSES, 0.0)
    for tid, (name, seconds) in after.items():
        start = before[tid][1] if tid in before else 0.0
        split[classify_thread(name, tid, main_name, comm_tids)] += max(0.0, seconds - start)
    return split


class ThreadClock:
    """This process's CPU by class of thread over the timed parts of a run."""

    def __init__(self) -> None:
        self.main_name = read_threads().get(os.getpid(), ("", 0.0))[0]
        self.comm_tids: set[int] = set()
        self._start: ThreadTimes = {}

    def start(self) -> None:
        """Read every thread's time now."""
        self._start = read_threads()

    def stop(self) -> dict[str, float]:
        """CPU seconds by class since :meth:`start`."""
        return cpu_split(self._start, read_threads(), self.main_name, self.comm_tids)

    def names(self) -> dict[str, dict[str, int]]:
        """How many live threads of each name each class has, for the record."""
        classes: dict[str, dict[str, int]] = {cls: {} for cls in CPU_CLASSES}
        for tid, (name, _) in read_threads().items():
            counts = classes[classify_thread(name, tid, self.main_name, self.comm_tids)]
            counts[name] = counts.get(name, 0) + 1
        return classes


def threads_per_worker(spec: str, workers: int, cores: int | None = None) -> int:
    """OMP threads per worker from ``--threads``: a count, or 'auto' = the cores this process
    may run on (os.sched_getaffinity) divided among ``workers``, at least 1."""
    if spec.strip().lower() == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // workers)
    try:
        threads = int(spec)
    except ValueError:
        raise SystemExit(f"bad --threads value {spec!r}: use a count such as 8, or auto (cores / workers)") from None
    if threads < 1:
        raise SystemExit(f"bad --threads value {spec!r}: at least 1 thread per worker")
    return threads


# -- processes ----------------------------------------------------------------------------

class Job:
    """Every process of a benchmark run, each in its own session; ``close`` kills them all."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], env: dict[str, str], name: str, pipes: bool = False) -> subprocess.Popen:
        """Start ``argv``; stderr (and stdout unless ``pipes``) go to files in logdir."""
        err = open(self.logdir / f"{name}.err", "w")
        out: Any = subprocess.PIPE if pipes else open(self.logdir / f"{name}.out", "w")
        proc = start_in_session(argv, env, stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                                stdout=out, stderr=err)
        proc.bench_name = name  # type: ignore[attr-defined]
        proc.bench_err = self.logdir / f"{name}.err"  # type: ignore[attr-defined]
        err.close()  # the child holds its own copy
        if not pipes:
            out.close()
        self.procs.append(proc)
        return proc

    def close(self, procs: Iterable[subprocess.Popen] | None = None, grace: float = 15.0) -> None:
        """Wait up to ``grace`` seconds for ``procs`` (default: all) to exit, then killpg the rest."""
        chosen = list(self.procs if procs is None else procs)
        kill_groups(chosen, grace)
        for proc in chosen:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:  # a dead worker's stdin: the unflushed 'exit' cannot go anywhere
                        pass
        self.procs = [p for p in self.procs if p not in chosen]


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def base_env(extra: dict[str, str | None]) -> dict[str, str]:
    """This process's environment plus ``extra`` (None: unset); Python output unbuffered."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    return {name: value for name, value in env.items() if value is not None}


class WorkerGroup:
    """One system's cluster: scheduler, servers and workers that obey JSON commands."""

    def __init__(self, job: Job, system: System, shape: ClusterShape, worker_argv: list[str],
                 network: Any = None) -> None:
        self.job = job
        self.system = system
        self.shape = shape
        self.network = network
        port = free_port()  # with a network: used inside the scheduler's private namespace only
        common = {"DMLC_NUM_WORKER": str(shape.workers), "DMLC_NUM_SERVER": str(shape.servers),
                  "DMLC_PS_ROOT_URI": self._address("scheduler"), "DMLC_PS_ROOT_PORT": str(port),
                  "DMLC_NODE_HOST": "127.0.0.1", **system.env}
        if system.kind == "mxnet":
            common["DMLC_INTERFACE"] = "lo" if network is None else network.interface
            role_argv = {role: [sys.executable, "-c", "import mxnet"] for role in ("scheduler", "server")}
        elif system.kind == "bps":
            role_argv = {role: [sys.executable, "-m", f"bps_gossip.{role}"] for role in ("scheduler", "server")}
            if shape.workers == 1:  # alone it would not communicate: through its server, as MXNet's dist_sync
                common["BYTEPS_FORCE_DISTRIBUTED"] = "1"
        elif system.kind == "local":
            role_argv = {}  # workers that never communicate: no scheduler, no servers
        else:
            raise BenchError(f"unknown system kind {system.kind!r}")
        tag = f"{shape.label}_{system.name.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')}"
        # A system that names BPS_GOSSIP_COMM_CORES is placed as bpslaunch -np places a job: every
        # process starts on its cores (before MXNet loads), the scheduler and servers on the reserved ones.
        self.plan = None
        if placement.COMM_CORES_VAR in system.env and network is None and system.kind == "bps":
            self.plan = placement.plan_here(shape.workers, base_env(common), placement.options(common))
        self.support = []
        if role_argv:
            self.support.append(job.spawn(*self._placed("scheduler", role_argv["scheduler"], common),
                                          f"{tag}_scheduler"))
            self.support += [job.spawn(*self._placed(f"server{i}", role_argv["server"], common), f"{tag}_server{i}")
                             for i in range(shape.servers)]
        self.workers = [
            job.spawn(*self._placed(f"worker{i}", [*worker_argv, "--worker-kind", system.kind,
                                                   "--worker-mode", system.mode], common),
                      f"{tag}_worker{i}", pipes=True)
            for i in range(shape.workers)
        ]
        self.buffers = {proc.pid: b"" for proc in self.workers}

    def support_cpu(self) -> dict[str, float]:
        """CPU seconds so far of the scheduler and of the servers together ({} without them)."""
        if not self.support:
            return {}
        return {"scheduler": process_cpu(self.support[0].pid),
                "servers": sum(process_cpu(proc.pid) for proc in self.support[1:])}

    def _address(self, host: str) -> str:
        return "127.0.0.1" if self.network is None else self.network.address(host)

    def _placed(self, host: str, argv: list[str], common: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the process on ``host`` ('scheduler', 'server1', 'worker0', ...):
        on 127.0.0.1, or inside that host's namespace advertising its own address."""
        role = host.rstrip("0123456789")
        env = {**common, "DMLC_ROLE": role, "DMLC_NODE_HOST": self._address(host)}
        if role == "worker":
            env["DMLC_WORKER_ID"] = host[len("worker"):]
        if self.plan is not None:
            env.update(placement.worker_env(self.plan, int(env["DMLC_WORKER_ID"])) if role == "worker"
                       else placement.service_env(self.plan))
        return (argv if self.network is None else self.network.exec_argv(host, argv)), base_env(env)

    def command(self, message: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Send ``message`` to every worker; return their replies, in worker order.

        Raises BenchError when a worker reports an error, dies, or does not answer in time.
        """
        line = (json.dumps(message) + "\n").encode()
        for proc in self.workers:
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except BrokenPipeError:
                raise self._dead(proc, f"while sending {message['cmd']!r}") from None
        deadline = time.monotonic() + timeout
        replies = [self._read_reply(proc, deadline, message["cmd"]) for proc in self.workers]
        errors = [(i, r["error"]) for i, r in enumerate(replies) if "error" in r]
        if errors:
            index, text = errors[0]
            raise BenchError(f"{self.system.name} ({self.shape.label}) worker {index} failed "
                             f"on {message['cmd']!r}:\n{text}")
        return replies

    def _read_reply(self, proc: subprocess.Popen, deadline: float, what: str) -> dict[str, Any]:
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                buf = self.buffers[proc.pid]
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    self.buffers[proc.pid] = buf
                    text = raw.decode(errors="replace")
                    if text.startswith(REPLY_PREFIX):
                        return json.loads(text[len(REPLY_PREFIX):])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"{self.system.name} ({self.shape.label}) worker pid {proc.pid} did not "
                                     f"answer {what!r} in time; its stderr ends with:\n{tail(proc.bench_err)}")
                if sel.select(min(left, 1.0)):
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        raise self._dead(proc, f"while waiting for {what!r}")
                    self.buffers[proc.pid] = buf + chunk

    def _dead(self, proc: subprocess.Popen, when: str) -> BenchError:
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
        return BenchError(f"{self.system.name} ({self.shape.label}) worker {proc.bench_name} exited "
                          f"(rc={proc.poll()}) {when}; stderr ends with:\n{tail(proc.bench_err)}")

    def close(self) -> None:
        """Ask the workers to leave, let the servers exit by themselves, kill what remains."""
        for proc in self.workers:
            try:
                proc.stdin.write(b'{"cmd": "exit"}\n')
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass
        self.job.close(self.workers, grace=30.0)
        self.job.close(self.support, grace=10.0)


def start_groups(job: Job, systems: Sequence[System], shape: ClusterShape, worker_argv: list[str],
                 network: Any = None) -> list[WorkerGroup]:
    """Start every system's cluster at once (start-up overlaps) and wait until all are ready.

    ``network`` (a scripts/netns.py Network with hosts scheduler, server<i>, worker<i>) puts
    every process in its own namespace; by default all run on 127.0.0.1.
    """
    groups = [WorkerGroup(job, system, shape, worker_argv, network) for system in systems]
    for group in groups:
        group.command({"cmd": "hello"}, STARTUP_TIMEOUT)
    return groups


def install_sigterm_handler() -> None:
    """Turn SIGTERM into SystemExit so that the ``finally`` clauses kill the clusters."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# -- worker side --------------------------------------------------------------------------

def reply(value: dict[str, Any]) -> None:
    """Send one reply line to the driver."""
    sys.stdout.write(REPLY_PREFIX + json.dumps(value) + "\n")
    sys.stdout.flush()


def serve(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> int:
    """The worker loop: one JSON command per stdin line, one reply each, until 'exit' or EOF.

    An exception becomes an error reply and ends the worker (rc 1): the driver aborts.
    """
    import traceback

    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        message = json.loads(line)
        if message["cmd"] == "exit":
            return 0
        try:
            reply(handlers[message["cmd"]](message))
        except Exception:
            reply({"error": traceback.format_exc()})
            return 1


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table, right-aligned columns."""
    widths = [max(len(str(cell)) for cell in column) for column in zip_exact(headers, *rows)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip_exact(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).rjust(w) for c, w in zip_exact(row, widths)) for row in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """What was measured where: the code's location, CPUs and load (other jobs skew results)."""
    import bps_gossip

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"bps_gossip": str(Path(bps_gossip.__file__).parent), "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "usable_cpus": usable, "cpu_model": cpu_model(),
            "loadavg": list(os.getloadavg())}


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return ""


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (when given) as indented JSON."""
    if path is not None:
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"results written to {path}")
