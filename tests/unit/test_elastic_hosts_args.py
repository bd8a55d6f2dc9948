"""The launcher's command line for elastic jobs across hosts (bps_gossip.launch.elastic_hosts):
which backend claims which flags, the errors for combinations that make no sense, and the hosts
of a Slurm allocation. The jobs themselves run in tests/clusters/test_elastic_hosts.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bps_gossip.errors import ConfigError
from bps_gossip.launch import cli
from bps_gossip.launch.elastic_hosts import ElasticHostsBackend, discovery_from_args, slurm_hosts
from bps_gossip.launch.hostfile import Host
from bps_gossip.launch.local import LocalBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def args(*argv: str):
    return cli.build_parser().parse_args([*argv, "python", "train.py"])


def backend(*argv: str, env: dict[str, str] | None = None):
    parsed = args(*argv)
    cli.check_options(parsed)
    return cli.choose_backend(parsed, env or {})


@pytest.fixture
def discover(tmp_path: Path) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\necho 127.0.0.1:2\n")
    path.chmod(0o755)
    return str(path)


def test_elastic_flags_with_hosts_run_across_hosts(discover):
    chosen = backend("-np", "2", "--min-np", "1", "--host-discovery-script", discover, "--slots-per-host", "2")
    assert isinstance(chosen, ElasticHostsBackend)
    assert chosen.discovery.hosts() == [Host("127.0.0.1", 2)]
    chosen = backend("-np", "2", "--max-np", "4", "-H", "a:2,b:2", "--blacklist-cooldown-range", "5", "60")
    assert isinstance(chosen, ElasticHostsBackend) and chosen.discovery.hosts() == [Host("a", 2), Host("b", 2)]
    assert any(option.startswith("ServerAliveInterval=") for option in chosen.ssh.options)


def test_elastic_flags_alone_stay_on_this_host():
    assert isinstance(backend("-np", "2", "--min-np", "1"), LocalBackend)


@pytest.mark.parametrize("argv, says", [
    (["-np", "2", "--host-discovery-script", "x"], "need an elastic job"),
    (["-np", "2", "-H", "a:1", "--blacklist-cooldown-range", "1", "2"], "need an elastic job"),
    (["-np", "2", "--min-np", "1", "-H", "a:1", "--host-discovery-script", "x"], "one way"),
    (["--min-np", "1", "-H", "a:2"], "needs -np"),
    (["-np", "2", "--min-np", "1", "--slots-per-host", "2"], "--slots-per-host needs the hosts"),
    (["-np", "2", "--min-np", "1", "--host-discovery-script", "/nonexistent/discover.sh"], "not found"),
    (["-np", "2", "--min-np", "3", "-H", "a:4"], "--min-np 3"),
    (["-np", "2", "--min-np", "1", "-H", "a:2", "--blacklist-cooldown-range", "9", "3"], "cooldown"),
])
def test_combinations_that_make_no_sense_are_refused(argv, says):
    with pytest.raises(ConfigError, match=says):
        backend(*argv)


def test_slots_per_host_is_checked(discover):
    with pytest.raises(ConfigError, match="--slots-per-host 0"):
        discovery_from_args(args("-np", "1", "--min-np", "1", "--host-discovery-script", discover,
                                 "--slots-per-host", "0"), {})


def test_the_nodes_of_a_slurm_allocation():
    env = {"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_hosts(env, None) == [Host("node1", 2), Host("node2", 2), Host("node3", 1)]
    assert slurm_hosts(env, 4) == [Host("node1", 4), Host("node2", 4), Host("node3", 4)]
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n[1-2]"}, None) == [Host("n1", 1), Host("n2", 1)]
    assert slurm_hosts({}, None) is None
    # inside an srun task: that is srun's job (the batch backend), not a host list
    assert slurm_hosts({**env, "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, None) is None
    chosen = backend("-np", "2", "--min-np", "1", env=env)
    assert isinstance(chosen, ElasticHostsBackend) and len(chosen.discovery.hosts()) == 3
    # one node: a local elastic job, as before
    assert isinstance(backend("-np", "2", "--min-np", "1", env={"SLURM_JOB_NODELIST": "node1"}), LocalBackend)


def test_secret_files_of_killed_remote_ends_are_swept(tmp_path, monkeypatch):
    """A host that lost power keeps the job secret its remote ends wrote; the next remote end there
    removes the files of remote ends that no longer run (and only those, and only this user's)."""
    from bps_gossip.launch import remote

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    gone = os.posix_spawn("/bin/true", ["true"], os.environ)  # a pid that no longer runs
    os.waitpid(gone, 0)
    dead = tmp_path / f"{remote.SECRET_PREFIX}{gone}_abc"
    mine = tmp_path / f"{remote.SECRET_PREFIX}{os.getpid()}_def"
    other = tmp_path / f"{remote.SECRET_PREFIX}notapid_ghi"
    for path in (dead, mine, other):
        path.write_text("secret\n")
    assert remote.sweep_secret_files() == [str(dead)]
    assert not dead.exists() and mine.exists() and other.exists()
