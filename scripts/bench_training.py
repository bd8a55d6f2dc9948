"""Training throughput of every entry point against MXNet's dist_sync, same model and synthetic
data (``.venv/bin/python scripts/bench_training.py --quick``, ``--json training.json``).

Every system runs its own cluster (1 scheduler, 1 server, N workers) on 127.0.0.1, all at
once; the driver interleaves them pass by pass. A pass is ``--steps`` training steps after a
barrier, ended by ``mx.nd.waitall()``; samples/s = workers * batch * steps / the slowest rank's
time, median over passes. The default model is 1024-2048-2048-10 (25 MB of gradients a step);
``--model`` takes Gluon model-zoo CNNs.

``--configs 1w1s``: one worker forced through a local server (BYTEPS_FORCE_DISTRIBUTED=1; MXNet's
dist_sync with one worker). ``--wait-policy default,active,passive``: one run per OMP_WAIT_POLICY
(MXNet's wheel uses the system's libgomp): compare each system at its better policy.

"ours kvstore" is gluon.Trainer with ``kvstore=mx.kv.create('bpsgossip')``, "ours module" the
Module API with ``kvstore='bpsgossip'``; "no overlap" rows run with
BPS_GOSSIP_OVERLAP_BACKWARD=0. ``--systems`` picks rows by name (MXNet's is always kept;
``main``: one row per entry point). MXNet's Trainer gets ``mx.kv.create('dist_sync')`` (it
updates on the servers, its default). Allreduce and dist_sync keep every rank's parameters
identical: the driver checks that and aborts if not.

CPU per training step comes from /proc/<pid>/task/<tid>: "compute" (the worker's own threads),
"comm" (ours named bpsg-..., ZeroMQ's, ps-lite's), "other", and "server" (servers and the
scheduler). ``--threads auto`` gives each worker cores / workers; ``--summarize`` prints earlier
runs' JSON as one table. What the columns mean and the latest tables: docs/performance-training.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    CPU_CLASSES,
    CPU_SOURCE,
    BenchError,
    ClusterShape,
    Job,
    System,
    ThreadClock,
    WorkerGroup,
    format_table,
    install_sigterm_handler,
    machine_info,
    median,
    named_comm_threads,
    parse_configs,
    read_threads,
    serve,
    start_groups,
    threads_per_worker,
    write_json,
)

from bps_gossip.compat import zip_exact

REFERENCE = "mxnet dist_sync"
CEILING = "no communication"  # every worker trains alone, all at once: what communication can approach
NO_OVERLAP = {"BPS_GOSSIP_OVERLAP_BACKWARD": "0"}  # push_pull waited for and copied by the caller
TWO_COMM_CORES = {"BPS_GOSSIP_COMM_CORES": "2"}
COPIED = {"BPS_GOSSIP_SHM_GRADIENTS": "0"}  # MXNet's own gradient arrays, copied to and from shared memory
SYSTEMS = [
    System("ours allreduce", "bps", mode="allreduce"),
    System("ours allreduce, copied gradients", "bps", env=COPIED, mode="allreduce"),
    System("ours allreduce, no overlap", "bps", env=NO_OVERLAP, mode="allreduce"),
    System("ours kvstore", "bps", mode="kvstore"),
    System("ours kvstore, copied gradients", "bps", env=COPIED, mode="kvstore"),
    System("ours kvstore, no overlap", "bps", env=NO_OVERLAP, mode="kvstore"),
    System("ours module", "bps", mode="module"),
    System("ours module, copied gradients", "bps", env=COPIED, mode="module"),
    System("ours gossip", "bps", mode="gossip"),
    System("ours gossip, overlap", "bps", mode="gossip-overlap"),
    # Placement (bps_gossip/placement.py) as bpslaunch -np applies it, with 2 cores reserved: every
    # process starts on its cores, a worker's communication threads and the servers on the reserved ones.
    System("ours allreduce, 2 comm cores", "bps", env=TWO_COMM_CORES, mode="allreduce"),
    System("ours gossip, 2 comm cores", "bps", env=TWO_COMM_CORES, mode="gossip"),
    System(REFERENCE, "mxnet", mode="dist_sync"),
    System(CEILING, "local", mode="local"),
]
SYNCHRONOUS = ("allreduce", "kvstore", "module", "dist_sync")  # modes whose ranks must end with identical parameters
LAYERS = (1024, 2048, 2048, 10)
MODELS = {"mlp": 64, "resnet18_v1": 16, "mobilenet0.25": 32, "mobilenetv2_0.25": 32}  # model -> default batch per worker
ZOO = {"resnet18_v1": "resnet18_v1", "mobilenet0.25": "mobilenet0_25", "mobilenetv2_0.25": "mobilenet_v2_0_25"}


# -- worker -------------------------------------------------------------------------------

class TrainingWorker:
    """Runs inside one worker process: the model, the trainer, the timed steps."""

    def __init__(self, kind: str, mode: str) -> None:
        import mxnet as mx

        self.mx = mx
        self.kind = kind
        self.mode = mode
        self.clock = ThreadClock()  # CPU by class of thread during the timed passes
        if kind == "bps":
            import mxnet_plugin as bps

            bps.init()
            self.bps = bps
            self.rank, self.size = bps.rank(), bps.size()
            self.clock.comm_tids = named_comm_threads(read_threads())  # our engine thread, ZeroMQ's I/O threads
        elif kind == "local":
            self.rank, self.size = int(os.environ["DMLC_WORKER_ID"]), int(os.environ["DMLC_NUM_WORKER"])
        else:
            # ps-lite's threads have no names of their own: they are the ones kv.create starts,
            # once MXNet's engine and OpenMP threads run (a parallel operation starts them).
            (mx.nd.ones((1 << 20,)) * 2).wait_to_read()
            before = read_threads()
            self.kv = mx.kv.create("dist_sync")
            after = read_threads()
            self.clock.comm_tids = (set(after) - set(before)) | named_comm_threads(after)
            self.rank, self.size = self.kv.rank, self.kv.num_workers
        self.trainer: Any = None

    def barrier(self) -> None:
        """Line the ranks up before a timed pass."""
        if self.kind == "bps":
            import bps_gossip

            bps_gossip.barrier()
        elif self.kind == "mxnet":
            self.kv._barrier()
        # local: nothing to line up with; the driver starts every worker's pass at once

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        """Report rank and size once the rendezvous is done."""
        return {"rank": self.rank, "size": self.size, "pid": os.getpid()}

    def setup(self, message: dict[str, Any]) -> dict[str, Any]:
        """Build model, data and trainer, then run the warm-up steps (first step broadcasts)."""
        mx = self.mx
        gluon = mx.gluon
        mx.random.seed(1000 + self.rank)  # different initial models: the first step must unify them
        net, sample_shape = build_model(mx, message["model"])
        net.initialize(mx.init.Xavier())
        net.hybridize()
        self.net = net
        self.batch = message["batch"]
        self.step_batch = self.batch  # what trainer.step gets
        self.data = [(mx.nd.random.normal(shape=(self.batch, *sample_shape)),
                      mx.nd.random.randint(0, 10, shape=(self.batch,)).astype("float32"))
                     for _ in range(4)]
        net(self.data[0][0])  # deferred shapes become known before any trainer exists
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        optimizer = ("sgd", {"learning_rate": 0.01, "momentum": 0.9})
        try:
            if self.kind == "bps" and self.mode == "module":
                self.trainer = ModuleSteps(mx, net, self.data[0], optimizer)
            elif self.kind == "bps" and self.mode == "kvstore":
                self.trainer = gluon.Trainer(net.collect_params(), *optimizer, kvstore=mx.kv.create("bpsgossip"))
                self.step_batch = self.batch * self.size  # a KVStore sums: the global batch size
            elif self.kind == "bps":
                mode, _, variant = self.mode.partition("-")
                self.trainer = self.bps.DistributedTrainer(net.collect_params(), *optimizer, mode=mode,
                                                           overlap=variant == "overlap")
            elif self.kind == "local":
                self.trainer = gluon.Trainer(net.collect_params(), *optimizer, kvstore=None)
            elif message["model"] == "mlp":
                self.trainer = gluon.Trainer(net.collect_params(), *optimizer, kvstore=self.kv)
            else:
                self.trainer = KVStoreGradients(mx, gluon.Trainer(net.collect_params(), *optimizer, kvstore=None),
                                                self.kv)
        except Exception as exc:
            return {"unavailable": f"{type(exc).__name__}: {exc}"}
        self.steps_done = 0
        self.run_steps(message["warmup"])
        return {"parameters": sum(int(p.data().size) for p in net.collect_params().values()),
                "thread_names": self.clock.names()}

    def run_steps(self, steps: int) -> float:
        """``steps`` training steps; returns the last loss (mean over the batch)."""
        loss = None
        for _ in range(steps):
            x, y = self.data[self.steps_done % len(self.data)]
            if isinstance(self.trainer, ModuleSteps):
                loss = self.trainer.step(x, y)
                self.steps_done += 1
                continue
            with self.mx.autograd.record():
                loss = self.loss_fn(self.net(x), y)
            loss.backward()
            self.trainer.step(self.step_batch)
            self.steps_done += 1
        self.mx.nd.waitall()  # MXNet is asynchronous: a step is done when its results exist
        return float(loss.mean().asscalar()) if loss is not None else math.nan

    def timed_pass(self, message: dict[str, Any]) -> dict[str, Any]:
        """Barrier, then time ``steps`` steps."""
        self.barrier()
        self.clock.start()
        start = time.perf_counter()
        loss = self.run_steps(message["steps"])
        seconds = time.perf_counter() - start
        cpu = self.clock.stop()
        if not math.isfinite(loss):
            raise BenchError(f"{self.mode} rank {self.rank}: loss is {loss} after {self.steps_done} steps")
        return {"seconds": seconds, "loss": loss, "cpu": cpu}

    def checksum(self, message: dict[str, Any]) -> dict[str, Any]:
        """Sums of every trained parameter (float64) and of their squares, to compare ranks."""
        import numpy as np

        if hasattr(self.trainer, "flush"):
            self.trainer.flush()
        # Trained parameters only: BatchNorm's running statistics stay each rank's own in
        # synchronous modes (as in BytePS and MXNet).
        if isinstance(self.trainer, ModuleSteps):
            values = [v.asnumpy().astype(np.float64) for v in self.trainer.module.get_params()[0].values()]
        else:
            values = [p.data().asnumpy().astype(np.float64) for p in self.net.collect_params().values()
                      if p.grad_req != "null"]
        return {"sum": float(sum(v.sum() for v in values)), "sumsq": float(sum((v * v).sum() for v in values))}


class ModuleSteps:
    """The Module API on the benchmarked network: its symbol under SoftmaxOutput, the Gluon
    network's initial values, ``kvstore='bpsgossip'`` (Module broadcasts rank 0's values and
    rescales by the global batch size, as with dist_sync)."""

    def __init__(self, mx: Any, net: Any, sample: tuple[Any, Any], optimizer: tuple[str, dict[str, Any]]) -> None:
        self.mx = mx
        x, y = sample
        symbol = mx.sym.SoftmaxOutput(net(mx.sym.var("data")), name="softmax")
        self.module = mx.mod.Module(symbol, data_names=["data"], label_names=["softmax_label"], context=mx.cpu())
        self.module.bind(data_shapes=[("data", x.shape)], label_shapes=[("softmax_label", y.shape)])
        values = {name: p.data() for name, p in net.collect_params().items()}
        self.module.init_params(arg_params={k: v for k, v in values.items() if k in symbol.list_arguments()},
                                aux_params={k: v for k, v in values.items() if k in symbol.list_auxiliary_states()})
        self.module.init_optimizer(kvstore="bpsgossip", optimizer=optimizer[0], optimizer_params=optimizer[1])

    def step(self, x: Any, y: Any) -> Any:
        """One forward, backward and update; the batch's cross-entropy (not waited for)."""
        self.module.forward_backward(self.mx.io.DataBatch([x], [y]))
        self.module.update()
        return -self.mx.nd.log(self.mx.nd.pick(self.module.get_outputs()[0], y) + 1e-12)


