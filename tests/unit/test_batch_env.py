"""bps_gossip.launch.batch on its own: Slurm's host lists and tasks per node, the processes and
environment each task of srun or mpirun derives, user overrides, and clear errors."""

from __future__ import annotations

import pytest

from bps_gossip.config import load_config
from bps_gossip.errors import ConfigError
from bps_gossip.launch import batch


@pytest.mark.parametrize("text,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("a-[1-2]-x", ["a-1-x", "a-2-x"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("c1.cluster,c[2-3].cluster", ["c1.cluster", "c2.cluster", "c3.cluster"]),
    (" x[1 , 3] ", ["x1", "x3"]),
])
def test_hostlist(text, hosts):
    assert batch.parse_hostlist(text) == hosts


@pytest.mark.parametrize("text,why", [
    ("", "empty"), ("a,,b", "empty name"), ("n[1-3", r"'\[' without"), ("n1-3]", r"'\]' without"),
    ("n[[1]]", "nested"), ("n[3-1]", "goes down"), ("n[a-b]", "numbers"), ("n[1-]", "numbers"),
    ("bad host", "not a host name"), ("n[0-1000000]", "more than"),
])
def test_hostlist_errors(text, why):
    with pytest.raises(ConfigError, match=why):
        batch.parse_hostlist(text)


@pytest.mark.parametrize("text,counts", [
    ("3", [3]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2)", [1, 2, 2]), (" 4(x1) ", [4]),
])
def test_tasks_per_node(text, counts):
    assert batch.parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2x3", "a", "2(x3", "1,,2"])
def test_tasks_per_node_errors(text):
    with pytest.raises(ConfigError, match="N or N\\(xM\\)"):
        batch.parse_tasks_per_node(text)


def test_ports():
    assert batch.slurm_port(1, 0) == 20008
    assert batch.slurm_port(1, 1) == 20009
    ports = {batch.slurm_port(job, step) for job in range(1000, 2596) for step in range(8)}
    assert len(ports) == 1596 * 8 and min(ports) >= 20000 and max(ports) < 32768
    assert 20000 <= batch.text_port("1563885569") < 32768
    assert batch.text_port("a") == batch.text_port("a") != batch.text_port("b")


def slurm_env(procid: int, nodes: str = "node[1-3]", per_node: str = "2(x2),1", **extra: str) -> dict[str, str]:
    """The variables srun gives task ``procid`` of a block-distributed step."""
    counts = batch.parse_tasks_per_node(per_node)
    names = batch.parse_hostlist(nodes)
    node, first = 0, 0
    while procid >= first + counts[node]:
        first += counts[node]
        node += 1
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(sum(counts)), "SLURM_LOCALID": str(procid - first),
           "SLURM_NODEID": str(node), "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node,
           "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURMD_NODENAME": names[node], "PATH": "/bin"}
    env.update(extra)
    return env


def roles(processes: list[batch.Process]) -> list[str]:
    return [p.label for p in processes]


def plan_of(env: dict[str, str]) -> list[batch.Process]:
    place = batch.layout(env)
    assert place is not None
    return batch.plan(env, place, "thishost")


def test_slurm_three_nodes():
    plans = [plan_of(slurm_env(task)) for task in range(5)]
    assert [roles(p) for p in plans] == [
        ["scheduler", "server0", "worker0"], ["worker1"], ["server1", "worker2"], ["worker3"],
        ["server2", "worker4"]]
    port = str(batch.slurm_port(4242, 1))
    for task, processes in enumerate(plans):
        worker = processes[-1]
        node = [0, 0, 1, 1, 2][task]
        assert worker.prefix == f"[{task}@node{node + 1}] "
        assert {k: worker.env[k] for k in worker.env if k.startswith(("DMLC_", "BYTEPS_"))} == {
            "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "3", "DMLC_WORKER_ID": str(node),
            "DMLC_PS_ROOT_URI": "node1", "DMLC_PS_ROOT_PORT": port, "DMLC_NODE_HOST": f"node{node + 1}",
            "BYTEPS_LOCAL_RANK": str([0, 1, 0, 1, 0][task]), "BYTEPS_LOCAL_SIZE": str([2, 2, 2, 2, 1][task])}
        for process in processes:
            assert process.env["PATH"] == "/bin" and process.env["PYTHONUNBUFFERED"] == "1"
            config = load_config({**process.env, "DMLC_NODE_HOST": "127.0.0.1", "DMLC_PS_ROOT_URI": "127.0.0.1"})
            assert config.role == process.role
    assert plans[0][0].prefix == "[scheduler@node1] " and plans[2][0].prefix == "[server1@node2] "


