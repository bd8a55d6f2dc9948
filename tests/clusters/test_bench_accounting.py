"""The benchmarks' CPU accounting by thread (scripts/bench_common.py), read from this process's
own /proc entries, and the OS names bps_gossip gives its threads (bps_gossip.thread_names)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_common import (  # noqa: E402 - scripts/ is not a package
    ThreadClock,
    classify_thread,
    cpu_split,
    named_comm_threads,
    parse_schedstat,
    parse_stat,
    process_cpu,
    read_threads,
    threads_per_worker,
)

from bps_gossip.thread_names import ENGINE, PREFIX, name_this_thread, named  # noqa: E402

linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")


def spin(seconds: float) -> None:
    """Burn CPU on the calling thread (CPU time, not wall time: the machine may be loaded)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_parse_stat_takes_the_name_up_to_the_last_parenthesis():
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S", *["0"] * 10, str(3 * ticks), str(ticks), *["0"] * 30]  # fields 3.. ; utime 14, stime 15
    name, seconds = parse_stat(f"4242 (a b) (c)) {' '.join(fields)}\n")
    assert name == "a b) (c)"
    assert seconds == pytest.approx(4.0)
    assert parse_schedstat("1500000000 20 3\n") == pytest.approx(1.5)


def test_classification():
    comm = {7}
    assert classify_thread("python3", 7, "python3", comm) == "comm"  # started by the comm library
    assert classify_thread("ZMQbg/IO/0", 7, "python3", comm) == "comm"
    assert classify_thread("python3", 8, "python3", comm) == "compute"  # main, MXNet's, OpenMP's
    assert classify_thread(ENGINE, 9, "python3", comm) == "other"  # inherited our name, not ours
    assert named_comm_threads({1: ("python3", 0.0), 2: (ENGINE, 0.0), 3: ("ZMQbg/Reaper", 0.0)}) == {2, 3}
    before = {1: ("python3", 1.0), 2: (ENGINE, 0.5), 4: ("gone", 9.0)}
    after = {1: ("python3", 1.25), 2: (ENGINE, 0.75), 3: ("python3", 0.5)}  # 3 born, 4 ended in between
    assert cpu_split(before, after, "python3", {2}) == {"compute": 0.75, "comm": 0.25, "other": 0.0}


def test_threads_per_worker():
    assert threads_per_worker("auto", 2, cores=16) == 8
    assert threads_per_worker("AUTO", 8, cores=16) == 2
    assert threads_per_worker("auto", 32, cores=16) == 1  # never 0
    assert threads_per_worker("auto", 2) >= 1  # this machine's affinity
    assert threads_per_worker("3", 2) == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit, match="--threads"):
            threads_per_worker(bad, 2)


@linux_only
@pytest.mark.timeout(30)
def test_this_process_threads_by_name_and_class():
    """A thread named as ours counts as communication, the main thread as compute, and a thread
    that one of ours starts (inheriting our name) as other: each gets the CPU it spent."""
    threads = read_threads()
    main_name = Path("/proc/self/comm").read_text().strip()
    assert threads[os.getpid()][0] == main_name
    named_up, go, child_spun, leave = (threading.Event() for _ in range(4))

    def child() -> None:  # started by one of ours: born with our thread's name
        spin(0.1)
        child_spun.set()
        leave.wait(10)

    def ours() -> None:  # the shape of an engine thread: named on its first line
        named_up.set()
        go.wait(10)
        spin(0.15)
        threading.Thread(target=child, daemon=True).start()
        leave.wait(10)  # a thread that ended before the reading is missing from it

    thread = threading.Thread(target=named(PREFIX + "test", ours), daemon=True)
    thread.start()
    assert named_up.wait(10)
    clock = ThreadClock()
    clock.comm_tids = named_comm_threads(read_threads())
    assert thread.native_id in clock.comm_tids
    assert clock.main_name == main_name
    clock.start()
    go.set()
    spin(0.1)
    assert child_spun.wait(10)
    split = clock.stop()
    names = clock.names()
    leave.set()
    assert split["comm"] >= 0.1, split
    assert split["compute"] >= 0.05, split
    assert split["other"] >= 0.05, split
    assert names["other"] == {PREFIX + "test": 1}, names
    assert names["compute"].get(main_name, 0) >= 1, names
    assert process_cpu(os.getpid()) > 0.0


@linux_only
def test_name_this_thread_sets_the_os_name_cut_to_15_bytes():
    seen: dict[str, str] = {}

    def run() -> None:
        name_this_thread("bpsg-a-very-long-thread-name")
        seen["name"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert seen["name"] == "bpsg-a-very-lon"
    assert process_cpu(2 ** 22 + 12345) == 0.0  # no such process: nothing, no error


@linux_only
@pytest.mark.timeout(60)
def test_a_worker_names_its_communication_threads(cluster):
    """In a real worker, the engine thread carries ENGINE as its OS name (Python before 3.14 gives
    every thread the interpreter's name): top -H and the benchmarks tell it from compute."""
    job = cluster(2)
    done = job.run_job("worker_process_job", "thread_names")
    for worker in done:
        assert worker.returncode == 0, worker.stderr
        assert worker.result.count(ENGINE) == 1, worker.result
        assert any(name.startswith("ZMQbg/") for name in worker.result), worker.result