class KVStoreGradients:
    """gluon.Trainer's update_on_kvstore=False path by hand: pushpull every gradient through
    MXNet's dist_sync KVStore (priority -index), then update locally.

    gluon.Trainer(kvstore=dist_sync) itself dies on CNNs here ("init N first" on the server,
    or ps-lite's "msg.data.size() >= 2"): after an inference forward the convolution weights
    hold oneDNN layouts, and MXNet's dist KVStore initializes keys from them wrongly (checked:
    the same init from default-layout copies always works). So keys start from host copies.
    """

    def __init__(self, mx: Any, trainer: Any, kv: Any) -> None:
        self.trainer = trainer
        self.kv = kv
        self.params = [p for p in trainer._params if p.grad_req != "null"]
        keys = list(range(len(self.params)))
        kv.init(keys, [mx.nd.array(p.data().asnumpy()) for p in self.params])
        kv._barrier()
        kv.pull(keys, out=[p.data() for p in self.params])  # rank 0's initial values everywhere
        mx.nd.waitall()

    def step(self, batch_size: int) -> None:
        """Sum the gradients over workers, then update."""
        for index, param in enumerate(self.params):
            self.kv.pushpull(index, param.grad(), out=param.grad(), priority=-index)
        self.trainer.update(batch_size)


