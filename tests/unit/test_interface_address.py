"""DMLC_INTERFACE (ps-lite's; BytePS reads the same name): with DMLC_NODE_HOST unset, a process
advertises and binds the IPv4 address of the interface it names; a bad name is a ConfigError
naming the variable and the interfaces this host has. The launchers that pick an address of
their own leave it to DMLC_INTERFACE when the user set it. (On real namespaces with two links:
tests/clusters/test_interface.py.)"""

from __future__ import annotations

import errno
import sys

import pytest

from bps_gossip.config import load_config
from bps_gossip.errors import ConfigError
from bps_gossip.launch import batch, ssh
from bps_gossip.launch import hostfile as hosts_mod
from bps_gossip.launch.discovery import Blacklist, FixedHosts
from bps_gossip.launch.elastic import ElasticOptions
from bps_gossip.launch.elastic_hosts import ElasticHostsBackend
from bps_gossip.transport import addresses
from bps_gossip.transport.addresses import interface_address, interface_names, launcher_node_host

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="DMLC_INTERFACE is read on Linux only")

FAR_ROOT = {"DMLC_PS_ROOT_URI": "10.9.9.9", "DMLC_PS_ROOT_PORT": "9000"}  # a scheduler elsewhere: no loopback default


def test_loopback_interface_has_its_address():
    assert "lo" in interface_names()
    assert interface_address("lo") == "127.0.0.1"


def test_unknown_interface_names_the_variable_and_the_interfaces_there_are():
    with pytest.raises(ConfigError, match=r"DMLC_INTERFACE='nosuch0': no such network interface.*lo \(127\.0\.0\.1\)"):
        interface_address("nosuch0")


@pytest.mark.parametrize("name", ["lo 0", "a/b", "x" * 16, "eth\x000"])
def test_malformed_names_are_refused(name):
    with pytest.raises(ConfigError, match=r"DMLC_INTERFACE=.* is not a network interface name.*lo \(127\.0\.0\.1\)"):
        interface_address(name)


def test_interface_without_ipv4_address(monkeypatch):
    """The kernel's EADDRNOTAVAIL (an interface that is up with IPv6 only, or no address yet) is
    said as such; real ones: tests/clusters/test_interface.py."""
    real = addresses._ipv4_of

    def no_ipv4(name: str) -> str:
        if name == "lo":
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        return real(name)

    monkeypatch.setattr(addresses, "_ipv4_of", no_ipv4)
    with pytest.raises(ConfigError, match=r"DMLC_INTERFACE='lo' has no IPv4 address.*lo \(no IPv4 address\)"):
        interface_address("lo")


@pytest.mark.parametrize("role", ["worker", "server", "scheduler"])
def test_every_role_advertises_and_binds_the_interface_address(role):
    config = load_config({**FAR_ROOT, "DMLC_ROLE": role, "DMLC_INTERFACE": "lo"})
    assert config.node_host == config.bind_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="DMLC_INTERFACE='nosuch0'"):
        load_config({**FAR_ROOT, "DMLC_ROLE": role, "DMLC_INTERFACE": "nosuch0"})


def test_node_host_wins_and_kubernetes_still_binds_everything():
    # ps-lite's order: DMLC_NODE_HOST set, DMLC_INTERFACE is not read (a launcher's or the user's address)
    assert load_config({**FAR_ROOT, "DMLC_NODE_HOST": "10.0.0.2", "DMLC_INTERFACE": "nosuch0"}).node_host == "10.0.0.2"
    config = load_config({**FAR_ROOT, "DMLC_INTERFACE": "lo", "DMLC_USE_KUBERNETES": "1"})
    assert (config.node_host, config.bind_host) == ("127.0.0.1", "0.0.0.0")
    # blank: unset, the default address
    assert load_config({**FAR_ROOT, "DMLC_INTERFACE": " "}).node_host == load_config(FAR_ROOT).node_host


def test_ssh_launcher_leaves_the_address_to_the_interface():
    placements = hosts_mod.place_workers(hosts_mod.parse_hosts("h1:2,h2:1"), None)
    plain = ssh.plan(placements, None, 9000, {})
    assert [p.env["DMLC_NODE_HOST"] for p in plain] == ["h1", "h1", "h2", "h1", "h1", "h2"]
    chosen = ssh.plan(placements, None, 9000, {"DMLC_INTERFACE": "eth1"})
    assert all("DMLC_NODE_HOST" not in p.env and p.env["DMLC_INTERFACE"] == "eth1" for p in chosen)
    assert {p.env["DMLC_PS_ROOT_URI"] for p in chosen} == {"h1"}  # the scheduler stays where ssh reaches it


def slurm_task(procid: int, **extra: str) -> dict[str, str]:
    """What srun gives task ``procid`` of a 2-node step, one task per node."""
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(procid),
            "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "1", "SLURMD_NODENAME": f"node{procid + 1}", "PATH": "/bin", **extra}


def batch_plan(env: dict[str, str]) -> list[batch.Process]:
    place = batch.layout(env)
    assert place is not None
    return batch.plan(env, place, "thishost")


def test_batch_launcher_leaves_the_address_to_the_interface():
    assert {p.env["DMLC_NODE_HOST"] for p in batch_plan(slurm_task(1))} == {"node2"}
    assert all("DMLC_NODE_HOST" not in p.env for p in batch_plan(slurm_task(1, DMLC_INTERFACE="ib0")))
    mine = batch_plan(slurm_task(1, DMLC_INTERFACE="ib0", DMLC_NODE_HOST="10.1.0.2"))
    assert {p.env["DMLC_NODE_HOST"] for p in mine} == {"10.1.0.2"}  # the user's own address wins over both


def test_elastic_joiner_leaves_the_address_to_the_interface():
    backend = ElasticHostsBackend(FixedHosts(hosts_mod.parse_hosts("h1,h2"), "-H"), 2, ElasticOptions(min_np=1),
                                  Blacklist(None), env={})
    backend.secret = "0123456789abcdef" * 2
    job = {"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "2"}
    backend.common = job
    assert backend.joiner(hosts_mod.Host("h2"), 3).env["DMLC_NODE_HOST"] == "h2"
    backend.common = {**job, "DMLC_INTERFACE": "lo"}  # checked here too (load_config): lo is on every host
    env = backend.joiner(hosts_mod.Host("h2"), 3).env
    assert "DMLC_NODE_HOST" not in env and env["DMLC_INTERFACE"] == "lo"


def test_launcher_node_host():
    assert launcher_node_host({}, "h1") == {"DMLC_NODE_HOST": "h1"}
    assert launcher_node_host({"DMLC_INTERFACE": " "}, "h1") == {"DMLC_NODE_HOST": "h1"}
    assert launcher_node_host({"DMLC_INTERFACE": "eth1"}, "h1") == {}