def test_slurm_one_node_runs_on_loopback_and_falls_back_to_job_variables():
    env = slurm_env(1, nodes="vm", per_node="3")
    for name in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURMD_NODENAME"):
        del env[name]
    env.update({"SLURM_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "3"})
    (worker,) = plan_of(env)
    assert worker.env["DMLC_PS_ROOT_URI"] == worker.env["DMLC_NODE_HOST"] == "127.0.0.1"
    assert (worker.env["BYTEPS_LOCAL_RANK"], worker.env["BYTEPS_LOCAL_SIZE"], worker.prefix) == ("1", "3", "[1@vm] ")


def test_user_variables_win():
    env = slurm_env(0, DMLC_PS_ROOT_URI="10.0.0.9", DMLC_PS_ROOT_PORT="31000", DMLC_NUM_SERVER="1",
                    DMLC_NODE_HOST="10.0.0.1", DMLC_NUM_WORKER="3")
    processes = plan_of(env)
    assert roles(processes) == ["scheduler", "server0", "worker0"]
    for process in processes:
        assert (process.env["DMLC_PS_ROOT_URI"], process.env["DMLC_PS_ROOT_PORT"], process.env["DMLC_NUM_SERVER"],
                process.env["DMLC_NODE_HOST"]) == ("10.0.0.9", "31000", "1", "10.0.0.1")
    assert roles(plan_of(slurm_env(2, DMLC_NUM_SERVER="1"))) == ["worker2"]  # node 2 runs no server
    assert roles(plan_of(slurm_env(4, DMLC_NUM_SERVER="5"))) == ["server2", "worker4"]
    assert roles(plan_of(slurm_env(0, DMLC_NUM_SERVER="5"))) == ["scheduler", "server0", "server3", "worker0"]


@pytest.mark.parametrize("task, overrides, message", [
    (0, {"DMLC_NUM_WORKER": "2"}, "DMLC_NUM_WORKER=2 contradicts .*nodes: 3"),
    (2, {"DMLC_WORKER_ID": "0"}, "DMLC_WORKER_ID=0 contradicts .*index: 1"),
    (0, {"per_node": "2,3"}, "gives 2 node.*names 3"),
    (0, {"SLURM_NTASKS": "6"}, "adds up to 5 tasks, not 6"),
    (0, {"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 must be smaller than the tasks on node node1=2"),
    (0, {"SLURM_NODEID": "3"}, "SLURM_NODEID=3 must be smaller"),
    (0, {"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
])
def test_contradictions(task, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(slurm_env(task, **overrides))


def test_missing_variable_is_named():
    env = slurm_env(0)
    del env["SLURM_LOCALID"]
    with pytest.raises(ConfigError, match="SLURM_LOCALID is not set"):
        plan_of(env)


def test_detection():
    assert batch.layout({"PATH": "/bin"}) is None
    batch_script = slurm_env(0)  # a batch script itself is no srun step
    del batch_script["SLURM_STEP_ID"]
    assert batch.detect(batch_script) is None
    assert batch.detect(slurm_env(0, SLURM_STEP_ID="4294967294")) is None  # the batch step's id
    assert batch.detect(slurm_env(0)) == "slurm"
    assert batch.detect({**slurm_env(0), **openmpi_env(0, 2, 0, 2)}) == "openmpi"  # mpirun in a job
    assert batch.detect({**slurm_env(0), "PMI_RANK": "0"}) == "slurm"  # srun's PMI, not Hydra
    assert batch.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}) == "mpich"


def openmpi_env(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           "OMPI_COMM_WORLD_NODE_RANK": str(local_rank), "OMPI_MCA_ess_base_jobid": "1563885569",
           "PMIX_NAMESPACE": "1563885569", "PATH": "/bin"}
    env.update(extra)
    return env


def test_openmpi_one_host():
    plans = [plan_of(openmpi_env(rank, 3, rank, 3)) for rank in range(3)]
    assert [roles(p) for p in plans] == [["scheduler", "server0", "worker0"], ["worker1"], ["worker2"]]
    worker = plans[2][-1]
    assert worker.env["DMLC_PS_ROOT_URI"] == worker.env["DMLC_NODE_HOST"] == "127.0.0.1"
    assert worker.env["DMLC_PS_ROOT_PORT"] == str(batch.text_port("1563885569"))
    assert (worker.env["DMLC_NUM_WORKER"], worker.env["DMLC_WORKER_ID"], worker.env["BYTEPS_LOCAL_SIZE"]) == \
        ("1", "0", "3")
    assert worker.prefix == "[2@thishost] "
    namespace_only = openmpi_env(0, 1, 0, 1, PMIX_NAMESPACE="prterun-vm-1234@1")
    del namespace_only["OMPI_MCA_ess_base_jobid"]  # Open MPI 5 exports only the PMIx namespace
    assert plan_of(namespace_only)[-1].env["DMLC_PS_ROOT_PORT"] == str(batch.text_port("prterun-vm-1234@1"))


def test_openmpi_several_hosts_needs_the_root_uri():
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_URI is not set.*mpirun -x DMLC_PS_ROOT_URI=host1"):
        plan_of(openmpi_env(2, 4, 0, 2))
    processes = plan_of(openmpi_env(2, 4, 0, 2, DMLC_PS_ROOT_URI="host1"))
    assert roles(processes) == ["server1", "worker2"]
    worker = processes[-1].env
    assert (worker["DMLC_NUM_WORKER"], worker["DMLC_WORKER_ID"], worker["BYTEPS_LOCAL_RANK"]) == ("2", "1", "0")
    assert "DMLC_NODE_HOST" not in worker  # bps_gossip's default: this host's address towards the root


def test_mpi_layout_that_is_not_in_blocks():
    # --map-by node: ranks 0 and 2 on one host, 1 and 3 on the other.
    with pytest.raises(ConfigError, match="DMLC_NUM_WORKER cannot be derived.*--map-by node"):
        plan_of(openmpi_env(1, 4, 0, 2, DMLC_PS_ROOT_URI="host1"))
    given = openmpi_env(1, 4, 0, 2, DMLC_PS_ROOT_URI="host1", DMLC_NUM_WORKER="2", DMLC_WORKER_ID="1")
    assert plan_of(given)[-1].env["DMLC_WORKER_ID"] == "1"
    with pytest.raises(ConfigError, match="DMLC_NUM_WORKER cannot be derived"):
        plan_of(openmpi_env(0, 3, 0, 2, DMLC_PS_ROOT_URI="host1"))  # 2 + 1 ranks: not uniform


def test_mpich_needs_a_port():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PATH": "/bin"}
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_PORT is not set.*mpiexec -genv DMLC_PS_ROOT_PORT"):
        plan_of(env)
    (worker,) = plan_of({**env, "DMLC_PS_ROOT_PORT": "29500"})
    assert (worker.env["DMLC_PS_ROOT_PORT"], worker.env["DMLC_PS_ROOT_URI"], worker.label) == \
        ("29500", "127.0.0.1", "worker1")
    with pytest.raises(ConfigError, match="MPI_LOCALRANKID=2 must be smaller than MPI_LOCALNRANKS=2"):
        plan_of({**env, "MPI_LOCALRANKID": "2"})
    with pytest.raises(ConfigError, match="MPI_LOCALNRANKS=3 is larger than PMI_SIZE=2"):
        plan_of({**env, "MPI_LOCALNRANKS": "3"})


def test_describe():
    env = slurm_env(0)
    place = batch.layout(env)
    text = batch.describe(place, batch.plan(env, place), env)
    assert text == ("slurm task 0 of 5: 3 node(s), 3 server(s), scheduler at node1:28401 "
                    "(port from SLURM_JOB_ID=4242 and SLURM_STEP_ID=1)")
    env["DMLC_PS_ROOT_PORT"] = "31000"
    assert batch.describe(place, batch.plan(env, place), env).endswith("scheduler at node1:31000")