def build_model(mx: Any, model: str) -> tuple[Any, tuple[int, ...]]:
    """The benchmarked network and the shape of one sample."""
    gluon = mx.gluon
    if model == "mlp":
        net = gluon.nn.HybridSequential()
        with net.name_scope():
            for fan_in, fan_out in zip_exact(LAYERS[:-2], LAYERS[1:-1]):
                net.add(gluon.nn.Dense(fan_out, activation="relu", in_units=fan_in))
            net.add(gluon.nn.Dense(LAYERS[-1], in_units=LAYERS[-2]))
        return net, (LAYERS[0],)
    net = getattr(gluon.model_zoo.vision, ZOO[model])(classes=10)
    return net, (3, 32, 32)


def worker_main(kind: str, mode: str) -> int:
    """Entry point of a worker process (started by the driver with --worker-kind)."""
    worker = TrainingWorker(kind, mode)
    code = serve({"hello": worker.hello, "setup": worker.setup, "pass": worker.timed_pass,
                  "checksum": worker.checksum})
    if kind == "bps":
        worker.bps.shutdown()
    return code


# -- driver -------------------------------------------------------------------------------

def check_consistent(group: WorkerGroup) -> dict[str, Any]:
    """Parameter checksums of every rank; identical ranks are required in synchronous modes."""
    sums = group.command({"cmd": "checksum"}, 120)
    distinct = {(s["sum"], s["sumsq"]) for s in sums}
    if group.system.mode in SYNCHRONOUS and len(distinct) != 1:
        raise BenchError(f"{group.system.name} ({group.shape.label}): ranks ended with different "
                         f"parameters: {sums}")
    return {"identical_ranks": len(distinct) == 1, "checksums": sums}


