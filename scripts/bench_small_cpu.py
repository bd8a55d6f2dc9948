"""Where a small push_pull's CPU goes: microseconds of CPU per push_pull, thread by thread.

    python scripts/bench_small_cpu.py
    python scripts/bench_small_cpu.py --size 64K --reps 5
    python scripts/bench_small_cpu.py --code /tmp/old_checkout,. --reps 5

Starts a scheduler, one server and ``--workers`` workers on 127.0.0.1 (with a job secret, as
under bpslaunch; shared memory on), and has every worker run ``--iters`` blocking numpy
push_pulls (sum) of one float32 tensor of ``--size`` bytes after ``--warmup`` untimed ones.
Each thread's CPU time comes from /proc/<pid>/task/<tid>/schedstat (nanoseconds on a CPU);
a worker reads its own threads and rank 0 also the server's, before and after the timed
loop. Wall time is the slowest rank's. On a machine others share, wall time moves with
their load and CPU time much less: compare CPU, and compare checkouts in one run
(``--code`` runs them in turn, order reversed every other repetition; medians are shown).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import parse_size

from bps_gossip.launch.local import free_port
from bps_gossip.transport import shm

SECRET = "0123456789abcdef" * 4  # a throwaway job secret: CURVE on every socket, as under bpslaunch

WORKER = r'''
import json, os, sys, time
import numpy as np
import bps_gossip as bps


def threads(pid):
    """tid -> (OS thread name, CPU ns, voluntary context switches)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as comm, open(f"{base}/schedstat") as sched, open(f"{base}/status") as status:
                name, ns = comm.read().strip(), int(sched.read().split()[0])
                switches = next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt"))
        except (OSError, StopIteration):
            continue
        found[tid] = (name, ns, switches)
    return found


def per_op(before, after, ops, main):
    """{thread name: [us of CPU per op, switches per op]}, threads of one name added up."""
    result = {}
    for tid, (name, ns, switches) in after.items():
        _, ns0, switches0 = before.get(tid, (name, 0, 0))
        entry = result.setdefault("main" if tid == main else name, [0.0, 0.0])
        entry[0] += (ns - ns0) / ops / 1000.0
        entry[1] += (switches - switches0) / ops
    return result


bps.init()
count, iters = int(os.environ["SMALL_BYTES"]) // 4, int(os.environ["SMALL_ITERS"])
array = np.arange(count, dtype=np.float32) + bps.rank()
out = np.empty_like(array)
for _ in range(int(os.environ["SMALL_WARMUP"])):
    bps.push_pull(array, "small", average=False, out=out)
bps.barrier()
server, me = os.environ["SMALL_SERVER_PID"], str(os.getpid())
server0, mine0 = threads(server), threads(me)
start = time.perf_counter()
for _ in range(iters):
    bps.push_pull(array, "small", average=False, out=out)
wall = time.perf_counter() - start
server1, mine1 = threads(server), threads(me)
want = sum(np.arange(count, dtype=np.float32) + rank for rank in range(bps.size()))
if not np.array_equal(out, want):
    sys.exit("wrong push_pull result")
print("RESULT " + json.dumps({"rank": bps.rank(), "wall_us": wall / iters * 1e6,
                              "worker": per_op(mine0, mine1, iters, me),
                              "server": per_op(server0, server1, iters, server)}), flush=True)
