"""push_pull latency and bandwidth: ours (mxnet_plugin) against MXNet's dist_sync KVStore.

    /tmp/venv/bin/python scripts/bench_push_pull.py --quick
    /tmp/venv/bin/python scripts/bench_push_pull.py --json push_pull.json
    /tmp/venv/bin/python scripts/bench_push_pull.py --sizes 4K,64M --configs 2w1s,2w2s
    /tmp/venv/bin/python scripts/bench_push_pull.py --curve --sizes 4K,1M,16M --configs 2w1s
    sudo .venv/bin/python scripts/bench_push_pull.py --netns 1000 --slow worker3=100 --configs 4w1s

For each cluster configuration every system runs its own scheduler, servers and
workers on 127.0.0.1, all at once; the driver then interleaves the systems pass by
pass (order reversed every other pass) because CPU steal on these VMs drifts over
seconds. A pass is ``iters`` back-to-back blocking push_pulls (sum) of a float32
NDArray; its time is the slowest rank's. The reported time per op is the median
over passes. Every result of every pass (and warm-up) is checked against the exact
sum over ranks; one wrong element aborts the run.

With ``--netns MBIT`` every process runs in its own network namespace (scripts/netns.py:
emulated hosts on a switch, links limited to MBIT Mbit/s, ``--slow`` for one host), so
every payload of both systems crosses a rate-limited link over TCP. Needs root.

Both systems write the result into the pushed array (ours by API, MXNet's dist
KVStore as a side effect), so every pass refills its inputs before the timer starts.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    BenchError,
    ClusterShape,
    Job,
    System,
    format_size,
    format_table,
    horovod_note,
    install_sigterm_handler,
    machine_info,
    median,
    parse_configs,
    parse_size,
    serve,
    shm_understood,
    start_groups,
    write_json,
)

from bps_gossip.compat import zip_exact

ALL_SIZES = "4K,64K,1M,4M,16M,64M"
ALL_CONFIGS = "2w1s,4w1s,2w2s"
QUICK_SIZES = "4K,1M,16M"
QUICK_CONFIGS = "2w1s"
REFERENCE = "mxnet dist_sync"
RANK_STRIDE = 4096.0  # per-rank offset of the fill values; all sums stay exact in float32


def systems(separate_hosts: bool = False, curve: bool = False) -> list[System]:
    """The columns, ours first. A data-path variant of ours is one more line here.

    Ours runs with a job secret (CURVE on every socket), as under bpslaunch; ``curve`` adds
    TCP lines with and without it, which is what authentication and encryption cost.
    """
    secret = {"BPS_GOSSIP_SECRET": secrets.token_hex(32)}
    if separate_hosts:  # every process on its own host: shared memory never applies
        ours = [System("ours (tcp)", "bps", secret)]
    elif shm_understood():
        ours = [System("ours (shm on)", "bps", {"BPS_GOSSIP_SHM": "1", **secret}),
                System("ours (shm off)", "bps", {"BPS_GOSSIP_SHM": "0", **secret})]
    else:
        ours = [System("ours", "bps", secret)]
    if curve:
        shm = {} if separate_hosts else {"BPS_GOSSIP_SHM": "0"}
        ours = [line for line in ours if line.name not in ("ours (tcp)", "ours (shm off)")]
        ours += [System("ours (tcp, CURVE)", "bps", {**shm, **secret}),
                 System("ours (tcp, no secret)", "bps", {**shm, "BPS_GOSSIP_SECRET": None})]
    return [*ours, System(REFERENCE, "mxnet")]


def iterations_for(nbytes: int) -> int:
    """push_pulls per pass: ~64 MiB of traffic per pass, at least 3, at most 100."""
    return max(3, min(100, (64 << 20) // nbytes))


# -- worker -------------------------------------------------------------------------------

class PushPullWorker:
    """Runs inside one worker process: owns the arrays and times the collective."""

    def __init__(self, kind: str) -> None:
        import mxnet as mx

        self.mx = mx
        self.kind = kind
        if kind == "bps":
            import mxnet_plugin as bps

            bps.init()
            self.bps = bps
            self.rank, self.size = bps.rank(), bps.size()
        else:
            self.kv = mx.kv.create("dist_sync")
            self.rank, self.size = self.kv.rank, self.kv.num_workers
        self.arrays: list[Any] = []
        self.outputs: list[Any] = []

    def barrier(self) -> None:
        """Line the ranks up before a timed pass."""
        if self.kind == "bps":
            import bps_gossip

            bps_gossip.barrier()
        else:
            self.kv._barrier()

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        """Report rank and size once the system's rendezvous is done."""
        return {"rank": self.rank, "size": self.size}

    def setup(self, message: dict[str, Any]) -> dict[str, Any]:
        """Allocate ``iters`` input (and output) arrays of ``bytes`` bytes, then warm up."""
        import numpy as np

        mx = self.mx
        count = message["bytes"] // 4
        self.name = f"bench_{message['bytes']}"
        pattern = (np.arange(count, dtype=np.int64) % 1021).astype(np.float32)
        self.fill = mx.nd.array(pattern + RANK_STRIDE * (self.rank + 1), dtype="float32")
        # sum over ranks of pattern + stride * (rank + 1) + j, before the "+ size * j" per iteration
        self.expected = pattern * self.size + np.float32(RANK_STRIDE * self.size * (self.size + 1) / 2)
        self.arrays = [mx.nd.zeros(count, dtype="float32") for _ in range(message["iters"])]
        if self.kind == "mxnet":
            self.outputs = [mx.nd.zeros(count, dtype="float32") for _ in self.arrays]
            self.kv.init(self.name, self.arrays[0])
        else:
            self.outputs = self.arrays  # in place: byteps_push_pull writes into its input
        for _ in range(message["warmup"]):
            self.run_pass(timed=False)
        return {}

    def refill(self) -> None:
        """Inputs for iteration j: pattern + stride * (rank + 1) + j; wait until written."""
        for j, array in enumerate(self.arrays):
            array[:] = self.fill + float(j)
        self.mx.nd.waitall()

    def run_pass(self, timed: bool = True) -> float:
        """Refill, line up, then time len(arrays) blocking push_pulls; check every result."""
        self.refill()
        self.barrier()
        start = time.perf_counter()
        if self.kind == "bps":
            for array in self.arrays:
                self.bps.byteps_push_pull(array, name=self.name, is_average=False)
        else:
            for array, out in zip_exact(self.arrays, self.outputs):
                self.kv.pushpull(self.name, array, out=out)
                out.wait_to_read()  # MXNet is asynchronous: an op ends when its result is readable
        seconds = time.perf_counter() - start
        self.check()
        return seconds if timed else 0.0

    def check(self) -> None:
        """Raise unless output j equals the exact sum over ranks for iteration j."""
        import numpy as np

        for j, out in enumerate(self.outputs):
            got = out.asnumpy()
            want = self.expected + np.float32(self.size * j)
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                first = int(bad[0])
                raise BenchError(
                    f"{self.kind} rank {self.rank}: wrong push_pull result for {self.name} iteration {j}: "
                    f"{bad.size} of {got.size} elements differ; first at [{first}]: got {got[first]!r}, "
                    f"expected {want[first]!r}"
                )

    def timed_pass(self, message: dict[str, Any]) -> dict[str, Any]:
        """One timed pass."""
        return {"seconds": self.run_pass()}

    def free(self, message: dict[str, Any]) -> dict[str, Any]:
        """Drop this size's arrays."""
        self.arrays, self.outputs = [], []
        self.mx.nd.waitall()
        return {}