def add_cpu(entry: dict[str, Any], replies: list[dict[str, Any]], before: dict[str, float],
            after: dict[str, float]) -> None:
    """Add one pass's CPU seconds to ``entry['cpu_seconds']``: the workers' threads by class
    (summed over workers), the scheduler's and the servers' processes (driver's readings)."""
    total = entry.setdefault("cpu_seconds", {})
    for cpu in (r["cpu"] for r in replies):
        for cls, seconds in cpu.items():
            total[cls] = total.get(cls, 0.0) + seconds
    for role in after:
        total[role] = total.get(role, 0.0) + max(0.0, after[role] - before.get(role, 0.0))


def cpu_per_step(cpu_seconds: dict[str, float], workers: int, steps: int) -> dict[str, float]:
    """CPU milliseconds per training step: a worker's (mean over workers) by class of thread,
    and the servers' and scheduler's together ('server': the whole job's, not per worker)."""
    per_step = {cls: cpu_seconds[cls] / (workers * steps) * 1e3 for cls in CPU_CLASSES if cls in cpu_seconds}
    for role in ("servers", "scheduler"):
        if role in cpu_seconds:
            per_step[role] = cpu_seconds[role] / steps * 1e3
    if "servers" in per_step:
        per_step["server"] = per_step["servers"] + per_step["scheduler"]
    return per_step


WAIT_POLICIES = ("default", "active", "passive")  # OMP_WAIT_POLICY: unset (libgomp's spin, then sleep), or set


