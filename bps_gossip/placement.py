"""Where a job's threads run on a host where every core computes (DESIGN.md, "Placement";
docs/placement.md).

A worker's OpenMP team waits at every parallel region for its slowest thread: a communication
thread (the engine's, ZeroMQ's I/O threads, a local server, the scheduler) waking on one of its
cores stalls the whole team. So, as oneCCL (CCL_WORKER_AFFINITY) and Horovod (HOROVOD_THREAD_AFFINITY)
do, bpslaunch -np reserves cores for communication and gives compute the rest, from the cores it
may use and the workers it starts: :func:`plan` (pure) decides; each process starts on its cores
(:func:`start_on_cpus`, the supervisor's preexec); ``bps.init()`` moves the worker's communication
threads and logs the plan (:func:`place_worker`), or, started another way, plans for itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from .errors import ConfigError
from .openmp_settings import THREAD_VARS, user_threads, wait_policy

COMM_CORES_VAR = "BPS_GOSSIP_COMM_CORES"  # auto (default) or a number of cores; 0: reserve none
AFFINITY_VAR = "BPS_GOSSIP_AFFINITY"  # 0: pin nothing (thread counts still follow the plan)
PLACED_VAR = "BPS_GOSSIP_PLACED"  # set by bpslaunch for each process it placed (JSON)
MIN_COMPUTE_CORES = 4  # auto reserves only where every worker keeps this many compute cores
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Options:
    """BPS_GOSSIP_COMM_CORES (bpslaunch --comm-cores) and BPS_GOSSIP_AFFINITY (--no-affinity)."""

    comm_cores: int | None = None  # None: auto
    affinity: bool = True


def options(env: Mapping[str, str]) -> Options:
    """The placement options of ``env``; a bad value is a ConfigError naming the variable."""
    raw = (env.get(COMM_CORES_VAR) or "").strip()
    if raw and raw.lower() != "auto" and not raw.isdecimal():
        raise ConfigError(f"{COMM_CORES_VAR}={raw!r} (bpslaunch --comm-cores) must be 'auto' or a whole "
                          "number of cores >= 0 (0: reserve none)")
    comm = int(raw) if raw.isdecimal() else None
    flag = (env.get(AFFINITY_VAR) or "1").strip().lower()
    if flag not in _TRUE + _FALSE:
        raise ConfigError(f"{AFFINITY_VAR}={env.get(AFFINITY_VAR)!r} is not a boolean (use 1/0; "
                          "bpslaunch --no-affinity sets 0)")
    return Options(comm, flag in _TRUE)


def format_cpus(cpus: Iterable[int]) -> str:
    """``0-3,8`` (taskset's and /proc's list format)."""
    ordered, runs = sorted(set(cpus)), []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The placement of one host's workers (index: local rank) and its communication."""

    cores: int  # physical cores the job may use here (hyperthreads of one core count once)
    workers: int
    compute: tuple[tuple[int, ...], ...]  # per local rank: its compute CPUs; () where nothing is pinned
    comm: tuple[int, ...]  # CPUs reserved for communication; () where none are
    threads: int  # each worker's OpenMP threads (the user's own where set)
    env: Mapping[str, str]  # what every worker's environment gets: only variables the user left unset
    notes: tuple[str, ...]  # why, for the log

    @property
    def pinned(self) -> bool:
        """True when processes get an affinity (something reserved, and affinity on)."""
        return bool(self.comm) and any(self.compute)

    def summary(self) -> str:
        """One line for bpslaunch: the cores of every process."""
        shares = " | ".join(format_cpus(cpus) for cpus in self.compute)
        whose = "" if "OMP_NUM_THREADS" in self.env else " (the user's OMP_NUM_THREADS)"
        return (f"placement: communication (scheduler, servers, each worker's communication threads) on cpus "
                f"{format_cpus(self.comm)}; workers compute on cpus {shares} (local rank order), {self.threads} "
                f"OpenMP thread(s) each{whose}; --comm-cores 0 turns the reservation off, --no-affinity the pinning")

    def describe(self, rank: int) -> str:
        """One line for the worker's log: what local rank ``rank`` got, and why."""
        where = "nothing pinned"
        if self.pinned:
            where = (f"local rank {rank} computes on cpus {format_cpus(self.compute[rank])}, communication (engine "
                     f"and ZeroMQ threads, the local server and scheduler) on cpus {format_cpus(self.comm)}")
        threads = ", ".join(f"{name}={value}" for name, value in self.env.items())
        return "; ".join([f"placement: {self.workers} worker(s) on {self.cores} core(s): {where}",
                          f"set {threads}" if threads else "thread counts: the user's own", *self.notes])