def worker_main(kind: str) -> int:
    """Entry point of a worker process (started by the driver with --worker-kind)."""
    worker = PushPullWorker(kind)
    code = serve({"hello": worker.hello, "setup": worker.setup, "pass": worker.timed_pass, "free": worker.free})
    if kind == "bps":
        worker.bps.shutdown()
    return code


# -- driver -------------------------------------------------------------------------------

def op_timeout(nbytes: int, iters: int) -> float:
    """A generous per-command deadline: 120 s plus 10 MB/s for every byte moved."""
    return 120.0 + iters * nbytes / 10e6


def bench_shape(job: Job, shape: ClusterShape, sizes: list[int], args: argparse.Namespace,
                columns: list[System], network: Any = None) -> list[dict[str, Any]]:
    """All sizes on one cluster configuration, systems interleaved; one record per size."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    groups = start_groups(job, columns, shape, argv, network)
    records = []
    try:
        for nbytes in sizes:
            iters = args.iters or iterations_for(nbytes)
            timeout = op_timeout(nbytes, iters)
            for group in groups:
                group.command({"cmd": "setup", "bytes": nbytes, "iters": iters, "warmup": args.warmup},
                              timeout * (args.warmup + 1))
            passes: dict[str, list[float]] = {g.system.name: [] for g in groups}
            for index in range(args.passes):
                for group in groups if index % 2 == 0 else groups[::-1]:
                    replies = group.command({"cmd": "pass"}, timeout)
                    passes[group.system.name].append(max(r["seconds"] for r in replies) / iters)
            for group in groups:
                group.command({"cmd": "free"}, 60)
            record = make_record(shape, nbytes, iters, passes)
            records.append(record)
            print(format_rows([record], columns, header=not records[:-1] and shape == args.shapes[0]),
                  flush=True)
    finally:
        for group in groups:
            group.close()
    return records


def make_record(shape: ClusterShape, nbytes: int, iters: int, passes: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, bandwidths and ratios of one (configuration, size)."""
    systems_out = {}
    for name, seconds in passes.items():
        per_op = median(seconds)
        systems_out[name] = {"ms_per_op": per_op * 1e3, "algbw_MBps": nbytes / per_op / 1e6,
                             "pass_ms_per_op": [s * 1e3 for s in seconds]}
    ref = systems_out[REFERENCE]["ms_per_op"]
    ratios = {name: ref / value["ms_per_op"] for name, value in systems_out.items() if name != REFERENCE}
    return {"config": shape.label, "workers": shape.workers, "servers": shape.servers, "bytes": nbytes,
            "iters_per_pass": iters, "systems": systems_out, "ratio_mxnet_over": ratios}