def bench_shape(job: Job, shape: ClusterShape, threads: int, args: argparse.Namespace,
                policy: str = "default") -> dict[str, Any]:
    """Every system on one cluster configuration, interleaved pass by pass, with ``threads``
    OpenMP threads per worker waiting by ``policy``."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process of every system
    os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spincount="):  # libgomp's spin before sleeping (default 300000), not forever
        os.environ["GOMP_SPINCOUNT"] = policy.split("=", 1)[1]
    elif policy != "default":
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    groups = start_groups(job, args.systems, shape, argv)
    results: dict[str, Any] = {}
    try:
        live = []
        for group in groups:
            setup = {"cmd": "setup", "batch": args.batch, "warmup": args.warmup, "model": args.model}
            replies = group.command(setup, 300)
            reason = next((r["unavailable"] for r in replies if "unavailable" in r), None)
            if reason is not None:
                results[group.system.name] = {"unavailable": reason}
                print(f"note: {group.system.name} ({shape.label}) is n/a: {reason}", flush=True)
                group.close()  # its ranks may disagree about what failed: stop them now
                continue
            results[group.system.name] = {"parameters": replies[0]["parameters"], "pass_seconds": [],
                                          "thread_names": replies[0]["thread_names"]}
            live.append(group)
        for index in range(args.passes):
            for group in live if index % 2 == 0 else live[::-1]:
                before = group.support_cpu()
                replies = group.command({"cmd": "pass", "steps": args.steps}, 600)
                entry = results[group.system.name]
                add_cpu(entry, replies, before, group.support_cpu())
                entry["pass_seconds"].append(max(r["seconds"] for r in replies))
                entry["last_loss"] = [r["loss"] for r in replies]
        for group in live:
            entry = results[group.system.name]
            entry.update(check_consistent(group))
            seconds = median(entry["pass_seconds"])
            entry["samples_per_s"] = shape.workers * args.batch * args.steps / seconds
            entry["ms_per_step"] = seconds / args.steps * 1e3
            # Other jobs on the VM make passes bimodal; the best pass shows the uncontended speed.
            entry["best_samples_per_s"] = shape.workers * args.batch * args.steps / min(entry["pass_seconds"])
            entry["cpu_ms_per_step"] = cpu_per_step(entry["cpu_seconds"], shape.workers, args.steps * args.passes)
    finally:
        for group in groups:
            group.close()
    return {"config": shape.label, "workers": shape.workers, "servers": shape.servers, "threads": threads,
            "wait_policy": policy, "systems": results}


def bench_sequentially(job: Job, shape: ClusterShape, threads: int, args: argparse.Namespace,
                       policy: str) -> dict[str, Any]:
    """As :func:`bench_shape`, one system's cluster at a time: an idle cluster's OpenMP threads
    spin forever under OMP_WAIT_POLICY=ACTIVE and take the cores of the one being timed."""
    merged: dict[str, Any] = {}
    for system in args.systems:
        record = bench_shape(job, shape, threads, argparse.Namespace(**{**vars(args), "systems": [system]}), policy)
        merged.setdefault("record", record)["systems"].update(record["systems"])
    return merged["record"]


def _ratio(entry: dict[str, Any], ref: dict[str, Any], key: str) -> str:
    """entry / reference for ``key``, as '1.23x', or 'n/a' without a reference."""
    return f"{entry[key] / ref[key]:.2f}x" if key in ref else "n/a"


CPU_COLUMNS = ("compute", "comm", "other", "server")  # keys of cpu_ms_per_step shown, in this order


def _cpu_cells(system: System, entry: dict[str, Any]) -> list[str]:
    """CPU ms per step by class; '-' where the system has no such threads or processes."""
    cpu = entry.get("cpu_ms_per_step", {})
    absent = {"comm", "server"} if system.kind == "local" else set()
    return ["-" if key in absent or key not in cpu else f"{cpu[key]:.1f}" for key in CPU_COLUMNS]


def format_results(records: list[dict[str, Any]]) -> str:
    """One row per (configuration, system): samples/s, ms/step, the ratios to MXNet and to the
    ceiling, and where the CPU went (ms per step: a worker's compute and communication
    threads, its other threads, all servers and the scheduler)."""
    rows = []
    for rec in records:
        ref = rec["systems"].get(REFERENCE, {})
        ceiling = rec["systems"].get(CEILING, {})
        for system in SYSTEMS:
            if system.name not in rec["systems"]:
                continue  # not selected with --systems
            entry = rec["systems"].get(system.name, {})
            head = [rec["config"], _threads(rec), system.name]
            if "samples_per_s" not in entry:
                rows.append([*head, *["n/a"] * (6 + len(CPU_COLUMNS))])
                continue
            rows.append([*head, f"{entry['samples_per_s']:.0f}", f"{entry['ms_per_step']:.1f}",
                         _ratio(entry, ref, "samples_per_s"), _percent(entry, ceiling),
                         f"{entry['best_samples_per_s']:.0f}", _ratio(entry, ref, "best_samples_per_s"),
                         *_cpu_cells(system, entry)])
    return format_table(["config", "threads", "system", "samples/s", "ms/step", "ratio vs mxnet", "% of ceiling",
                         "best pass samples/s", "best ratio", *[f"{key} ms/step" for key in CPU_COLUMNS]], rows)


def _threads(rec: dict[str, Any]) -> str:
    """'2', or '2 active' when OpenMP's wait policy was set."""
    policy = rec.get("wait_policy", "default")
    return f"{rec.get('threads', '')}" + ("" if policy == "default" else f" {policy}")


