"""Many workers on one host: push_pull's overhead per step against the memory traffic it cannot avoid.

    python scripts/bench_scale.py --preset 4mib8 --workers 2,4,8 --servers 1,2,4 --steps 8 --passes 3
    python scripts/bench_scale.py --preset resnet18_v1 --workers 4,8,16,32 --json scale.json

N workers on this host (the bps_gossip core only: numpy, no MXNet, so 32 start quickly) each
emulate compute by sleeping --compute-ms, then push_pull (sum) the gradients of a real model
(its tensor sizes and count, fused as mxnet_plugin fuses them; --no-fusion pushes each alone),
all started at once and waited for, as a trainer's step does. Each configuration (workers,
servers, BPS_GOSSIP_HOST_REDUCE, placement) runs its own cluster; the clusters of one worker
count are alive together and driven pass by pass in turn, so they see the same machine. A
step's overhead is its time minus the compute (the slowest rank's median), and every result is
checked against the exact sum.

The bound is the memory traffic no single-host design avoids, bound(N, B) = 2 x N x copy(B) +
sum(N, B), with copy and sum measured on this machine before every pass (about 3 x N x B /
memcpy bandwidth). Each row also shows its overhead over the fewest servers' (more servers
should never be slower), the busiest server's share of the bytes (--placement plan or hash),
and CPU milliseconds and wake-ups per step of the workers and the servers, from /proc.
What each column means and the latest results: docs/performance-many-workers.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import (
    STARTUP_TIMEOUT,
    BenchError,
    ClusterShape,
    Job,
    System,
    WorkerGroup,
    format_table,
    install_sigterm_handler,
    machine_info,
    median,
    process_cpu,
    serve,
    write_json,
)

from bps_gossip.config import load_config
from bps_gossip.worker.server_choice import assign, plan_of, plan_servers

# Gradient sizes (float32 elements) of every trained parameter, in the model's order, of the
# Gluon model zoo's models with classes=10 at 32x32 (as scripts/bench_training.py builds them):
# [p.data().size for p in net.collect_params().values() if p.grad_req != 'null'], MXNet 1.9.1.
_RESNET_STAGES = [
    (64, 64, False), (64, 64, False), (64, 128, True), (128, 128, False),
    (128, 256, True), (256, 256, False), (256, 512, True), (512, 512, False),
]


def _resnet18_v1() -> list[int]:
    """resnet18_v1: a 7x7 stem, eight basic blocks (two 3x3 convolutions, a 1x1 downsample where
    the width doubles), each convolution followed by batch norm (gamma, beta), a dense layer."""
    sizes = [3 * 64 * 7 * 7, 64, 64]
    for cin, cout, down in _RESNET_STAGES:
        sizes += [cin * cout * 9, cout, cout, cout * cout * 9, cout, cout]
        if down:
            sizes += [cin * cout, cout, cout]
    return sizes + [512 * 10, 10]


def _mobilenet(multiplier: float) -> list[int]:
    """mobilenet v1: a 3x3 stem, then depthwise 3x3 and pointwise 1x1 pairs, batch norm after each."""
    widths = [int(w * multiplier) for w in (32, 64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024)]
    sizes = [3 * widths[0] * 9, widths[0], widths[0]]
    for cin, cout in zip(widths[:-1], widths[1:]):
        sizes += [cin * 9, cin, cin, cin * cout, cout, cout]
    return sizes + [widths[-1] * 10, 10]


PRESETS: dict[str, list[int]] = {
    "resnet18_v1": _resnet18_v1(),  # 11,181,642 parameters in 62 tensors
    "mobilenet0.25": _mobilenet(0.25),  # 215,642 in 83
    "4mib8": [(4 << 20) // 4 // 8] * 8,  # 4 MiB in 8 tensors of 512 KiB (docs/NOTES' earlier measurement)
}
SMALL_BYTES = 256 * 1024  # mxnet_plugin.fusion: gradients up to this size are fused ...
BUCKET_BYTES = 4 * 1024 * 1024  # ... into buckets cut once they hold this much
MEASURE_BYTES = 1 << 30  # at most this much memory for the bandwidth measurement's buffers
BLOCK = 32768  # elements per block of the blocked sum (128 KiB of float32: stays in cache)
CHUNK = 1 << 18  # elements of every buffer summed per timed piece of the bandwidth measurement (1 MiB)
HOST_REDUCE = ("off", "on")
PLACEMENTS = ("plan", "hash")  # bps_gossip.worker.server_choice: plan_servers(), or the name's hash alone


# -- what is pushed, and the bound ----------------------------------------------------------

def pushed_tensors(sizes: Sequence[int], fuse: bool = True) -> list[tuple[str, int, int]]:
    """(name, elements, priority) of each push_pull of a step, in the order backward makes the
    gradients (the last layer first). With ``fuse``, as mxnet_plugin.fusion cuts buckets: a
    gradient over SMALL_BYTES alone, consecutive small ones together until a bucket holds
    BUCKET_BYTES. Priority is minus the first layer's index (the first layers go first)."""
    if not fuse:
        return [(f"grad{index}", count, -index) for index, count in reversed(list(enumerate(sizes)))]
    out: list[tuple[str, int, int]] = []
    bucket: list[int] = []

    def cut() -> None:
        if bucket:
            out.append((f"bucket{bucket[-1]}_{len(bucket)}", sum(sizes[i] for i in bucket), -min(bucket)))
            bucket.clear()

    for index in reversed(range(len(sizes))):
        if sizes[index] * 4 > SMALL_BYTES:
            out.append((f"grad{index}", sizes[index], -index))
            continue
        if sum(sizes[i] for i in bucket) * 4 >= BUCKET_BYTES:
            cut()
        bucket.append(index)
    cut()
    return out