def format_rows(records: list[dict[str, Any]], columns: list[System], header: bool = True) -> str:
    """Table rows (with or without the header)."""
    headers = ["size", "config"]
    for system in columns:
        headers += [f"{system.name} ms", f"{system.name} MB/s"]
    headers += [f"ratio {s.name}" for s in columns if s.name != REFERENCE]
    rows = []
    for rec in records:
        row = [f"{format_size(rec['bytes']):>6}", rec["config"]]  # fixed width: rows stream one by one
        for system in columns:
            result = rec["systems"][system.name]
            row += [f"{result['ms_per_op']:.3f}", f"{result['algbw_MBps']:.0f}"]
        row += [f"{rec['ratio_mxnet_over'][s.name]:.2f}x" for s in columns if s.name != REFERENCE]
        rows.append(row)
    text = format_table(headers, rows)
    # Only the first call shows the header; later rows keep the column widths roughly aligned.
    return text if header else "\n".join(text.splitlines()[2:])


def parse_args() -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, configs {QUICK_CONFIGS}, 3 passes")
    parser.add_argument("--sizes", help=f"comma-separated tensor sizes (default {ALL_SIZES})")
    parser.add_argument("--configs", help=f"comma-separated WwSs shapes (default {ALL_CONFIGS})")
    parser.add_argument("--passes", type=int, help="timed passes per system and size (default 5; --quick 3)")
    parser.add_argument("--iters", type=int, default=0, help="push_pulls per pass (default: by size, 3-100)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed (but checked) passes before timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--logdir", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument("--netns", type=float, metavar="MBIT",
                        help="run every process in its own network namespace, links limited to MBIT Mbit/s "
                             "(0: unlimited); needs root (scripts/netns.py)")
    parser.add_argument("--slow", action="append", default=[], metavar="HOST=MBIT",
                        help="with --netns: a slower link for one host, e.g. worker3=100 (repeatable)")
    parser.add_argument("--curve", action="store_true",
                        help="add TCP lines with and without a job secret (what CURVE costs)")
    parser.add_argument("--worker-kind", help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else ALL_SIZES)).split(",")]
    args.shapes = parse_configs(args.configs or (QUICK_CONFIGS if args.quick else ALL_CONFIGS))
    args.passes = args.passes or (3 if args.quick else 5)
    if any(size % 4 for size in args.sizes):
        parser.error("sizes must be multiples of 4 bytes (float32)")
    if args.slow and args.netns is None:
        parser.error("--slow needs --netns")
    return args


def build_network(args: argparse.Namespace) -> Any:
    """With --netns: the emulated hosts of the largest configuration (scripts/netns.py); else None."""
    if args.netns is None:
        return None
    import netns
    from netns_job import host_names, parse_slow

    netns.check_prerequisites()
    hosts = host_names(max(s.workers for s in args.shapes), max(s.servers for s in args.shapes))
    slow = parse_slow(args.slow)
    if set(slow) - set(hosts):
        raise netns.NetnsError(f"--slow names unknown host(s) {sorted(set(slow) - set(hosts))}; hosts: {hosts}")
    netns.cleanup_leftovers()
    network = netns.Network(hosts, args.netns, slow).create()
    print("emulated hosts (network namespaces):\n" + network.describe() + "\n", flush=True)
    return network


def main() -> int:
    """Drive every configuration, print the table, write the JSON."""
    args = parse_args()
    if args.worker_kind:
        return worker_main(args.worker_kind)
    install_sigterm_handler()
    columns = systems(separate_hosts=args.netns is not None, curve=args.curve)
    notes = [n for n in [horovod_note()] if n]
    if not shm_understood() and args.netns is None:
        notes.append("BPS_GOSSIP_SHM not understood by bps_gossip yet: one 'ours' column")
    for note in notes:
        print(f"note: {note}")
    print("time per push_pull (sum, float32, blocking), median of passes; MB/s = tensor bytes / time; "
          f"ratio = {REFERENCE} time / ours (>1: ours faster)\n", flush=True)
    started = time.monotonic()
    info = machine_info()
    records: list[dict[str, Any]] = []
    try:
        network = build_network(args)
    except Exception as exc:  # NetnsError: not root, no iproute2, ...
        print(f"cannot build the emulated network: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        job = Job(logdir)
        try:
            for shape in args.shapes:
                records += bench_shape(job, shape, args.sizes, args, columns, network)
        except BenchError as exc:
            print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            job.close(grace=0.0)
            if network is not None:
                network.destroy()
    records.sort(key=lambda r: (r["bytes"], r["workers"], r["servers"]))
    print("\nsorted by size:\n" + format_rows(records, columns))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    write_json(args.json, {"what": "push_pull", "machine_at_start": info, "machine_at_end": machine_info(),
                           "passes": args.passes, "warmup_passes": args.warmup,
                           "systems": [s.name for s in columns], "notes": notes, "results": records,
                           "netns": None if network is None else {"mbit": args.netns, "slow": args.slow}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