def _percent(entry: dict[str, Any], ceiling: dict[str, Any]) -> str:
    key = "samples_per_s"
    return f"{100 * entry[key] / ceiling[key]:.0f}%" if key in ceiling else "n/a"


def summarize(paths: list[Path]) -> str:
    """The results of earlier runs (their --json files) as one Markdown table, and under it the
    lowest % of the ceiling among our rows of each configuration."""
    lines = ["| model | config | threads | system | samples/s | % of ceiling | vs MXNet | compute ms/step | "
             "comm ms/step | other ms/step | server ms/step |", "|" + "---|" * 11]
    lowest = []
    for path in paths:
        data = json.loads(path.read_text())
        for rec in data["results"]:
            ref = rec["systems"].get(REFERENCE, {})
            ceiling = rec["systems"].get(CEILING, {})
            ours = []
            for system in (s for s in SYSTEMS if s.name in rec["systems"]):
                entry = rec["systems"][system.name]
                if "samples_per_s" not in entry:
                    continue
                percent = _percent(entry, ceiling)
                lines.append(f"| {data['model']} | {rec['config']} | {_threads(rec)} | {system.name} | "
                             f"{entry['samples_per_s']:.0f} | {percent} | {_ratio(entry, ref, 'samples_per_s')} | "
                             + " | ".join(_cpu_cells(system, entry)) + " |")
                if system.kind == "bps" and "samples_per_s" in ceiling:
                    ours.append((entry["samples_per_s"] / ceiling["samples_per_s"], system.name))
            if ours:
                share, name = min(ours)
                lowest.append(f"{data['model']} {rec['config']} x {_threads(rec)} threads: "
                              f"lowest of ours {100 * share:.0f}% of the ceiling ({name})")
    return "\n".join(lines + [""] + lowest)


