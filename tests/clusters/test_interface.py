"""DMLC_INTERFACE on hosts with two network interfaces (scripts/netns.py's TwoLinkNetwork: two
namespaces, each with eth0 on 10.213.0.0/24 and eth1 on 10.214.0.0/24): with DMLC_NODE_HOST
unset, the server and workers advertise and bind eth1's address, so the data crosses eth1 while
the scheduler stays at its eth0 address; a name that is no interface, or one without an IPv4
address, stops a process at start-up with an error that lists the interfaces. bpslaunch -H, which
sets DMLC_NODE_HOST to each host's listed address, leaves it to DMLC_INTERFACE when the user sets
it. Needs root and iproute2, and sshd for the last test (skipped otherwise); every namespace is
deleted at the end, pass or fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import FAST_ENV, assert_all_ok, results_by_rank

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
JOBS = Path(__file__).resolve().parents[1] / "jobs"
sys.path.insert(0, str(SCRIPTS))

import netns  # noqa: E402
import netns_ssh  # noqa: E402

try:
    netns.check_prerequisites()
    SKIP_WHY = ""
except netns.NetnsError as exc:
    SKIP_WHY = f"emulated hosts unavailable: {exc}"

pytestmark = [pytest.mark.skipif(bool(SKIP_WHY), reason=SKIP_WHY or "-"), pytest.mark.timeout(90)]

ELEMENTS = 1 << 18  # 1 MiB of float32 a push
ROUNDS = 3
DATA = netns.SECOND_IFACE  # the interface the job is told to use
WORKER = [str(JOBS / "interface_job.py"), "push_pull_on_the_interface", str(ELEMENTS), str(ROUNDS)]


@pytest.fixture
def hosts() -> Iterator[netns.TwoLinkNetwork]:
    """Hosts a and b, two links each; removed afterwards, also when the test fails."""
    netns.cleanup_leftovers()
    net = netns.TwoLinkNetwork(["a", "b"]).create()
    try:
        yield net
    finally:
        net.destroy()


def start(job, net: netns.TwoLinkNetwork, host: str, argv: list[str], name: str, **env: str):
    """``argv`` inside ``host``'s namespace, the scheduler at a's eth0 address, DMLC_NODE_HOST unset."""
    full = {**job.env, "DMLC_PS_ROOT_URI": net.address("a"), **env}
    full.pop("DMLC_NODE_HOST", None)
    return job.spawn(net.exec_argv(host, argv), full, name)


def test_processes_advertise_and_use_the_named_interface(hosts, cluster):
    """Scheduler, server and worker 0 on a, worker 1 on b, all with DMLC_INTERFACE=eth1."""
    job = cluster(2, 1, env={"DMLC_INTERFACE": DATA}, start_servers=False)
    for role in ("scheduler", "server"):
        start(job, hosts, "a", [sys.executable, "-m", f"bps_gossip.{role}"], role, DMLC_ROLE=role)
    worker = [sys.executable, *WORKER]
    procs = []
    for rank, host in enumerate(("a", "b")):
        proc = start(job, hosts, host, worker, f"worker{rank}", DMLC_ROLE="worker", DMLC_WORKER_ID=str(rank))
        proc.rank_hint = rank
        procs.append(proc)
    finished = job.wait(procs, timeout=60)
    assert_all_ok(finished, job)
    results = results_by_rank(finished)
    data = {host: hosts.address(host, DATA) for host in ("a", "b")}
    for rank, host in enumerate(("a", "b")):
        assert results[rank]["node_host"] == data[host], results[rank]
    for result in results:  # every rank's book: the server and both workers on eth1's subnet
        assert [s.rsplit(":", 1)[0] for s in result["servers"]] == [f"tcp://{data['a']}"], result
        assert [(addr.rsplit(":", 1)[0], host) for addr, host in result["workers"]] == [
            (f"tcp://{data['a']}", data["a"]), (f"tcp://{data['b']}", data["b"])], result
    # Worker 1 pushes to and pulls from the server on a over eth1; eth0 carries the scheduler's
    # few control messages only.
    moved = results[1]["bytes"]
    payload = ELEMENTS * 4 * ROUNDS
    assert moved[DATA] >= 2 * payload and moved[netns.HOST_IFACE] < payload // 10, moved


@pytest.mark.parametrize("name, message", [
    ("eth7", "DMLC_INTERFACE='eth7': no such network interface on this host"),
    ("bare0", "DMLC_INTERFACE='bare0' has no IPv4 address"),
])
def test_a_wrong_interface_stops_each_role_at_start_up(hosts, cluster, name, message):
    # An interface without an address: both ends of a veth pair left bare inside a's namespace.
    netns.run(["ip", "-n", hosts.hosts["a"].namespace, "link", "add", "bare0", "type", "veth", "peer", "name", "bare1"])
    job = cluster(1, 1, env={"DMLC_INTERFACE": name}, start_servers=False)
    argvs = {"scheduler": [sys.executable, "-m", "bps_gossip.scheduler"],
             "server": [sys.executable, "-m", "bps_gossip.server"],
             "worker": [sys.executable, "-m", "bps_gossip.launch", sys.executable, "-c", "print('started')"]}
    procs = [start(job, hosts, "a", argv, role, DMLC_ROLE=role, DMLC_NUM_WORKER="2") for role, argv in argvs.items()]
    for role, done in zip(argvs, job.wait(procs, timeout=30)):
        assert done.returncode == 2, (role, done.stdout, done.stderr)
        assert message in done.stderr, (role, done.stderr)
        listed = f"eth0 ({hosts.address('a')}), eth1 ({hosts.address('a', DATA)})"
        assert listed in done.stderr and "bare0 (no IPv4 address)" in done.stderr, (role, done.stderr)
        assert "started" not in done.stdout


def ssh_unavailable() -> str:
    try:
        netns_ssh.check_prerequisites()
    except netns.NetnsError as exc:
        return f"ssh hosts unavailable: {exc}"
    return ""


@pytest.mark.skipif(bool(ssh_unavailable()), reason=ssh_unavailable() or "-")
@pytest.mark.timeout(120)
def test_bpslaunch_over_ssh_leaves_the_address_to_the_interface(tmp_path):
    """bpslaunch -H reaches the hosts (and the scheduler) at their eth0 addresses; with
    DMLC_INTERFACE=eth1 its servers and workers advertise eth1's, each on its own host."""
    netns.cleanup_leftovers()
    with netns_ssh.SshHosts(2, network=netns.TwoLinkNetwork) as made:
        a, b = made.addresses
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))}
        env.update({**FAST_ENV, "PYTHONUNBUFFERED": "1", "DMLC_INTERFACE": DATA})
        command = [sys.executable, "-m", "bps_gossip.launch", "-H", f"{a}:1,{b}:1", *made.ssh_args,
                   sys.executable, *WORKER]
        done = subprocess.run(made.exec_argv("host0", command), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-4000:]
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
                      if "RESULT " in line), key=lambda r: r["rank"])
    data = [made.net.address(name, DATA) for name in made.names]
    assert [r["node_host"] for r in results] == data, done.stdout[-4000:]
    for result in results:  # one server per host, each on its host's eth1
        assert sorted(s.rsplit(":", 1)[0] for s in result["servers"]) == [f"tcp://{d}" for d in data], result
        assert [host for _, host in result["workers"]] == data, result
        assert result["bytes"][DATA] >= ELEMENTS * 4 * ROUNDS, result