def plan(cpus: Sequence[int], workers: int, env: Mapping[str, str], opts: Options = Options(),
         siblings: Mapping[int, object] | None = None, machine_cpus: int | None = None,
         quota: int | None = None) -> Plan:
    """Place ``workers`` processes of one host on ``cpus`` (the CPUs the job may use there).

    ``env``: the workers' environment (the user's OMP_NUM_THREADS and MXNET_CPU_WORKER_NTHREADS
    win); ``siblings``: CPU -> its physical core (hyperthreads share one; default: each CPU is a
    core); ``machine_cpus``: the CPUs online, to say when the user narrowed the affinity;
    ``quota``: the CPUs' worth of time a cgroup allows (a container's limit): thread counts follow
    it and nothing is pinned (other containers on the host may use the same CPUs).
    Raises ConfigError when BPS_GOSSIP_COMM_CORES leaves no core for computing.
    """
    units = _units(cpus, siblings)
    omp, mxnet_workers, notes = user_threads(env)
    if machine_cpus is not None and len(cpus) < machine_cpus:
        notes.append(f"within the {len(cpus)} of {machine_cpus} CPUs this job may use (cpus {format_cpus(cpus)}: "
                     "the user's or batch system's affinity, kept)")
    if quota is not None and quota < len(units):
        notes.append(f"a CPU quota of {quota} core(s) (cgroup): thread counts follow it, nothing pinned")
        units, opts = units[:quota], Options(opts.comm_cores, False)
    reserve = _reserve(len(units), len(cpus), workers, opts.comm_cores, omp, notes)
    shares, spare = _split(units[:len(units) - reserve], workers)
    # Unreserved, a worker gets its share but never more than MXNet's own default (half the CPUs):
    # alone on a small host it leaves communication room, as before (docs/placement.md).
    per_worker = len(shares[0]) if reserve else min(len(units) // workers, sum(map(len, units)) // 2)
    threads = omp or max(1, per_worker // mxnet_workers)
    if omp and reserve and omp > len(shares[0]):
        notes.append(f"OMP_NUM_THREADS={omp} exceeds the {len(shares[0])} compute cores of each worker")
    comm = tuple(sorted(cpu for unit in (*units[len(units) - reserve:], *spare) for cpu in unit)) if reserve else ()
    compute: tuple[tuple[int, ...], ...] = ((),) * workers
    if comm and opts.affinity:
        compute = tuple(tuple(sorted(cpu for unit in share for cpu in unit)) for share in shares)
    elif comm:
        notes.append(f"{AFFINITY_VAR}=0 (bpslaunch --no-affinity): nothing pinned, thread counts leave "
                     "the reserved cores free")
    unset = [name for name in THREAD_VARS if not (env.get(name) or "").strip()]
    set_env = {name: str(threads) if name == "OMP_NUM_THREADS" else "1" for name in unset}
    set_env.update(wait_policy(env, threads, workers, len(units), notes))
    return Plan(len(units), workers, compute, comm, threads, set_env, tuple(notes))


def _units(cpus: Sequence[int], siblings: Mapping[int, object] | None) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core, in the order of each core's first CPU."""
    groups: dict[object, list[int]] = {}
    for cpu in sorted(set(cpus)):
        groups.setdefault(siblings.get(cpu, cpu) if siblings else cpu, []).append(cpu)
    return [tuple(group) for group in groups.values()]


def _reserve(cores: int, cpus: int, workers: int, asked: int | None, omp: int | None, notes: list[str]) -> int:
    """How many physical cores communication gets."""
    if asked is not None:
        if asked >= cores:
            raise ConfigError(f"{COMM_CORES_VAR}={asked} (bpslaunch --comm-cores) leaves no core for computing: "
                              f"this job may use {cores} core(s) here ({cpus} CPUs)")
        notes.append(f"{COMM_CORES_VAR}={asked} asked" + (": nothing reserved" if asked == 0 else ""))
        if asked and cores - asked < workers:
            notes.append(f"{workers} workers share {cores - asked} compute core(s)")
        return asked
    need = max(omp or 0, MIN_COMPUTE_CORES)  # and never pinned below 4 compute cores a worker
    if cores >= workers * (need + 1):
        notes.append(f"one core a worker reserved for communication ({COMM_CORES_VAR}=0 or "
                     "bpslaunch --comm-cores 0 turns this off)")
        return workers
    notes.append(f"nothing reserved: {cores} core(s) for {workers} worker(s) is fewer than {need + 1} per worker "
                 f"({need} to compute, 1 to communicate)")
    return 0


def _split(units: list[tuple[int, ...]], workers: int) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
    """Equal, contiguous shares of ``units`` for ``workers`` (sharing when there are fewer units
    than workers) and the units left over."""
    if len(units) < workers:
        return [[units[rank % len(units)]] for rank in range(workers)], []
    each = len(units) // workers
    return [units[rank * each:(rank + 1) * each] for rank in range(workers)], units[each * workers:]


# -- this host ----------------------------------------------------------------------------
AFFINITY_WORKS = hasattr(os, "sched_setaffinity")  # Linux


def usable_cpus() -> int:
    """How many CPUs this process may use (its affinity: bpslaunch's placement, taskset, a cgroup)."""
    return len(os.sched_getaffinity(0)) if AFFINITY_WORKS else os.cpu_count() or 1


def cpu_quota() -> int | None:
    """The CPUs' worth of time this process's cgroup allows (rounded up), or None: no limit
    (cgroup v2's cpu.max, else v1's cpu.cfs_quota_us; best effort, as seen inside a container)."""
    for path, period_path in (("/sys/fs/cgroup/cpu.max", None),
                              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(path) as file:
                fields = file.read().split()
            if period_path is not None:
                with open(period_path) as file:
                    fields.append(file.read().strip())
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):  # absent, or "max": no limit
            continue
        return max(1, -(-quota // period)) if quota > 0 and period > 0 else None
    return None


def host_cpus() -> tuple[tuple[int, ...], dict[int, object], int]:
    """The CPUs this process may use, each one's physical core (from sysfs; a CPU whose topology
    cannot be read is a core of its own), and the CPUs of the machine (its container's cpuset)."""
    cpus = tuple(sorted(os.sched_getaffinity(0))) if AFFINITY_WORKS else tuple(range(os.cpu_count() or 1))
    siblings: dict[int, object] = {}
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as package, open(topology + "core_id") as core:
                siblings[cpu] = (package.read().strip(), core.read().strip())
        except OSError:
            siblings[cpu] = cpu
    return cpus, siblings, _cpuset_size() or os.cpu_count() or len(cpus)


def parse_cpus(text: str) -> list[int]:
    """The CPUs of a list such as ``0-3,8`` (the inverse of :func:`format_cpus`)."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _cpuset_size() -> int | None:
    """How many CPUs this container's cgroup cpuset holds (a narrower affinity is the user's or the
    batch system's, not the container's), or None where it cannot be read."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus", "/sys/fs/cgroup/cpuset/cpuset.cpus"):
        try:
            with open(path) as file:
                return len(parse_cpus(file.read())) or None
        except (OSError, ValueError):
            continue
    return None


def plan_here(workers: int, env: Mapping[str, str], opts: Options) -> Plan:
    """:func:`plan` for ``workers`` on the CPUs this process may use."""
    cpus, siblings, online = host_cpus()
    return plan(cpus, workers, env, Options(opts.comm_cores, opts.affinity and AFFINITY_WORKS), siblings, online,
                cpu_quota())


def check_here(opts: Options, env: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError when BPS_GOSSIP_COMM_CORES leaves no core of this host for computing
    (a worker that plans for itself checks before joining its job; bpslaunch checked already)."""
    if opts.comm_cores and PLACED_VAR not in (os.environ if env is None else env):
        plan_here(1, {}, opts)


# -- bpslaunch: the environment of each process it starts --------------------------------
def worker_env(placed: Plan, rank: int) -> dict[str, str]:
    """What bpslaunch adds to local rank ``rank``'s environment."""
    record = {"note": placed.describe(rank)}
    if placed.pinned:
        record.update(cpus=list(placed.compute[rank]), comm=list(placed.comm))
    return {**placed.env, PLACED_VAR: json.dumps(record)}


def service_env(placed: Plan) -> dict[str, str]:
    """What bpslaunch adds to a scheduler's or server's environment on this host."""
    return {PLACED_VAR: json.dumps({"cpus": list(placed.comm)})} if placed.pinned else {}


def _record(env: Mapping[str, str]) -> dict | None:
    raw = env.get(PLACED_VAR)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        for key in ("cpus", "comm"):
            if key in record and not (isinstance(record[key], list) and all(isinstance(c, int) for c in record[key])):
                raise ValueError(key)
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"{PLACED_VAR}={raw[:80]!r} is not bpslaunch's placement record (bpslaunch sets it; "
                          "unset it)") from None
    return record


def start_cpus(env: Mapping[str, str]) -> frozenset[int] | None:
    """The CPUs a process with ``env`` starts on (bpslaunch's placement), or None to leave it be."""
    record = _record(env)
    return frozenset(record["cpus"]) if record and record.get("cpus") else None


def start_on_cpus(env: Mapping[str, str], then: Callable[[], None] | None) -> Callable[[], None] | None:
    """A Popen preexec_fn: the child starts on :func:`start_cpus` of its ``env`` (every thread it
    starts inherits them), then runs ``then``; ``then`` itself when ``env`` names no CPUs."""
    cpus = start_cpus(env)
    if cpus is None or not AFFINITY_WORKS:
        return then

    def preexec() -> None:
        os.sched_setaffinity(0, cpus)
        if then is not None:
            then()
    return preexec


# -- the worker: its communication threads -----------------------------------------------
def thread_ids() -> set[int]:
    """The ids of this process's threads now."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _zmq_threads() -> set[int]:
    """ZeroMQ's background threads (I/O, reaper) of every context in this process."""
    found = set()
    for tid in thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith("ZMQbg"):
                    found.add(tid)
        except OSError:
            pass  # ended meanwhile
    return found


def _pin(tids: Collection[int], cpus: Collection[int]) -> None:
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # ended meanwhile


def _openmp_started() -> bool:
    """True when an OpenMP runtime is loaded already: it read OMP_NUM_THREADS when it was."""
    try:
        with open("/proc/self/maps") as maps:
            return any(lib in line for line in maps for lib in ("libgomp", "libiomp", "libomp"))
    except OSError:
        return True


def place_worker(opts: Options, local_size: int, local_rank: int, before: set[int],
                 env: Mapping[str, str] | None = None) -> str:
    """Move this worker's communication threads (those started since ``before``: the engine's,
    ZeroMQ's, the handshake watcher) to the communication cores, and say what was placed.

    Under bpslaunch -np the plan is bpslaunch's (the process started on its compute cores). Started
    another way, the worker plans from the address book: it pins its threads unless the user set an
    affinity, and reserves cores only when its OpenMP thread count can still follow the plan (an
    OpenMP runtime loaded before init() read OMP_NUM_THREADS already).
    """
    env = os.environ if env is None else env
    if not AFFINITY_WORKS:
        return "placement: thread affinity is not supported on this system"
    comm_threads = (thread_ids() - before) | _zmq_threads()
    record = _record(env)
    if record is not None:
        if record.get("comm"):
            _pin(comm_threads, record["comm"])
        return record.get("note", "placement: bpslaunch's")
    cpus, siblings, online = host_cpus()
    if len(cpus) < online:
        return f"placement: this process's affinity (cpus {format_cpus(cpus)}) was set before init(): kept"
    placed = plan(cpus, local_size, env, opts, siblings, online, cpu_quota())
    if _openmp_started():
        if "OMP_NUM_THREADS" in placed.env:
            return (f"placement: nothing reserved or pinned ({local_size} worker(s) on {placed.cores} core(s)): an "
                    "OpenMP runtime loaded before init() chose its own thread count; set OMP_NUM_THREADS (e.g. "
                    f"{placed.threads}), or start with bpslaunch, to place them")
        placed = dataclasses.replace(placed, env={}, notes=(*placed.notes, "no variable set: OpenMP is loaded"))
    os.environ.update(placed.env)  # for OpenMP runtimes loaded from now on
    if placed.pinned:
        _pin(thread_ids() - comm_threads, placed.compute[local_rank])
        _pin(comm_threads, placed.comm)
    return placed.describe(local_rank)