def memory_bound(workers: int, nbytes: int, copy_s_per_byte: float, sum_s_per_byte: float) -> float:
    """Seconds of the unavoidable memory traffic of one step (module docstring):
    2 x N copies of the model's bytes and one sum reading N of them."""
    return 2 * workers * nbytes * copy_s_per_byte + workers * nbytes * sum_s_per_byte


def server_loads(pushed: Sequence[tuple[str, int, int]], servers: int, partition_bytes: int,
                 placement: str = "plan") -> list[int]:
    """Bytes of a step each server sums, placed as the workers place them
    (bps_gossip.worker.server_choice): planned (balanced), or (key + partition) mod servers with
    the key a hash of the name, which loads one server with far more than its share when
    partitions are few and unequal."""
    plan = plan_of([(name, count, 4) for name, count, _ in pushed], partition_bytes)
    table = assign(plan, servers) if placement == "plan" else {}
    loads = [0] * servers
    for key, sizes in plan:
        for index, size in enumerate(sizes):
            loads[table[key][index] if key in table else (key + index) % servers] += size
    return loads


def blocked_sum(buffers: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``out`` = the sum of ``buffers``, block by block so each is read from memory once."""
    for start in range(0, out.size, BLOCK):
        block = out[start:start + BLOCK]
        np.add(buffers[0][start:start + BLOCK], buffers[1][start:start + BLOCK], out=block)
        for buf in buffers[2:]:
            np.add(block, buf[start:start + BLOCK], out=block)


def buffer_count(workers: int, nbytes: int) -> int:
    """How many buffers of ``nbytes`` the measurement uses: one per worker, as long as two sets
    (sources and targets) fit in MEASURE_BYTES; at least two."""
    return max(2, min(workers, MEASURE_BYTES // (2 * max(nbytes, 1))))


def measure_bandwidth(workers: int, nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Seconds per byte of np.copyto and of a blocked sum, on ``workers`` buffers of ``nbytes``
    (fewer, if they would take more than MEASURE_BYTES: the sum needs two sets). Each 4 MiB
    piece of a copy and each CHUNK of the sum (across every buffer) is timed on its own,
    ``repeats`` times, and the fastest counts: other processes only ever add time (CPU steal, a
    busy core), and a short piece is less often interrupted than the whole."""
    count = buffer_count(workers, nbytes)
    elements = max(nbytes // 4, 1)
    sources = [np.full(elements, i + 1, np.float32) for i in range(count)]
    targets = [np.full(elements, -1, np.float32) for _ in range(count)]  # written: no page faults timed
    copy, total = float("inf"), float("inf")
    for _ in range(repeats):
        for src, dst in zip(sources, targets):
            for first in range(0, elements, 4 * CHUNK):
                start = time.perf_counter()
                np.copyto(dst[first:first + 4 * CHUNK], src[first:first + 4 * CHUNK])
                copy = min(copy, (time.perf_counter() - start) / dst[first:first + 4 * CHUNK].nbytes)
        for first in range(0, elements, CHUNK):
            chunk = [buf[first:first + CHUNK] for buf in sources]
            start = time.perf_counter()
            blocked_sum(chunk, targets[0][first:first + CHUNK])
            total = min(total, (time.perf_counter() - start) / (count * chunk[0].nbytes))
    if targets[0][0] != count * (count + 1) / 2:
        raise BenchError(f"the blocked sum is wrong: {targets[0][0]}")
    return {"copy_s_per_byte": copy, "sum_s_per_byte": total, "buffers": count}


# -- worker side --------------------------------------------------------------------------

class ScaleWorker:
    """One worker: gradients of the preset's sizes, sleep then push_pull them all, step by step."""

    def __init__(self) -> None:
        import bps_gossip

        self.bps = bps_gossip
        self.bps.init()
        self.rank, self.size = self.bps.rank(), self.bps.size()
        self.tensors: list[tuple[str, np.ndarray, np.ndarray, int]] = []

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        """Rank and size, once the job's rendezvous is done."""
        return {"rank": self.rank, "size": self.size}

    def setup(self, message: dict[str, Any]) -> dict[str, Any]:
        """Allocate the gradients (each rank's filled with rank + 1) and outputs, then warm up."""
        pushed = message["tensors"]
        if message["placement"] == "plan":  # every rank plans the same tensors before pushing them
            plan_servers([(name, count, 4) for name, count, _ in pushed], message["partition_bytes"])
        total = sum(count for _, count, _ in pushed)
        grads = np.full(total, self.rank + 1, np.float32)
        outs = np.zeros(total, np.float32)
        offset = 0
        for name, count, priority in pushed:
            self.tensors.append((name, grads[offset:offset + count], outs[offset:offset + count], priority))
            offset += count
        self.run({"steps": message["warmup"], "compute_ms": message["compute_ms"]})
        return {}

    def step(self) -> None:
        """Start every push_pull at once, then wait for them all."""
        handles = [self.bps.push_pull_async(grad, name, average=False, priority=priority, out=out)
                   for name, grad, out, priority in self.tensors]
        for handle in handles:
            self.bps.synchronize(handle)

    def run(self, message: dict[str, Any]) -> dict[str, Any]:
        """``steps`` steps of sleep(compute) and push_pull; the time of each, checked after."""
        compute = message["compute_ms"] / 1e3
        step_ms, comm_ms = [], []
        for _ in range(message["steps"]):
            start = time.perf_counter()
            time.sleep(compute)
            slept = time.perf_counter()
            self.step()
            end = time.perf_counter()
            step_ms.append((end - start) * 1e3)
            comm_ms.append((end - slept) * 1e3)
        if message["steps"]:
            self.check()
        return {"step_ms": step_ms, "comm_ms": comm_ms}

    def check(self) -> None:
        """Every output must hold the exact sum of rank + 1 over the ranks."""
        want = np.float32(self.size * (self.size + 1) / 2)
        for name, _, out, _ in self.tensors:
            if out.size and not np.all(out == want):
                bad = int(np.flatnonzero(out != want)[0])
                raise BenchError(f"rank {self.rank}: {name}[{bad}] = {out[bad]!r}, expected {want!r}")


def worker_main() -> int:
    """Entry point of a worker process (started by the driver with --worker-kind)."""
    worker = ScaleWorker()
    try:
        return serve({"hello": worker.hello, "setup": worker.setup, "pass": worker.run})
    finally:
        worker.bps.shutdown()


# -- driver -------------------------------------------------------------------------------

def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def clusters_at_once(workers: int, nbytes: int, wanted: int) -> int:
    """How many clusters of ``workers`` fit in half the available memory (each worker: its
    gradients, outputs and shared-memory copy, plus ~60 MB of interpreter)."""
    free = available_bytes()
    if free is None:
        return wanted
    return max(1, min(wanted, int(free * 0.5 // (workers * (3 * nbytes + 60e6)))))


def process_wakeups(pid: int) -> int:
    """How often ``pid``'s live threads slept and were woken (voluntary context switches)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            total += int(status.read_text().split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


def group_usage(group: WorkerGroup) -> list[float]:
    """CPU seconds (by thread, bench_common.process_cpu) and wake-ups so far of the group's
    workers, and of its servers and scheduler: [worker CPU, server CPU, worker wake-ups, server wake-ups]."""
    return [sum(process_cpu(p.pid) for p in group.workers), sum(process_cpu(p.pid) for p in group.support),
            sum(process_wakeups(p.pid) for p in group.workers), sum(process_wakeups(p.pid) for p in group.support)]


def start_clusters(job: Job, workers: int, combos: Sequence[tuple[int, str, str]]) -> list[WorkerGroup]:
    """One cluster per (servers, host reduce, placement), all starting at once; wait until all are up."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    groups = []
    for servers, reduce, placement in combos:
        system = System(f"hr_{reduce}_{placement}", "bps", {"BPS_GOSSIP_HOST_REDUCE": reduce, "BPS_GOSSIP_TIMEOUT": "300"},
                        mode=placement)
        groups.append(WorkerGroup(job, system, ClusterShape(workers, servers), argv))
    for group in groups:
        group.command({"cmd": "hello"}, STARTUP_TIMEOUT)
    return groups


class Tally:
    """What the passes of one cluster measured. (A plain class: tests/jobs/doc_args_job.py loads this
    script without registering it as a module, which dataclasses need.)"""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.overheads: list[list[float]] = [[] for _ in range(group.shape.workers)]  # by rank: step - compute, ms
        self.comms: list[float] = []  # from the end of the sleep, ms
        self.usage = [0.0] * 4  # group_usage's: CPU seconds and wake-ups of the workers, of the servers

    def add_pass(self, replies: list[dict[str, Any]], compute_ms: float, usage: list[float]) -> None:
        """One pass's replies (one per rank) and what its processes used meanwhile (group_usage)."""
        for rank, reply in enumerate(replies):
            self.overheads[rank] += [ms - compute_ms for ms in reply["step_ms"]]
            self.comms += reply["comm_ms"]
        self.usage = [total + used for total, used in zip(self.usage, usage)]

    def record(self, bounds: list[float], pushed: list[tuple[str, int, int]], args: argparse.Namespace) -> dict[str, Any]:
        """The results of this cluster (``bounds``: seconds, one per pass)."""
        shape, steps = self.group.shape, args.passes * args.steps
        overhead = max(median(per_rank) for per_rank in self.overheads)  # the slowest rank's
        bound_ms = median(bounds) * 1e3
        placement = self.group.system.mode
        loads = server_loads(pushed, shape.servers, args.partition_bytes, placement)
        return {"workers": shape.workers, "servers": shape.servers, "placement": placement,
                "host_reduce": self.group.system.env["BPS_GOSSIP_HOST_REDUCE"], "overhead_ms": overhead,
                "comm_ms": median(self.comms), "bound_ms": bound_ms, "ratio": overhead / bound_ms,
                "bound_ms_per_pass": [b * 1e3 for b in bounds], "worker_cpu_ms": self.usage[0] * 1e3 / steps,
                "server_cpu_ms": self.usage[1] * 1e3 / steps, "worker_wakeups": self.usage[2] / steps,
                "server_wakeups": self.usage[3] / steps, "server_bytes": loads,
                "busiest_server_share": max(loads) / max(sum(loads), 1)}


def run_clusters(groups: list[WorkerGroup], pushed: list[tuple[str, int, int]], nbytes: int,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """Set up and drive ``groups`` pass by pass (order reversed every other pass), measuring the
    bandwidth (so the bound) before every pass."""
    compute = args.compute_ms
    timeout = 120.0 + (args.steps + args.warmup) * (compute / 1e3 + 10.0)
    for group in groups:
        group.command({"cmd": "setup", "tensors": pushed, "warmup": args.warmup, "compute_ms": compute,
                       "placement": group.system.mode, "partition_bytes": args.partition_bytes}, timeout)
    workers = groups[0].shape.workers
    tallies = [Tally(group) for group in groups]
    bounds, bandwidths = [], []
    for index in range(args.passes):
        bandwidth = measure_bandwidth(workers, nbytes)
        bandwidths.append(bandwidth)
        bounds.append(memory_bound(workers, nbytes, bandwidth["copy_s_per_byte"], bandwidth["sum_s_per_byte"]))
        for tally in tallies if index % 2 == 0 else tallies[::-1]:
            before = group_usage(tally.group)
            replies = tally.group.command({"cmd": "pass", "steps": args.steps, "compute_ms": compute}, timeout)
            tally.add_pass(replies, compute, [a - b for a, b in zip(group_usage(tally.group), before)])
    records = [tally.record(bounds, pushed, args) for tally in tallies]
    for record in records:
        record["copy_GBps"] = [1e-9 / b["copy_s_per_byte"] for b in bandwidths]
        record["sum_GBps"] = [1e-9 / b["sum_s_per_byte"] for b in bandwidths]
    return records


def bench_workers(job: Job, workers: int, pushed: list[tuple[str, int, int]],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (servers, host reduce) configuration at ``workers`` workers."""
    nbytes = 4 * sum(count for _, count, _ in pushed)
    combos = [(servers, reduce, placement) for servers in args.servers for reduce in args.host_reduce
              for placement in args.placement]
    at_once = clusters_at_once(workers, nbytes, len(combos))
    records = []
    for start in range(0, len(combos), at_once):
        groups = start_clusters(job, workers, combos[start:start + at_once])
        try:
            records += run_clusters(groups, pushed, nbytes, args)
        finally:
            for group in groups:
                group.close()
    add_vs_one_server(records)
    return records


def add_vs_one_server(records: list[dict[str, Any]]) -> None:
    """Each record's overhead over that of the fewest servers with the same host reduce and placement."""
    for record in records:
        same = [r for r in records if (r["host_reduce"], r["placement"]) == (record["host_reduce"], record["placement"])]
        fewest = min(same, key=lambda r: r["servers"])
        record["vs_fewest_servers"] = record["overhead_ms"] / fewest["overhead_ms"]


def format_rows(records: list[dict[str, Any]]) -> str:
    """The results table."""
    headers = ["workers", "servers", "host reduce", "placement", "overhead ms/step", "bound ms/step", "ratio",
               "vs fewest servers", "busiest server", "CPU ms/step: workers", "servers", "wake-ups/step: workers",
               "servers"]
    rows = [[str(r["workers"]), str(r["servers"]), r["host_reduce"], r["placement"], f"{r['overhead_ms']:.1f}",
             f"{r['bound_ms']:.1f}", f"{r['ratio']:.2f}", f"{r['vs_fewest_servers']:.2f}",
             f"{r['busiest_server_share']:.0%}", f"{r['worker_cpu_ms']:.0f}", f"{r['server_cpu_ms']:.0f}",
             f"{r['worker_wakeups']:.0f}", f"{r['server_wakeups']:.0f}"]
            for r in records]
    return format_table(headers, rows)


def int_list(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8]."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="resnet18_v1",
                        help="whose gradients to push (default resnet18_v1)")
    parser.add_argument("--workers", type=int_list, default=[2, 4, 8, 16, 32],
                        help="comma-separated worker counts (default 2,4,8,16,32)")
    parser.add_argument("--servers", type=int_list, default=[1, 2, 4], help="comma-separated server counts (default 1,2,4)")
    parser.add_argument("--host-reduce", default="off,on", help="BPS_GOSSIP_HOST_REDUCE values (default off,on)")
    parser.add_argument("--placement", default="plan", help="partitions' servers: plan (balanced by "
                        "bps_gossip.worker.server_choice.plan_servers), hash, or both: plan,hash (default plan)")
    parser.add_argument("--compute-ms", type=float, default=100.0, help="emulated compute per step (default 100)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per pass (default 10)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per configuration (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    parser.add_argument("--no-fusion", action="store_true", help="push every gradient alone (default: fused "
                                                                 "into buckets as mxnet_plugin does)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--logdir", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument("--worker-kind", help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # BYTEPS_PARTITION_BYTES of this environment reaches every process of the run.
    args.partition_bytes = load_config({**os.environ, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "1"}).partition_bytes
    args.host_reduce = [v.strip() for v in args.host_reduce.split(",") if v.strip()]
    args.placement = [v.strip() for v in args.placement.split(",") if v.strip()]
    for option, values, known in (("--host-reduce", args.host_reduce, HOST_REDUCE), ("--placement", args.placement, PLACEMENTS)):
        if not set(values) <= set(known) or not values:
            parser.error(f"{option} takes {' and '.join(known)}, comma-separated")
    if not args.workers or min(args.workers) < 2 or not args.servers or min(args.servers) < 1:
        parser.error("--workers needs counts of at least 2, --servers of at least 1")
    if args.steps < 1 or args.passes < 1 or args.warmup < 0 or args.compute_ms < 0:
        parser.error("--steps and --passes must be at least 1, --warmup and --compute-ms at least 0")
    return args


def main() -> int:
    """Drive every worker count, print the table, write the JSON."""
    args = parse_args()
    if args.worker_kind:
        return worker_main()
    install_sigterm_handler()
    pushed = pushed_tensors(PRESETS[args.preset], fuse=not args.no_fusion)
    nbytes = 4 * sum(count for _, count, _ in pushed)
    print(f"{args.preset}: {nbytes / 2**20:.1f} MiB in {len(PRESETS[args.preset])} gradients, "
          f"{len(pushed)} push_pulls a step (BYTEPS_PARTITION_BYTES {args.partition_bytes}); compute "
          f"{args.compute_ms:g} ms a step (slept)\n"
          "overhead = step - compute (median of timed steps, slowest rank); bound = 2 x N x copy(B) + "
          "sum(N, B), measured before every pass; ratio = overhead / bound\n", flush=True)
    started, info, records = time.monotonic(), machine_info(), []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        job = Job(logdir)
        try:
            for workers in args.workers:
                found = bench_workers(job, workers, pushed, args)
                print(format_rows(found) if not records else "\n".join(format_rows(found).splitlines()[2:]),
                      flush=True)
                records += found
        except BenchError as exc:
            print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            job.close(grace=0.0)
    print(f"\ntotal {time.monotonic() - started:.0f} s (load average at the end: {os.getloadavg()[0]:.1f})")
    write_json(args.json, {"what": "scale", "preset": args.preset, "model_bytes": nbytes, "push_pulls": len(pushed),
                           "fusion": not args.no_fusion, "partition_bytes": args.partition_bytes,
                           "compute_ms": args.compute_ms, "steps": args.steps, "passes": args.passes,
                           "warmup": args.warmup, "machine_at_start": info, "machine_at_end": machine_info(),
                           "when": time.strftime("%Y-%m-%d"), "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
