"""What placement's choices are worth on this host (docs/placement.md), each
experiment's rows alternated (A B C A B C ...) and compared side by side, medians of the
alternations, ratios to the first row:

- ``teams``: two processes training mobilenet0.25 at once, no communication: 1 OpenMP thread each
  against 2 each, spinning (libgomp's default wait policy) and sleeping when idle
  (OMP_WAIT_POLICY=PASSIVE, what the plan sets where the workers' threads outnumber the cores).
  With 2 cores, this is 2 workers x 2 threads on 2 cores.
- ``alone``: one worker forced distributed (its server and scheduler beside it, bpslaunch -np 1),
  DistributedTrainer allreduce on mobilenet0.25: the plan's default against every CPU computing
  with nothing reserved (OMP_NUM_THREADS = CPUs, BPS_GOSSIP_COMM_CORES=0) and against one core
  reserved (--comm-cores 1).
- ``pair``: the same with two workers (bpslaunch -np 2): the default against every CPU computing,
  nothing reserved (OMP_NUM_THREADS = CPUs / 2). On 2 cores both are 1 thread each, unpinned.

Where the default reserves cores (5 or more a worker), ``alone`` and ``pair`` also run the reserved
layout with one OpenMP thread fewer than the share has cores (room for the Python thread that
issues MXNet's operators).

    python scripts/bench_placement.py [--only teams,alone,pair] [--alternations 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bps_gossip from this checkout

from bps_gossip import placement  # noqa: E402

LAUNCH = [sys.executable, "-m", "bps_gossip.launch"]
CPUS = len(os.sched_getaffinity(0))

TRAIN = '''
import os, sys, time
import mxnet as mx
from mxnet import autograd, gluon
distributed = sys.argv[1] == "1"
if distributed:
    import mxnet_plugin as bps
    bps.init()
net = gluon.model_zoo.vision.get_model("mobilenet0.25", classes=10)
net.initialize()
x, y = mx.nd.random.uniform(shape=(32, 3, 32, 32)), mx.nd.zeros((32,))
net(x)
if distributed:
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, mode="allreduce")
else:
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
loss = gluon.loss.SoftmaxCrossEntropyLoss()
def step():
    with autograd.record():
        value = loss(net(x), y)
    value.backward()
    trainer.step(32)
    mx.nd.waitall()
for _ in range(5):
    step()
steps, start = int(sys.argv[2]), time.perf_counter()  # as many on every rank: they push_pull together
for _ in range(steps):
    step()
print("", "RATE", steps * 32 / (time.perf_counter() - start), flush=True)
if distributed:
    bps.shutdown()
'''


def rows(experiment: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, bpslaunch arguments or [] for two plain processes, environment) of each row."""
    if experiment == "teams":
        return [("1 thread each", [], {"OMP_NUM_THREADS": "1"}),
                ("2 threads each, spinning", [], {"OMP_NUM_THREADS": "2"}),
                ("2 threads each, OMP_WAIT_POLICY=PASSIVE", [], {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"})]
    workers = 1 if experiment == "alone" else 2
    launch = ["-np", str(workers)]
    force = {"BYTEPS_FORCE_DISTRIBUTED": "1"} if workers == 1 else {}
    made = [("placement default", launch, force),
            (f"every CPU computes ({max(1, CPUS // workers)} thread(s) each), nothing reserved", launch,
             {**force, "OMP_NUM_THREADS": str(max(1, CPUS // workers)), "BPS_GOSSIP_COMM_CORES": "0"})]
    if workers == 1 and CPUS >= 2:
        made.append(("--comm-cores 1", [*launch, "--comm-cores", "1"], force))
    default = placement.plan_here(workers, {}, placement.Options())
    if default.pinned and default.threads > 1:  # the Python thread that issues MXNet's operators needs a core too?
        made.append((f"reserved, one thread fewer ({default.threads - 1})", launch,
                     {**force, "OMP_NUM_THREADS": str(default.threads - 1), "BPS_GOSSIP_COMM_CORES": str(workers)}))
    return made


def run(script: Path, launch: list[str], env: dict[str, str], steps: int) -> float:
    """Samples per second of every process of one row (their sum)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "BPS_GOSSIP_COMM", "DMLC_"))}
    full.update(env, PYTHONUNBUFFERED="1", BYTEPS_LOG_LEVEL="ERROR", BPS_GOSSIP_NO_SECRET_NOTED="1")
    if launch:
        argv = [LAUNCH + launch + [sys.executable, str(script), "1", str(steps)]]
    else:
        argv = [[sys.executable, str(script), "0", str(steps)]] * 2
    procs = [subprocess.Popen(a, env=full, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for a in argv]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    rates = [float(line.split("RATE", 1)[1]) for out in outputs for line in out.splitlines() if " RATE " in line]
    if not rates or any(proc.returncode for proc in procs):
        raise SystemExit(f"a run failed ({launch}, {env}):\n" + "\n".join(out[-3000:] for out in outputs))
    return sum(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="teams,alone,pair", help="comma-separated: teams, alone, pair")
    parser.add_argument("--alternations", type=int, default=3, help="passes over each experiment's rows")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train.py"
        script.write_text(TRAIN)
        print(f"{CPUS} CPUs usable; mobilenet0.25, batch 32 per process; samples/s of all processes, "
              f"median of {args.alternations}")
        print("| experiment | row | samples/s | runs | vs first row |\n|---|---|---|---|---|")
        for experiment in args.only.split(","):
            made = rows(experiment)
            rates: dict[str, list[float]] = {label: [] for label, _, _ in made}
            for _ in range(args.alternations):
                for label, launch, env in made:
                    rates[label].append(run(script, launch, env, args.steps))
            first = statistics.median(rates[made[0][0]])
            for label, values in rates.items():
                median = statistics.median(values)
                print(f"| {experiment} | {label} | {median:.0f} | {' '.join(f'{v:.0f}' for v in values)} | "
                      f"{median / first:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
