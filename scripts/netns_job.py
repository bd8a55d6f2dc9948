"""A bps_gossip job on emulated hosts (scripts/netns.py): the scheduler, servers and workers
each in its own network namespace, started with bpslaunch in BytePS mode. Used by
scripts/netns_cluster.py, netns_tta.py, bench_compression.py and bench_push_pull.py.

Every process gets the DMLC_* variables of its host: DMLC_PS_ROOT_URI is the scheduler's
namespace address and DMLC_NODE_HOST the process's own, so every payload crosses a link
over TCP (the shared-memory path is taken only between processes advertising the same
address). Output lines are prefixed with the role or rank; the exit status is the first
non-zero one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import netns

from bps_gossip.launch.supervisor import Supervisor

SCHEDULER_PORT = 9000  # fixed is fine: the port exists only inside the scheduler's private namespace
LAUNCHER = [sys.executable, "-m", "bps_gossip.launch"]  # bpslaunch, with this interpreter


def host_names(workers: int, servers: int) -> list[str]:
    """The emulated machines: one scheduler, ``servers`` servers, ``workers`` workers."""
    return ["scheduler", *(f"server{i}" for i in range(servers)), *(f"worker{i}" for i in range(workers))]


def parse_slow(items: Sequence[str]) -> dict[str, float]:
    """['worker3=100'] -> {'worker3': 100.0}."""
    slow = {}
    for item in items:
        host, sep, rate = item.partition("=")
        try:
            slow[host.strip()] = float(rate)
        except ValueError:
            sep = ""
        if not sep or slow.get(host.strip(), -1) < 0:
            raise SystemExit(f"--slow {item!r}: use HOST=MBIT, e.g. worker3=100")
    return slow


def role_env(net: netns.Network, host: str, workers: int, servers: int, port: int = SCHEDULER_PORT,
             base: Mapping[str, str] | None = None, local_size: int = 1) -> dict[str, str]:
    """The environment of the process on ``host`` (its role and worker id follow from the name);
    ``local_size`` workers run on each worker host (BYTEPS_LOCAL_SIZE)."""
    role = host.rstrip("0123456789")
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BPS_GOSSIP_PORT")}
    env.update({
        "DMLC_ROLE": role, "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
        "DMLC_PS_ROOT_URI": net.address("scheduler"), "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NODE_HOST": net.address(host),  # what this process advertises: its own link, not loopback
        "DMLC_INTERFACE": netns.HOST_IFACE,  # ps-lite's (MXNet dist_sync) way of picking the address
        "BYTEPS_LOCAL_SIZE": str(local_size if role == "worker" else 1),
    })
    if role == "worker":
        env["DMLC_WORKER_ID"] = host[len("worker"):]
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_job(net: netns.Network, workers: int, servers: int, command: Sequence[str],
            base_env: Mapping[str, str] | None = None, port: int = SCHEDULER_PORT, local_size: int = 1) -> int:
    """Start the scheduler, servers and workers (``command``, ``local_size`` of them on each
    worker host) in their namespaces with bpslaunch in BytePS mode; return the first non-zero
    exit code (fail-fast), else 0."""
    if not command:
        raise SystemExit("no worker command given (e.g. -- python examples/train_digits.py)")
    with Supervisor() as sup:
        for host in host_names(workers, servers):
            env = role_env(net, host, workers, servers, port, base_env, local_size)
            if env["DMLC_ROLE"] == "worker":
                rank = env["DMLC_WORKER_ID"]
                sup.start(net.exec_argv(host, [*LAUNCHER, *command]), env, "worker", f"worker {rank}", f"[{rank}] ")
            else:
                sup.start(net.exec_argv(host, LAUNCHER), env, env["DMLC_ROLE"], host, f"[{host}] ")
        return sup.wait(fail_fast=True)


def build_network(workers: int, servers: int, mbit: float, slow: Mapping[str, float],
                  sysctls: Mapping[str, str] | None = None) -> netns.Network:
    """Check prerequisites, sweep namespaces of dead earlier runs, build and announce the network."""
    netns.check_prerequisites()
    removed = netns.cleanup_leftovers()
    if removed:
        print(f"netns_cluster: removed namespaces left by dead runs: {', '.join(removed)}", file=sys.stderr)
    net = netns.Network(host_names(workers, servers), mbit, dict(slow), sysctls=dict(sysctls or {})).create()
    print("netns_cluster: hosts\n" + net.describe(), file=sys.stderr, flush=True)
    return net
