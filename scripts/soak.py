"""Soak: an hour of random push_pulls, broadcasts and gossip, and every process's memory.

Starts a scheduler, 2 servers and 3 workers on 127.0.0.1 with a job secret (as bpslaunch
does). The workers run the same random sequence of operations (every rank draws from the
same seed): push_pull and broadcast of tensors from a pool of names with random sizes
(1 element to 4 MiB, over TCP and shared memory), and gossip rounds of random sizes. With
--attack, rank 0 also sends malformed and spoofed pushes and gossip every step (from
sockets that hold the secret but have no place in the address book). Every result is
checked exactly. The driver samples each process's resident memory (VmRSS) every
--interval seconds and prints a table, then the growth from the first sample after
warm-up to the last.

    python scripts/soak.py                      # 60 minutes
    python scripts/soak.py --minutes 5 --interval 30 --attack
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bps_gossip.compat import zip_exact
from bps_gossip.launch.local import free_port
from bps_gossip.launch.sessions import kill_groups, start_in_session

WORKER = '''
import json, math, os, random, sys, time
import msgpack, numpy as np, zmq
import bps_gossip as bps
from bps_gossip.api import _rt
from bps_gossip.config import load_config
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.transport.security import make_socket

deadline = time.time() + float(sys.argv[1])
attack = sys.argv[2] == "1"
bps.init()
rank, size = bps.rank(), bps.size()
names = {}
pool = random.Random(7)
for index in range(48):  # each name keeps its size; a few are large (partitioned, shared memory)
    names[f"t{index}"] = int(math.exp(pool.uniform(0, math.log(1 << 20))))
averagers = {n: GossipAverager({"w": np.zeros(int(math.exp(pool.uniform(0, math.log(1 << 18)))))}, tag=f"g{n}")
             for n in range(4)}
book = _rt("soak").engine.book
raw = []
if attack and rank == 0:
    for address in book.servers + [book.workers[1].addr]:
        sock = make_socket(zmq.Context.instance(), zmq.DEALER, load_config().keys, serve=False)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(address)
        raw.append(sock)
ops = 0
step = 0
while True:
    # every rank decides together whether to go on (the same deadline, the same step count)
    go = bps.broadcast(np.array([1.0 if time.time() < deadline else 0.0]), root_rank=0, name="go")
    if go[0] == 0.0:
        break
    rng = random.Random(step)
    for _ in range(8):
        kind = rng.random()
        name = rng.choice(sorted(names))
        count = names[name]
        if kind < 0.6:
            got = bps.push_pull(np.full(count, rank + 1.0, dtype=np.float32), name, average=False)
            assert float(got[0]) == size * (size + 1) / 2 and float(got[-1]) == float(got[0]), (name, got[:3])
        elif kind < 0.8:
            root = rng.randrange(size)
            got = bps.broadcast(np.full(count, float(rank), dtype=np.float32), root_rank=root, name="b" + name)
            assert float(got[0]) == root and float(got[-1]) == root
        else:
            averager = averagers[rng.randrange(len(averagers))]
            averager.step()
        ops += 1
    for sock in raw:  # junk that must be dropped: spoofed pushes, garbage, gossip from no peer
        for junk in ({"op": "push", "req": 1, "key": 1, "name": "t0", "part": 0, "seq": step, "count": 1,
                      "wire": "<f4", "dtype": "float32", "shape": [1], "kind": "sum", "gen": book.generation},
                     {"op": "push", "req": math.inf}, {"op": "gossip", "tag": "g0", "round": step, "gen": 1},
                     {"op": 7}):
            try:
                sock.send_multipart([msgpack.packb(junk), b"\\0" * 4], zmq.NOBLOCK)
            except zmq.Again:
                pass
        while sock.poll(0):
            sock.recv_multipart()
    step += 1
for averager in averagers.values():
    averager.flush()
print("SOAK", json.dumps({"rank": rank, "steps": step, "ops": ops}), flush=True)
bps.shutdown()
'''



def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between memory samples")
    parser.add_argument("--attack", action="store_true", help="rank 0 also sends junk every step")
    args = parser.parse_args()
    port = free_port()
    env = {**os.environ, "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "2", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": str(port), "BPS_GOSSIP_SECRET": secrets.token_hex(32), "PYTHONUNBUFFERED": "1",
           "BYTEPS_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    logdir = Path(tempfile.mkdtemp(prefix="bpsg_soak_"))
    script = logdir / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    procs: dict[str, subprocess.Popen] = {}

    def spawn(label: str, argv: list[str], extra: dict[str, str]) -> None:
        out = open(logdir / f"{label}.log", "w")
        procs[label] = start_in_session(argv, {**env, **extra}, stdout=out, stderr=subprocess.STDOUT)

    seconds = args.minutes * 60
    spawn("scheduler", [sys.executable, "-m", "bps_gossip.scheduler"], {"DMLC_ROLE": "scheduler"})
    for index in range(2):
        spawn(f"server{index}", [sys.executable, "-m", "bps_gossip.server"], {"DMLC_ROLE": "server"})
    for index in range(3):
        spawn(f"worker{index}", [sys.executable, str(script), str(seconds), "1" if args.attack else "0"],
              {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index)})
    labels = list(procs)
    print(f"soak: {args.minutes:g} min, 3 workers, 2 servers, attack={args.attack}, logs in {logdir}")
    print("minute  " + "  ".join(f"{label:>9}" for label in labels) + "   (VmRSS MiB)")
    samples: list[list[float | None]] = []
    start = time.monotonic()
    next_sample = start
    try:
        while any(procs[f"worker{i}"].poll() is None for i in range(3)):
            if time.monotonic() >= next_sample:
                row = [rss_mib(procs[label].pid) for label in labels]
                samples.append(row)
                cells = "  ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in row)
                print(f"{(time.monotonic() - start) / 60:6.1f}  {cells}", flush=True)
                next_sample += args.interval
            time.sleep(0.5)
            if time.monotonic() - start > seconds + 300:
                print("soak: workers did not finish 5 minutes after the deadline", file=sys.stderr)
                return 1
        for label in labels:
            procs[label].wait(60)
    finally:
        kill_groups(procs.values())
    return report(procs, labels, samples, logdir, args.interval)


def report(procs: dict[str, subprocess.Popen], labels: list[str], samples: list[list[float | None]],
           logdir: Path, interval: float) -> int:
    """Print the exit codes, the workers' results and how much each process grew; 0 if all is well."""
    codes = {label: proc.returncode for label, proc in procs.items()}
    results = []
    for index in range(3):
        for line in (logdir / f"worker{index}.log").read_text().splitlines():
            if line.startswith("SOAK "):
                results.append(json.loads(line[5:]))
    print("exit codes:", codes)
    print("workers:", results)
    warm = samples[min(1, len(samples) - 1)]
    last = samples[-1]
    print("growth from the sample at minute", f"{interval * min(1, len(samples) - 1) / 60:.1f}", "to the last:")
    for label, first, end in zip_exact(labels, warm, last):
        if first is not None and end is not None:
            print(f"  {label:>9}: {first:7.1f} -> {end:7.1f} MiB ({end - first:+.1f})")
    return 0 if all(code == 0 for code in codes.values()) and len(results) == 3 else 1

if __name__ == "__main__":
    sys.exit(main())