def cores_note() -> str:
    """The cores this process may use, as the header says it ('auto' divides them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} usable cores"


def parse_args() -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 workers only, 3 passes of 5 steps")
    parser.add_argument("--configs", help="comma-separated WwSs shapes (default 2w1s,4w1s; --quick 2w1s); 1w1s: one worker "
                             "forced through a local server")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp",
                        help="mlp (1024-2048-2048-10), or a Gluon model-zoo CNN at 32x32 inputs")
    parser.add_argument("--batch", type=int, help="samples per worker and step (default: mlp 64, "
                        "resnet18_v1 16, mobilenet0.25 and mobilenetv2_0.25 32)")
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of every worker: a count, 'auto' "
                        "(the cores this process may use / workers: every core computes), or several, "
                        "comma-separated, each a run of every configuration (default 1: 2 workers fill 2 cores)")
    parser.add_argument("--wait-policy", default="default",
                        help="OMP_WAIT_POLICY of every process: comma-separated of default (unset), active, "
                             "passive, spincount=N (GOMP_SPINCOUNT=N); each is one more run of every configuration")
    parser.add_argument("--sequential", action="store_true",
                        help="one system's cluster at a time (needed with --wait-policy active: idle OpenMP "
                             "threads of the others would spin); default: all at once, passes interleaved")
    parser.add_argument("--steps", type=int, help="timed steps per pass (default 10; --quick 5)")
    parser.add_argument("--passes", type=int, help="timed passes per system (default 5; --quick 3)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after building the trainer")
    parser.add_argument("--systems", help="comma-separated substrings of the rows to run, e.g. 'allreduce', or "
                        "'main': one row per entry point, no variants (default: all; "
                        f"{REFERENCE!r} and {CEILING!r} always run)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="JSON",
                        help="print earlier runs' --json files as one Markdown table, and run nothing")
    parser.add_argument("--logdir", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument("--worker-kind", help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shapes = parse_configs(args.configs or ("2w1s" if args.quick else "2w1s,4w1s"), min_workers=1)
    args.policies = [part.strip().lower() for part in args.wait_policy.split(",") if part.strip()] or ["default"]
    bad = [policy for policy in args.policies if policy not in WAIT_POLICIES
           and not (policy.startswith("spincount=") and policy.split("=", 1)[1].isdigit())]
    if bad:
        parser.error(f"--wait-policy {','.join(bad)}: use {', '.join(WAIT_POLICIES)} or spincount=N (GOMP_SPINCOUNT)")
    args.batch = args.batch or MODELS[args.model]
    args.steps = args.steps or (5 if args.quick else 10)
    args.passes = args.passes or (3 if args.quick else 5)
    args.thread_specs = [part.strip() for part in args.threads.split(",") if part.strip()] or ["1"]
    for spec in args.thread_specs:
        threads_per_worker(spec, 1)  # a bad value stops here, before any cluster starts
    wanted = [part.strip() for part in (args.systems or "").split(",") if part.strip()]
    args.systems = [system for system in SYSTEMS if system.name in (REFERENCE, CEILING)
                    or not wanted or any(w in system.name for w in wanted)
                    or ("main" in wanted and not system.env)]
    cores = len(os.sched_getaffinity(0))
    most = max(shape.workers for shape in args.shapes)
    if cores < int(TWO_COMM_CORES["BPS_GOSSIP_COMM_CORES"]) + most:  # bpslaunch would refuse: no core left to compute
        skipped = [system.name for system in args.systems if system.env is TWO_COMM_CORES]
        if skipped:
            print(f"skipped ({cores} cores for {most} workers and 2 reserved): {', '.join(skipped)}", flush=True)
        args.systems = [system for system in args.systems if system.env is not TWO_COMM_CORES]
    return args


def main() -> int:
    """Drive every configuration, print the table, write the JSON."""
    args = parse_args()
    if args.worker_kind:
        return worker_main(args.worker_kind, args.worker_mode)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    install_sigterm_handler()
    model = f"MLP {'-'.join(map(str, LAYERS))}" if args.model == "mlp" else f"{args.model} (32x32)"
    print(f"{model}, batch {args.batch} per worker, OMP_NUM_THREADS={args.threads} ({cores_note()}), "
          f"{args.steps} steps per pass, median of {args.passes} passes; ratio = samples/s / {REFERENCE}'s "
          "(>1: faster than MXNet); CPU ms per step: a worker's compute threads (its Python, MXNet's engine and "
          "OpenMP), its communication threads (ours or ps-lite's, ZeroMQ's), its other threads, and all servers "
          f"and the scheduler together (from /proc/<pid>/task/*/{CPU_SOURCE})\n", flush=True)
    started = time.monotonic()
    info = machine_info()
    records = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        job = Job(logdir)
        try:
            for shape in args.shapes:
                for spec in args.thread_specs:
                    for policy in args.policies:
                        threads = threads_per_worker(spec, shape.workers)
                        records.append(bench_sequentially(job, shape, threads, args, policy) if args.sequential
                                       else bench_shape(job, shape, threads, args, policy))
                        print(format_results(records[-1:]) + "\n", flush=True)
        except BenchError as exc:
            print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            job.close(grace=0.0)
    print("all configurations:\n" + format_results(records))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    write_json(args.json, {"what": "training", "machine_at_start": info, "machine_at_end": machine_info(),
                           "model": args.model, "layers": LAYERS, "batch": args.batch, "steps": args.steps,
                           "passes": args.passes, "warmup_steps": args.warmup, "threads": args.thread_specs,
                           "wait_policies": args.policies,
                           "cpu_source": CPU_SOURCE, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
