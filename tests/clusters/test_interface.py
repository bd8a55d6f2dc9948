"""DMLC_INTERFACE on hosts with two network interfaces (scripts/netns.py's TwoLinkNetwork: two
namespaces, each with eth0 on 10.213.0.0/24 and eth1 on 10.214.0.0/24): with DMLC_NODE_HOST
unset, the server and workers advertise and bind eth1's address, so the data crosses eth1 while
the scheduler stays at its eth0 address; a name that is no interface, or one without an IPv4
address, stops a process at start-up with an error that lists the interfaces. Needs root and
iproute2 (skipped otherwise); every namespace is deleted at the end, pass or fail."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import assert_all_ok, results_by_rank

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
JOBS = Path(__file__).resolve().parents[1] / "jobs"
sys.path.insert(0, str(SCRIPTS))

import netns  # noqa: E402

try:
    netns.check_prerequisites()
    SKIP_WHY = ""
except netns.NetnsError as exc:
    SKIP_WHY = f"emulated hosts unavailable: {exc}"

pytestmark = [pytest.mark.skipif(bool(SKIP_WHY), reason=SKIP_WHY or "-"), pytest.mark.timeout(90)]

ELEMENTS = 1 << 18  # 1 MiB of float32 a push
ROUNDS = 3
DATA = netns.SECOND_IFACE  # the interface the job is told to use


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
    worker = [sys.executable, str(JOBS / "interface_job.py"), "push_pull_on_the_interface", str(ELEMENTS), str(ROUNDS)]
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
