"""Kubernetes (issue 14): DMLC_USE_KUBERNETES, a scheduler bound to every interface, processes that
start before the scheduler, and the manifest in docs/kubernetes.md.

No cluster here: real processes on 127.0.0.1 stand in for pods. Every connection goes to a
loopback address; 192.0.2.1 (TEST-NET-1, never routed) only stands for a Service address that is
not the scheduler's own, and nothing ever connects to it.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from pathlib import Path

import pytest
import zmq
from cluster import assert_all_ok, free_port

from bps_gossip import ConfigError, config, load_config
from bps_gossip.scheduler import Scheduler, bind_host
from bps_gossip.transport import addresses

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
SERVICE_ADDRESS = "192.0.2.1"  # not an address of this host: binding it fails

@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), (" ON ", True), ("0", False),
                                           ("false", False), ("", False), (None, False)])
def test_use_kubernetes_values(raw, expected):
    env = {} if raw is None else {"DMLC_USE_KUBERNETES": raw}
    cfg = load_config(env)
    assert cfg.use_kubernetes is expected
    assert cfg.bind_host == ("0.0.0.0" if expected else cfg.node_host)


@pytest.mark.parametrize("raw", ["2", "kubernetes", "-1"])
def test_use_kubernetes_bad_value_names_the_variable(raw):
    with pytest.raises(ConfigError, match=f"DMLC_USE_KUBERNETES='{raw}' is not a boolean"):
        load_config({"DMLC_USE_KUBERNETES": raw})


def test_route_source_on_loopback():
    """The fallback for DMLC_NODE_HOST when the host name resolves to loopback: the kernel's route
    (a UDP connect sends nothing)."""
    assert addresses.route_source("127.0.0.1", 9) == "127.0.0.1"


def test_scheduler_binds_every_interface(tmp_path):
    """In-process: the socket's last endpoint is 0.0.0.0 while DMLC_PS_ROOT_URI names localhost,
    and a client reaches it through 127.0.0.1."""
    port = free_port()
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "localhost", "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_USE_KUBERNETES": "1"}
    cfg = load_config(env)
    assert bind_host(cfg) == "0.0.0.0"
    assert bind_host(load_config({**env, "DMLC_USE_KUBERNETES": "0"})) == "127.0.0.1"
    scheduler = Scheduler(cfg)
    client = zmq.Context.instance().socket(zmq.DEALER)
    try:
        assert scheduler.endpoint == f"tcp://0.0.0.0:{port}"
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send_multipart([b"not a header"])  # dropped and logged, never answered
        assert scheduler.sock.poll(5000), "nothing arrived through 127.0.0.1"
    finally:
        client.close(linger=0)
        scheduler.sock.close(linger=0)


@pytest.mark.timeout(90)
def test_job_with_a_service_address_that_is_not_the_schedulers(cluster):
    """DMLC_PS_ROOT_URI is an address the scheduler cannot bind (as a ClusterIP Service's is):
    with DMLC_USE_KUBERNETES=1 it binds 0.0.0.0 and the job runs, everyone else connecting
    through 127.0.0.1; without it the scheduler says which variable to set."""
    job = cluster(2, start_servers=False, env={"DMLC_USE_KUBERNETES": "1"})
    refused = job.spawn(_role_argv("scheduler"), {**job.env, "DMLC_ROLE": "scheduler",
                        "DMLC_USE_KUBERNETES": "0", "DMLC_PS_ROOT_URI": SERVICE_ADDRESS,
                        "DMLC_NODE_HOST": "127.0.0.1"}, "refused_scheduler")
    assert refused.wait(30) == 2
    assert "cannot bind DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT" in job.dump()
    sched_env = {**job.env, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": SERVICE_ADDRESS,
                 "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_LOG_LEVEL": "INFO"}
    job.scheduler = job.spawn(_role_argv("scheduler"), sched_env, "scheduler")
    job.scheduler.role = "scheduler"
    job.server_procs = [job.spawn_role("server")]
    done = job.run_job("worker_process_job", "rank_sum", timeout=60)
    assert_all_ok(done, job)
    assert sorted(f.result["rank"] for f in done) == [0, 1]
    assert all(f.result["sum"] == [3.0, 3.0, 3.0] for f in done)
    job.wait_servers_exit()
    assert job.scheduler.returncode == 0, job.dump()
    assert f"listening on tcp://0.0.0.0:{job.port}" in job.dump()


@pytest.mark.timeout(90)
def test_scheduler_starting_last(cluster):
    """Pods start minutes apart: a server and a worker start first and wait for the scheduler
    longer than BPS_GOSSIP_TIMEOUT; after it, the second worker comes later still (the first waits,
    connected, longer than BPS_GOSSIP_TIMEOUT again). The job completes."""
    job = cluster(2, start_servers=False, env={"BPS_GOSSIP_TIMEOUT": "2", "BPS_GOSSIP_START_TIMEOUT": "40"})
    job.server_procs = [job.spawn_role("server")]
    first = job.start_job("worker_process_job", "rank_sum", count=1)
    time.sleep(4)
    assert job.server_procs[0].poll() is None and first[0].poll() is None, job.dump()
    job.scheduler = job.spawn_role("scheduler")
    time.sleep(4)
    assert first[0].poll() is None, job.dump()
    second = job.start_job("worker_process_job", "rank_sum", count=1, env={"DMLC_WORKER_ID": "1"})
    done = job.wait([*first, *second], timeout=60)
    assert_all_ok(done, job)
    assert sorted(f.result["rank"] for f in done) == [0, 1]
    assert all(f.result["sum"] == [3.0, 3.0, 3.0] for f in done)
    job.wait_servers_exit()
    assert "nothing answers there yet; trying up to BPS_GOSSIP_START_TIMEOUT=40" in job.dump()


def _role_argv(role: str) -> list[str]:
    return [sys.executable, "-m", f"bps_gossip.{role}"]


# -- the manifest in docs/kubernetes.md ------------------------------------------------------------

def _manifest() -> list[str]:
    """The YAML documents of docs/kubernetes.md (every ```yaml block, split at ---)."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, "docs/kubernetes.md has no yaml block"
    return [doc for block in blocks for doc in re.split(r"^---$", block, flags=re.M)]


def _env(document: str) -> dict[str, str | None]:
    """The container env of one document: name -> literal value (None for valueFrom)."""
    env: dict[str, str | None] = {}
    for name, rest in re.findall(r"^\s*- name: ([A-Z_]+)\n(\s+\S[^\n]*)", document, re.M):
        literal = re.match(r'\s*value: "(.*)"$', rest)
        env[name] = literal.group(1) if literal else None
    return env


def test_manifest_variables_are_known_to_the_config():
    """Every DMLC_/BYTEPS_/BPS_GOSSIP_ variable the manifest sets is one bps_gossip.config reads,
    and the manifest sets what Kubeflow's MXJob set, plus the secret file."""
    known = set(re.findall(r'"((?:DMLC|BYTEPS|BPS_GOSSIP)_[A-Z_]+)"', inspect.getsource(config)))
    names = {name for doc in _manifest() for name in _env(doc)
             if name.startswith(("DMLC_", "BYTEPS_", "BPS_GOSSIP_"))}
    assert names - known == set(), f"unknown variables in the manifest: {sorted(names - known)}"
    kubeflow = {"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER", "DMLC_NUM_WORKER",
                "DMLC_USE_KUBERNETES", "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BPS_GOSSIP_SECRET_FILE"}
    assert kubeflow <= names, sorted(kubeflow - names)


def test_manifest_environment_loads_for_every_role(tmp_path, monkeypatch):
    """Each role's environment as written (the secret file and the completion index filled in)
    is a valid configuration that binds every interface and reaches the scheduler's Service."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    # No DNS: the pod's host name "resolves" to a pod IP, as the kubelet's /etc/hosts makes it.
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "10.244.1.7")
    roles = {}
    for document in _manifest():
        env = _env(document)
        if "DMLC_ROLE" not in env:
            continue
        env = {name: (value if value is not None else "1") for name, value in env.items()}  # the index
        env["BPS_GOSSIP_SECRET_FILE"] = str(secret)
        cfg = load_config(env)
        roles[cfg.role] = cfg
        assert cfg.use_kubernetes and cfg.bind_host == "0.0.0.0" and cfg.keys is not None
        assert cfg.node_host == "10.244.1.7" and cfg.scheduler_address == "tcp://digits-scheduler-0:9091"
    assert sorted(roles) == ["scheduler", "server", "worker"]
    assert roles["worker"].worker_id == 1 and roles["worker"].local_size == 2
    assert len({(c.num_worker, c.num_server) for c in roles.values()}) == 1  # the scheduler refuses a mismatch


def test_manifest_parses():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all("\n---\n".join(_manifest())) if d is not None]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Job", "Job", "Job", "Service"], kinds
    worker = next(d for d in docs if d["metadata"]["name"] == "digits-worker")
    assert worker["spec"]["completionMode"] == "Indexed"


def test_default_node_host_in_a_pod(monkeypatch):
    """DMLC_NODE_HOST unset: the pod's IP from its host name; if the host name resolves to a
    loopback address, the local end of the route to the scheduler (both faked: no DNS here)."""
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "10.244.1.7")
    env = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "digits-scheduler-0", "DMLC_PS_ROOT_PORT": "9091"}
    assert load_config(env).node_host == "10.244.1.7"
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "127.0.1.1")
    routes = []
    monkeypatch.setattr(addresses, "route_source", lambda host, port: routes.append((host, port)) or "10.244.1.8")
    assert load_config(env).node_host == "10.244.1.8" and routes == [("digits-scheduler-0", 9091)]
    assert load_config({**env, "DMLC_NODE_HOST": "10.0.0.3"}).node_host == "10.0.0.3"
