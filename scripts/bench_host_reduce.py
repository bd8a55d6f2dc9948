"""One push per host, measured on emulated hosts (scripts/netns.py): two worker hosts with two
workers each (BYTEPS_LOCAL_SIZE=2), the scheduler and one server on hosts of their own, every
link rate-limited. Each job runs twice, BPS_GOSSIP_HOST_REDUCE=off (every worker pushes) and
auto (each host's leader pushes for it), side by side in one run:

- push_pull: STEPS push_pulls of a --mib MiB float32 tensor;
- training: STEPS steps of DistributedTrainer(mode='allreduce') on an MLP (--hidden wide) with
  random data (the gradients of each step are push_pulled in fused buckets);
- gossip: the same in the default mode (gossip): flat, every worker sends its own messages;
  by host (auto), each host's leader one message per host pair (bps_gossip.gossip.by_host).

It prints, per link rate, the time per step, the bytes the server's link carried in and
what the first worker host's link sent (from the kernel's counters of their namespaces),
and the ratios of auto to off (``--what`` picks some of the three kinds of job). Without
BPS_GOSSIP_SECRET(_FILE) the jobs run with plain sockets, as BytePS does: it says so once,
not once per process of every job. Needs root:

    sudo .venv/bin/python scripts/bench_host_reduce.py --mbit 1000 --mbit 100 --json docs/img/host_reduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns.py and netns_job.py live here

import netns  # noqa: E402
from netns_job import run_job  # noqa: E402

from bps_gossip.config import NO_SECRET_NOTED_VAR, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOSTS, LOCAL = 2, 2  # worker hosts, workers on each
KINDS = ("push_pull", "training", "gossip")

JOB = r'''
import json, os, sys, time
import numpy as np
import bps_gossip as bps

bps.init()
rank, size = bps.rank(), bps.size()
what, steps = os.environ["BENCH_WHAT"], int(os.environ["BENCH_STEPS"])
if what == "push_pull":
    x = np.full(int(os.environ["BENCH_MIB"]) << 18, rank + 1, np.float32)
    bps.push_pull(x, "t", average=False)  # warm-up: segments, connections
    start = time.perf_counter()
    for _ in range(steps):
        out = bps.push_pull(x, "t", average=False)
    seconds = time.perf_counter() - start
    assert np.all(out == size * (size + 1) / 2), out[:4]
    digest = float(out[:8].sum())
else:
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet_plugin import DistributedTrainer
    hidden = int(os.environ["BENCH_HIDDEN"])
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    mode = "allreduce" if what == "training" else "gossip"
    trainer = DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, mode=mode)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(rank)
    data = mx.nd.array(rng.normal(size=(32, 64)).astype(np.float32))
    label = mx.nd.array(rng.integers(0, 10, size=32).astype(np.float32))

    def step():
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(32)

    for _ in range(2):  # warm-up: the broadcast, buckets, segments
        step()
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    mx.nd.waitall()
    seconds = time.perf_counter() - start
    digest = float(sum(p.data().asnumpy().astype(np.float64).sum() for p in net.collect_params().values()))
with open(os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "seconds": seconds, "digest": digest}, f)
bps.shutdown()
'''


def run_one(net: netns.Network, mode: str, what: str, args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """One job; returns seconds per step (slowest rank), server-link bytes in and out per step."""
    steps = args.steps if what == "push_pull" else args.train_steps
    with tempfile.TemporaryDirectory() as out:
        os.chmod(out, 0o777)
        env = {**os.environ, "BPS_GOSSIP_HOST_REDUCE": mode, "BENCH_WHAT": what, "BENCH_STEPS": str(steps),
               "BENCH_MIB": str(args.mib), "BENCH_HIDDEN": str(args.hidden), "BENCH_OUT": out,
               "BPS_GOSSIP_TIMEOUT": "600", "PYTHONPATH": str(ROOT)}
        rx0, tx0 = net.traffic("server0")
        host_tx0 = net.traffic("worker0")[1]
        code = run_job(net, HOSTS, 1, [sys.executable, str(script)], env, local_size=LOCAL)
        rx1, tx1 = net.traffic("server0")
        host_tx1 = net.traffic("worker0")[1]
        if code:
            raise SystemExit(f"{what} job with BPS_GOSSIP_HOST_REDUCE={mode} failed with exit code {code}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if len(ranks) != HOSTS * LOCAL or what != "gossip" and len({r["digest"] for r in ranks}) != 1:
        raise SystemExit(f"{what} {mode}: ranks disagree or are missing: {ranks}")
    # The link counters include the warm-up and the job's start and end: bytes per job, divided.
    warm = 1 if what == "push_pull" else 2
    return {"seconds_per_step": max(r["seconds"] for r in ranks) / steps,
            "server_rx_per_step": (rx1 - rx0) / (steps + warm), "server_tx_per_step": (tx1 - tx0) / (steps + warm),
            "host_tx_per_step": (host_tx1 - host_tx0) / (steps + warm),
            "digest": ranks[0]["digest"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--mbit", type=float, action="append", help="link rate(s) in Mbit/s (default 1000 and 100)")
    parser.add_argument("--mib", type=int, default=16, help="push_pull tensor size in MiB (default 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed push_pulls (default 10)")
    parser.add_argument("--hidden", type=int, default=1024, help="training: MLP width (default 1024: 4.3 MB of gradients)")
    parser.add_argument("--train-steps", type=int, default=10, help="timed training steps (default 10)")
    parser.add_argument("--what", choices=KINDS, action="append", help="the jobs to run (default: all three)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    rates = args.mbit or [1000.0, 100.0]
    netns.check_prerequisites()
    netns.cleanup_leftovers()
    note_no_secret()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "host_reduce_job.py"
        script.write_text(JOB)
        os.chmod(tmp, 0o755)
        for mbit in rates:
            names = ["scheduler", "server0", *(f"worker{i}" for i in range(HOSTS))]
            with netns.Network(names, mbit) as net:
                for what in [kind for kind in KINDS if kind in (args.what or KINDS)]:
                    row = {"mbit": mbit, "what": what}
                    for mode in ("off", "auto"):
                        row[mode] = run_one(net, mode, what, args, script)
                    records.append(row)
                    print_row(row, header=len(records) == 1)
    if args.json:
        args.json.write_text(json.dumps({"hosts": HOSTS, "local": LOCAL, "mib": args.mib, "hidden": args.hidden,
                                         "records": records, "when": time.strftime("%Y-%m-%d")}, indent=1))
    return 0


def note_no_secret() -> None:
    """Without a job secret, say so once here: the many jobs' processes then do not, each."""
    if load_config({**os.environ, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "1"}).keys is None:
        print("no job secret (BPS_GOSSIP_SECRET / BPS_GOSSIP_SECRET_FILE unset): the jobs run with plain "
              "sockets, as BytePS does", file=sys.stderr, flush=True)
        os.environ[NO_SECRET_NOTED_VAR] = "1"  # every job's environment starts from this one


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'link':>10} {'job':>10} | {'off s/step':>10} {'auto s/step':>11} {'speed-up':>8} | "
              f"{'off MB in':>9} {'auto MB in':>10} {'ratio':>6} | {'host0 MB out off':>16} {'auto':>6} {'ratio':>6}",
              flush=True)
    off, auto = row["off"], row["auto"]
    print(f"{row['mbit']:>5g} Mbit {row['what']:>10} | {off['seconds_per_step']:>10.3f} "
          f"{auto['seconds_per_step']:>11.3f} {off['seconds_per_step'] / auto['seconds_per_step']:>7.2f}x | "
          f"{off['server_rx_per_step'] / 1e6:>9.1f} {auto['server_rx_per_step'] / 1e6:>10.1f} "
          f"{auto['server_rx_per_step'] / max(off['server_rx_per_step'], 1):>6.2f} | "
          f"{off['host_tx_per_step'] / 1e6:>16.1f} {auto['host_tx_per_step'] / 1e6:>6.1f} "
          f"{auto['host_tx_per_step'] / off['host_tx_per_step']:>6.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