bps.barrier()
bps.shutdown()
'''


def run_once(code: Path, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """One job of ``code``'s bps_gossip; every worker's RESULT."""
    script = folder / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code), "DMLC_NUM_WORKER": str(args.workers), "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port), "BYTEPS_LOG_LEVEL": "WARNING",
           "BPS_GOSSIP_SECRET": SECRET, "SMALL_BYTES": str(args.size), "SMALL_ITERS": str(args.iters),
           "SMALL_WARMUP": str(args.warmup)}
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], extra: dict[str, str], name: str) -> subprocess.Popen:
        with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
            proc = subprocess.Popen(argv, env={**env, **extra}, cwd=code, stdout=out, stderr=err,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    try:
        spawn([sys.executable, "-m", "bps_gossip.scheduler"], {"DMLC_ROLE": "scheduler"}, "scheduler")
        server = spawn([sys.executable, "-m", "bps_gossip.server"], {"DMLC_ROLE": "server"}, "server")
        workers = [spawn([sys.executable, str(script)], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank),
                                                          "SMALL_SERVER_PID": str(server.pid)}, f"worker{rank}")
                   for rank in range(args.workers)]
        for proc in workers:
            proc.wait(args.timeout)
        results = [json.loads(line[7:]) for rank in range(args.workers)
                   for line in (folder / f"worker{rank}.out").read_text().splitlines() if line.startswith("RESULT ")]
        if len(results) != args.workers:
            logs = "".join((folder / f"{name}.err").read_text()[-2000:] for name in ("server", "worker0"))
            raise RuntimeError(f"{code}: {len(results)} of {args.workers} workers reported:\n{logs}")
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        shm.sweep(str(port))


def by_thread(results: list[dict[str, Any]]) -> tuple[float, dict[str, list[float]]]:
    """(wall us per op of the slowest rank, {"w<rank> <thread>" / "server <thread>": [cpu us, switches]})."""
    threads: dict[str, list[float]] = {}
    for result in results:
        for name, value in result["worker"].items():
            threads[f"w{result['rank']} {name}"] = value
    for name, value in next(r for r in results if r["rank"] == 0)["server"].items():
        threads[f"server {name}"] = value
    return max(r["wall_us"] for r in results), threads


def report(code: Path, runs: list[tuple[float, dict[str, list[float]]]]) -> None:
    """Medians over repetitions, thread by thread."""
    walls = [wall for wall, _ in runs]
    print(f"\n{code}: wall {statistics.median(walls):.0f} us per push_pull (runs: "
          f"{', '.join(f'{w:.0f}' for w in walls)})")
    names = sorted({name for _, threads in runs for name in threads})
    for name in names:
        cpu = statistics.median(threads.get(name, [0.0, 0.0])[0] for _, threads in runs)
        switches = statistics.median(threads.get(name, [0.0, 0.0])[1] for _, threads in runs)
        if cpu >= 1.0:
            print(f"  {name:26s} {cpu:7.1f} us CPU  {switches:5.2f} waits")
    total = statistics.median(sum(v[0] for v in threads.values()) for _, threads in runs)
    print(f"  {'total':26s} {total:7.1f} us CPU per push_pull")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default=".", help="comma-separated checkouts to compare (default: this one)")
    parser.add_argument("--size", default="4K", help="tensor bytes (default 4K)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000, help="timed push_pulls per run")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3, help="runs of each checkout")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    args = parser.parse_args(argv)
    args.size = parse_size(args.size)
    if args.size % 4 or args.size <= 0:
        parser.error("--size must be a positive multiple of 4 bytes (float32)")
    if args.workers < 1 or args.iters < 1 or args.reps < 1:
        parser.error("--workers, --iters and --reps must be at least 1")
    args.code = [Path(path).resolve() for path in args.code.split(",")]
    return args


def main() -> int:
    """Run every checkout ``--reps`` times, interleaved; print the medians."""
    args = parse_args()
    runs: dict[Path, list[tuple[float, dict[str, list[float]]]]] = {code: [] for code in args.code}
    with tempfile.TemporaryDirectory(prefix="bench_small_") as tmp:
        for rep in range(args.reps):
            for index, code in enumerate(args.code if rep % 2 == 0 else args.code[::-1]):
                folder = Path(tmp) / f"{rep}_{index}"
                folder.mkdir()
                wall, threads = by_thread(run_once(code, args, folder))
                runs[code].append((wall, threads))
                print(f"{code} run {rep}: wall {wall:.0f} us, CPU {sum(v[0] for v in threads.values()):.0f} us "
                      "per push_pull", flush=True)
    for code in args.code:
        report(code, runs[code])
    return 0


if __name__ == "__main__":
    sys.exit(main())
