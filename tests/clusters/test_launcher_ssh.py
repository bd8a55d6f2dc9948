"""bpslaunch -H / --hostfile for real: emulated hosts (network namespaces), each running its own
sshd (scripts/netns_ssh.py); bpslaunch runs on the first host and reaches every host, itself
included, over ssh. A job trains across two hosts; a killed remote worker and Ctrl-C stop
every process on every host. Needs root, iproute2 and openssh-server (skipped otherwise; .ci/run
installs openssh-server when it can). The parsing tests need none of that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import FAST_ENV, JOBS

from bps_gossip.errors import ConfigError
from bps_gossip.launch import cli, local, ssh
from bps_gossip.launch import hostfile as hosts_mod

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(SCRIPTS))

import netns  # noqa: E402
import netns_ssh  # noqa: E402

try:
    netns_ssh.check_prerequisites()
    SKIP_WHY = ""
except netns.NetnsError as exc:
    SKIP_WHY = f"ssh hosts unavailable: {exc}"
needs_hosts = pytest.mark.skipif(bool(SKIP_WHY), reason=SKIP_WHY or "-")
LAUNCH = [sys.executable, "-m", "bps_gossip.launch"]

# push_pull on every host, then RESULT rank= size= host= cwd= extra=; rank (size-1) dies by SIGKILL
# after it when DIE is set, and LOOP=1 keeps every rank running until stopped.
JOB = [str(JOBS / "launcher_job.py"), "across_hosts"]


@pytest.fixture(scope="module")
def ssh_hosts():
    netns.cleanup_leftovers()
    with netns_ssh.SshHosts(2) as made:
        yield made


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))}
    return {**env, **FAST_ENV, "PYTHONUNBUFFERED": "1", **extra}


def _start(ssh_hosts, tmp_path: Path, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    a, b = ssh_hosts.addresses
    command = [*LAUNCH, "-H", f"{a}:2,{b}:2", *ssh_hosts.ssh_args, *argv]
    return subprocess.Popen(ssh_hosts.exec_argv("host0", command), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bpslaunch did not end within {timeout} s:\n{out}")
    return out


def _nothing_left(ssh_hosts, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = {name: ssh_hosts.pids(name) for name in ssh_hosts.names}
        if not any(left.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes left on the hosts after the job: {left}")
        time.sleep(0.2)


@needs_hosts
@pytest.mark.timeout(120)
def test_a_bare_python_from_an_activated_virtualenv_is_that_one_everywhere(ssh_hosts, tmp_path):
    """Issue 23, item 2: typed from an activated virtualenv, `bpslaunch -H ... python job.py` ran the
    login's python on the remote side (no mxnet, no bps_gossip). PATH and VIRTUAL_ENV are forwarded
    now, and the host check says which program the command runs on each host."""
    venv = Path(sys.executable).parent
    env = _env(PATH=f"{venv}{os.pathsep}/usr/bin{os.pathsep}/bin", VIRTUAL_ENV=str(venv.parent))
    out = _finish(_start(ssh_hosts, tmp_path, ["python", *JOB], env), 100)
    assert len(re.findall(r"RESULT rank=\d size=4", out)) == 4, out
    a, b = ssh_hosts.addresses
    assert f"the command runs {venv / 'python'} on {a}, {venv / 'python'} on {b}" in out, out
    _nothing_left(ssh_hosts)


@needs_hosts
@pytest.mark.timeout(240)
def test_two_hosts_train_from_one_command(ssh_hosts, tmp_path):
    a, b = ssh_hosts.addresses
    proc = _start(ssh_hosts, tmp_path, ["-x", "EXTRA_SETTING", sys.executable, *JOB],
                  _env(EXTRA_SETTING="forwarded"))
    out = _finish(proc, 120)
    assert proc.returncode == 0, out
    results = sorted(re.findall(r"\[(\d)@([\d.]+)\] RESULT rank=(\d) size=4 host=([\d.]+) cwd=(\S+) extra=(\S+)", out))
    assert results == [("0", a, "0", a, str(tmp_path), "forwarded"), ("1", a, "1", a, str(tmp_path), "forwarded"),
                       ("2", b, "2", b, str(tmp_path), "forwarded"), ("3", b, "3", b, str(tmp_path), "forwarded")], out
    assert "[scheduler@" in out or "scheduler at " + a in out
    _nothing_left(ssh_hosts)
    # A real training across the two hosts: the digits MLP, 4 workers, allreduce (identical models).
    proc = _start(ssh_hosts, tmp_path, ["--mode", "allreduce", sys.executable, str(EXAMPLES / "train_digits.py"),
                                        "--epochs", "2", "--hidden", "32"], _env())  # the example follows --mode
    out = _finish(proc, 180)
    assert proc.returncode == 0, out
    accuracy = [float(v) for v in re.findall(r"\[\d@[\d.]+\] rank \d final test accuracy \(allreduce, 4 workers.*: ([0-9.]+) ", out)]
    assert len(accuracy) == 4 and len(set(accuracy)) == 1 and accuracy[0] > 0.8, out
    _nothing_left(ssh_hosts)


@needs_hosts
@pytest.mark.timeout(120)
def test_killed_remote_worker_stops_every_host(ssh_hosts, tmp_path):
    started = time.monotonic()
    proc = _start(ssh_hosts, tmp_path, ["-x", "DIE", "-x", "LOOP=1", sys.executable, *JOB], _env(DIE="1"))
    out = _finish(proc, 60)
    assert proc.returncode == 128 + signal.SIGKILL, out
    assert re.search(r"worker3 \(pid \d+\) exited with code 137; stopping every process", out), out
    assert time.monotonic() - started < 40, out
    _nothing_left(ssh_hosts)
    assert not list(Path("/tmp").glob("bpsg_secret_remote_*")), "a remote secret file was left behind"


@needs_hosts
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_host(ssh_hosts, tmp_path):
    proc = _start(ssh_hosts, tmp_path, ["-x", "LOOP=1", sys.executable, *JOB], _env())
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until every worker runs
        lines.append(line)
        if sum("RESULT" in seen for seen in lines) == 4:
            break
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + _finish(proc, 60)
    assert proc.returncode == 128 + signal.SIGINT, out
    _nothing_left(ssh_hosts)


@pytest.mark.timeout(60)
def test_unreachable_host_is_named_before_anything_starts(tmp_path):
    closed = local.free_port()  # nothing listens there: ssh is refused at once
    start = time.monotonic()
    done = subprocess.run([*LAUNCH, "-H", "127.0.0.1:2", "--ssh-port", str(closed), sys.executable, "job.py"],
                          capture_output=True, text=True, timeout=50, env=_env(), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "cannot use every host" in done.stderr and "127.0.0.1 (ssh could not log in)" in done.stderr, done.stderr
    assert time.monotonic() - start < 30


def test_hosts_and_hostfiles_parse_as_horovod_and_open_mpi(tmp_path):
    assert hosts_mod.parse_hosts("a:4,b:2,c") == [hosts_mod.Host("a", 4), hosts_mod.Host("b", 2), hosts_mod.Host("c")]
    assert hosts_mod.parse_hosts("me@10.0.0.1:3")[0].address == "10.0.0.1"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8  # second\n\nnode3:3\nnode4\n")
    assert hosts_mod.read_hostfile(str(hostfile)) == [
        hosts_mod.Host("node1", 4), hosts_mod.Host("node2", 2), hosts_mod.Host("node3", 3), hosts_mod.Host("node4")]
    placements = hosts_mod.place_workers(hosts_mod.parse_hosts("a:4,b:2,c:2"), 5)
    assert [(p.host.address, p.index, p.workers, p.first_rank) for p in placements] == [("a", 0, 4, 0), ("b", 1, 1, 4)]
    assert sum(p.workers for p in hosts_mod.place_workers(hosts_mod.parse_hosts("a:4,b:2"), None)) == 6


@pytest.mark.parametrize("spec, message", [
    ("a:4,,b", "an empty host"), ("a:x", "not a whole number"), ("a:0", "between 1 and"),
    ("-oProxyCommand=x:1", "not a host name"), ("a b:1", "not a host name"), ("a:1,a:2", "listed twice"),
])
def test_bad_host_lists_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        hosts_mod.parse_hosts(spec)


def test_bad_hostfiles_and_placements_are_refused(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("node1 slots=4\nnode2 cpus=3\n")
    with pytest.raises(ConfigError, match=r"line 2: 'cpus=3' is not understood"):
        hosts_mod.read_hostfile(str(bad))
    with pytest.raises(ConfigError, match="cannot read it"):
        hosts_mod.read_hostfile(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"-np 7 is more than the 6 slot\(s\)"):
        hosts_mod.place_workers(hosts_mod.parse_hosts("a:4,b:2"), 7)


def test_forwarded_environment_and_plan():
    """Issue 23, item 2: the environment is forwarded as horovodrun does (an activated virtualenv's
    PATH and VIRTUAL_ENV included), but not what describes this host, login or launch."""
    env = {"BPS_GOSSIP_TIMEOUT": "5", "BPS_GOSSIP_SECRET": "s", "DMLC_ROLE": "worker", "HOME": "/root", "X": "1",
           "PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv", "SSH_CONNECTION": "a b", "HOSTNAME": "here",
           "BASH_FUNC_f%%": "() { :; }", "SLURM_JOB_ID": "7", "DISPLAY": ":0", "XDG_RUNTIME_DIR": "/run/user/0"}
    assert ssh.forwarded_env(env, ["Y=2"]) == {"BPS_GOSSIP_TIMEOUT": "5", "X": "1", "Y": "2",
                                                "PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv"}
    assert ssh.forwarded_env(env, ["HOSTNAME"])["HOSTNAME"] == "here"  # -x forwards what is left out
    with pytest.raises(ConfigError, match="-x NOPE: NOPE is not set here"):
        ssh.forwarded_env(env, ["NOPE"])
    with pytest.raises(ConfigError, match="not an environment variable name"):
        ssh.forwarded_env(env, ["A-B"])
    placements = hosts_mod.place_workers(hosts_mod.parse_hosts("u@h1:2,h2:1"), None)
    plan = ssh.plan(placements, None, 9000, {})
    assert [(p.role, p.host.target, p.prefix) for p in plan] == [
        ("scheduler", "u@h1", "[scheduler@h1] "), ("server", "u@h1", "[server0@h1] "), ("server", "h2", "[server1@h2] "),
        ("worker", "u@h1", "[0@h1] "), ("worker", "u@h1", "[1@h1] "), ("worker", "h2", "[2@h2] ")]
    worker2 = plan[-1].env
    assert (worker2["DMLC_WORKER_ID"], worker2["BYTEPS_LOCAL_RANK"], worker2["BYTEPS_LOCAL_SIZE"],
            worker2["DMLC_NUM_WORKER"], worker2["DMLC_NUM_SERVER"], worker2["DMLC_PS_ROOT_URI"]) == \
        ("1", "0", "1", "2", "2", "h1")


def test_launcher_refuses_mixed_options(capsys):
    assert cli.main(["-H", "a:1", "--hostfile", "f", "true"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["-H", "a:1", "--min-np", "1", "true"]) == 2  # elastic over hosts: it starts -np workers
    assert "an elastic job over several hosts needs -np" in capsys.readouterr().err
    assert cli.main(["-H", "a:1", "--reset-limit", "1", "true"]) == 2
    assert "need an elastic job" in capsys.readouterr().err
    assert cli.main(["-x", "A", "-np", "1", "true"]) == 2
    assert "need -H, --hostfile or --host-discovery-script" in capsys.readouterr().err


def _remote(spec: bytes) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "bps_gossip.launch.remote"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(spec)
    proc.stdin.flush()
    return proc


@pytest.mark.timeout(60)
def test_remote_end_stops_its_command_when_stdin_ends(tmp_path):
    """What ssh does when bpslaunch goes away: stdin ends. The command and its own child go."""
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print(os.getpid(), child.pid, os.environ['BPS_GOSSIP_SECRET_FILE'], open(os.environ['BPS_GOSSIP_SECRET_FILE']).read().strip(), os.environ['MY_SETTING'], os.getcwd(), flush=True)\n"
              "time.sleep(600)\n")
    spec = {"argv": [sys.executable, "-c", script], "cwd": str(tmp_path), "env": {"MY_SETTING": "yes"}, "secret": "abc"}
    proc = _remote((json.dumps(spec) + "\n").encode())
    try:
        assert proc.stdout is not None
        pid, child, secret_file, secret, setting, cwd = proc.stdout.readline().decode().split()
        assert (secret, setting, cwd) == ("abc", "yes", str(tmp_path))
        assert os.stat(secret_file).st_mode & 0o777 == 0o600
        assert proc.stdin is not None
        proc.stdin.close()  # the connection ends
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        for gone in (int(pid), int(child)):
            deadline = time.monotonic() + 10
            while Path(f"/proc/{gone}").exists() and Path(f"/proc/{gone}/stat").read_text().split()[2] != "Z":
                assert time.monotonic() < deadline, f"pid {gone} outlived its job"
                time.sleep(0.1)
        assert not Path(secret_file).exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec, message", [
    (b"\n", "no job description"), (b"[1]\n", "must be a JSON object"), (b'{"argv": [], "cwd": "/", "env": {}}\n', "argv"),
    (b'{"argv": ["true"], "cwd": "/", "env": {"A": 1}}\n', "env must map"), (b"not json\n", "Expecting value"),
    (b'{"argv": ["/no/such/program"], "cwd": "/", "env": {}}\n', "cannot start '/no/such/program'"),
])
def test_remote_end_refuses_bad_descriptions(spec, message):
    proc = _remote(spec)
    assert proc.stdin is not None
    proc.stdin.close()
    proc.stdin = None  # communicate() would flush it
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (2, 127) and message in err.decode(), err
