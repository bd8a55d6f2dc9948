"""Elastic jobs across hosts (issue 36): ``bpslaunch -np N --min-np A --max-np B
--host-discovery-script SCRIPT`` on emulated hosts (network namespaces, each with its own sshd:
scripts/netns_ssh.py), bpslaunch, the scheduler and the server on host0, workers on the others.
The discovery script prints a file the test rewrites. Hosts die (every process on them
SIGKILLed), lose their link for 10 s, arrive, or cannot be reached; the job goes on, and nothing
of it is left on any host. Needs root, iproute2 and openssh-server (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cluster import FAST_ENV

from bps_gossip.launch import remote
from bps_gossip.transport import shm

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits_elastic.py"
sys.path.insert(0, str(SCRIPTS))

import netns  # noqa: E402
import netns_ssh  # noqa: E402

try:
    netns_ssh.check_prerequisites()
    SKIP_WHY = ""
except netns.NetnsError as exc:
    SKIP_WHY = f"ssh hosts unavailable: {exc}"
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(SKIP_WHY), reason=SKIP_WHY or "-")]
LAUNCH = [sys.executable, "-m", "bps_gossip.launch"]


@pytest.fixture(scope="module")
def hosts():
    netns.cleanup_leftovers()
    with netns_ssh.SshHosts(4) as made:
        yield made


class Job:
    """One bpslaunch on host0, its output collected line by line as it comes."""

    def __init__(self, hosts, tmp_path: Path, listed: list[int], argv: list[str], **env: str) -> None:
        self.hosts = hosts
        self.listing = tmp_path / "hosts.txt"
        self.script = tmp_path / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.listing}\n")
        self.script.chmod(0o755)
        self.list_hosts(listed)
        full = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))}
        full.update({**FAST_ENV, "PYTHONUNBUFFERED": "1", "BPS_GOSSIP_ELASTIC_TIMEOUT": "20", **env})
        full.pop("BPS_GOSSIP_SECRET")  # bpslaunch makes the job's
        command = [*LAUNCH, "--host-discovery-script", str(self.script), *hosts.ssh_args, *argv]
        self.proc = subprocess.Popen(hosts.exec_argv("host0", command), cwd=tmp_path, env=full,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.arrived: list[float] = []  # when each line came (time.monotonic())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.arrived.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    def list_hosts(self, listed: list[int], extra: str = "") -> None:
        """The discovery script prints these hosts (one slot each) from now on."""
        text = "".join(f"{self.hosts.addresses[i]}:1\n" for i in listed) + extra
        self.listing.write_text(text)

    def discovery_does(self, body: str) -> None:
        """Replace the discovery script (at once: never half-written while it runs)."""
        new = self.script.with_suffix(".new")
        new.write_text("#!/bin/sh\n" + body + "\n")
        new.chmod(0o755)
        os.replace(new, self.script)

    @property
    def out(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> float:
        """Wait for a line that matches ``pattern`` (one that came after ``after``); when it came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line, when in zip(list(self.lines), list(self.arrived)):
                if when >= after and re.search(pattern, line):
                    return when
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.out}")

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.reader.join(5)
            pytest.fail(f"bpslaunch did not end within {timeout} s:\n{self.out}")
        self.reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def results(self) -> list[tuple[str, dict]]:
        """(host address, RESULT) of every final rank."""
        return [(m.group(1), json.loads(m.group(2)))
                for m in re.finditer(r"^\[\w+@([\d.]+)\] RESULT (\{.*\})$", self.out, re.M)]


def kill_host(hosts, name: str) -> None:
    """Every process on the host SIGKILLed, its sshd too: as if it lost power."""
    for pid in [*hosts.pids(name), hosts.sshd[name].pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


SEGMENTS_BEFORE: set[str] = set()  # /dev/shm's segments of ours when the running test began


@pytest.fixture(autouse=True)
def segments_before():
    """Another job's segments (one SIGKILLed on a host that lost power, in an earlier test or
    beside this suite) are not this test's to answer for: only those made since it began count."""
    SEGMENTS_BEFORE.clear()
    SEGMENTS_BEFORE.update(p.name for p in Path("/dev/shm").glob(shm.PREFIX + "_*"))
    yield


def nothing_left(hosts, within: float = 15.0) -> None:
    """No process left on any host, and no job secret in /tmp (the hosts share this machine's: the
    secret files of the remote ends a test killed are removed as a reboot would, and as the next
    remote end on that host does)."""
    deadline = time.monotonic() + within
    while True:
        left = {name: hosts.pids(name) for name in hosts.names}
        if not any(left.values()):
            remote.sweep_secret_files()
            assert not list(Path("/tmp").glob(remote.SECRET_PREFIX + "*")), "a remote secret file was left behind"
            made = {p.name for p in Path("/dev/shm").glob(shm.PREFIX + "_*")} - SEGMENTS_BEFORE
            assert not made, f"shared memory was left behind: {sorted(made)}"
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes left on the hosts after the job: {left}")
        time.sleep(0.2)


def training(epochs: int, sleep: float) -> list[str]:
    return ["--mode", "allreduce", sys.executable, str(EXAMPLE), "--epochs", str(epochs), "--step-sleep", str(sleep),
            "--commit-every", "5", "--report-json"]


@pytest.mark.timeout(240)
def test_a_host_dies_and_another_arrives(hosts, tmp_path):
    """Hosts 1 and 2 at the start; host 2 loses power mid-epoch; host 3 is listed later: the job
    finishes with bit-identical models (allreduce) on every final rank, one of them on host 3."""
    job = Job(hosts, tmp_path, [1, 2], ["-np", "2", "--min-np", "1", "--max-np", "2", *training(8, 0.1)])
    try:
        job.wait_for(r"rank 1 of 2: epoch", 90)
        killed = time.monotonic()
        kill_host(hosts, "host2")
        going_on = job.wait_for(r"generation \d+: 1 worker\(s\) training", 30, after=killed)
        job.wait_for(r"rank 0 of 1: epoch", 30, after=killed)  # a whole epoch at the new size
        listed = time.monotonic()
        job.list_hosts([1, 2, 3])  # host 2 stays listed, dead: blacklisted, never used again
        job.wait_for(rf"starting worker w\d+ on {re.escape(hosts.addresses[3])}", 30, after=listed)
        joined = job.wait_for(r"generation \d+: 2 worker\(s\) training", 60, after=listed)
        code = job.finish(150)
    finally:
        job.kill()
        hosts.restart_sshd("host2")
    assert code == 0, job.out
    results = job.results()
    assert len(results) == 2, job.out
    assert len({r["fingerprint"] for _, r in results}) == 1, job.out
    assert hosts.addresses[3] in {address for address, _ in results}, job.out
    assert f"host {hosts.addresses[2]} is blacklisted for good" in job.out, job.out
    nothing_left(hosts)
    print(f"host lost -> training at the new size: {going_on - killed:.1f} s; "
          f"host listed -> training with it: {joined - listed:.1f} s")


@pytest.mark.timeout(240)
def test_a_partitioned_host_comes_back_as_a_joiner(hosts, tmp_path):
    """Host 3's link goes down for 10 s mid-training: the other two go on without it; its stale
    worker never writes into the new generation (every final model is bit-identical) and is gone
    once the link is back; after its cooldown the host is re-admitted with a fresh worker."""
    job = Job(hosts, tmp_path, [1, 2, 3], ["-np", "3", "--min-np", "1", "--max-np", "3",
                                           "--blacklist-cooldown-range", "4", "8", *training(22, 0.1)])
    try:
        job.wait_for(r"rank 2 of 3: epoch", 90)
        cut = time.monotonic()
        hosts.set_link("host3", up=False)
        try:
            went_on = job.wait_for(r"generation \d+: 2 worker\(s\) training", 20, after=cut)
            job.wait_for(r"rank \d of 2: epoch", 30, after=cut)  # an epoch without it
        finally:
            time.sleep(max(0.0, cut + 10 - time.monotonic()))
            hosts.set_link("host3", up=True)
        back = time.monotonic()
        job.wait_for(rf"starting worker w\d+ on {re.escape(hosts.addresses[3])}", 60, after=back)
        joined = job.wait_for(r"generation \d+: 3 worker\(s\) training", 60, after=back)
        code = job.finish(180)
    finally:
        job.kill()
        hosts.set_link("host3", up=True)
    assert code == 0, job.out
    results = job.results()
    assert len(results) == 3, job.out
    assert len({r["fingerprint"] for _, r in results}) == 1, job.out
    assert hosts.addresses[3] in {address for address, _ in results}, job.out
    assert re.search(rf"host {re.escape(hosts.addresses[3])} is blacklisted for \d+ s", job.out), job.out
    nothing_left(hosts)
    print(f"link cut -> the rest training at the new size: {went_on - cut:.1f} s; "
          f"link back -> the host training again: {joined - back:.1f} s")


@pytest.mark.timeout(180)
def test_bad_discovery_output_and_an_unreachable_host_do_not_stop_the_job(hosts, tmp_path):
    """The discovery script exits 1, then prints garbage, then lists a host whose sshd is gone: each
    is said once, the last good list is kept, the unreachable host is blacklisted; the job finishes."""
    job = Job(hosts, tmp_path, [1], ["-np", "1", "--min-np", "1", "--max-np", "2", *training(6, 0.06)])
    try:
        job.wait_for(r"rank 0 of 1: epoch", 90)
        job.discovery_does("echo 'cannot reach the cloud API' >&2\nexit 1")
        job.wait_for(r"host discovery: .* exited with code 1 .*cannot reach the cloud API", 20)
        job.discovery_does("echo 'this is not a host list!'")
        job.wait_for(r"host discovery: .*not a host", 20)
        kill_host(hosts, "host2")  # its sshd too: nothing answers ssh there
        job.discovery_does(f"cat {job.listing}")
        job.list_hosts([1, 2])
        job.wait_for(rf"host {re.escape(hosts.addresses[2])} is blacklisted for good: its check failed", 60)
        code = job.finish(120)
    finally:
        job.kill()
        hosts.restart_sshd("host2")
    assert code == 0, job.out
    assert len(job.results()) == 1, job.out
    assert job.out.count("exited with code 1") == 1, job.out
    assert "host discovery works again" in job.out, job.out
    nothing_left(hosts)


@pytest.mark.timeout(150)
def test_below_min_np_for_too_long_stops_everything(hosts, tmp_path):
    """--min-np 2 and one of two hosts lost: past --elastic-timeout the job stops with a clear
    message and a non-zero exit, leaving nothing running on any host."""
    job = Job(hosts, tmp_path, [1, 2], ["-np", "2", "--min-np", "2", "--elastic-timeout", "4",
                                        *training(50, 0.1)])
    try:
        job.wait_for(r"rank 1 of 2: epoch", 90)
        kill_host(hosts, "host2")
        code = job.finish(60)
    finally:
        job.kill()
        hosts.restart_sshd("host2")
    assert code != 0, job.out
    assert re.search(r"the scheduler failed the job .*--min-np", job.out), job.out
    nothing_left(hosts)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["auto"])  # gossip, then allreduce (the tests above: allreduce alone)
def test_the_elastic_example_survives_a_lost_host_in_every_mode(hosts, tmp_path, mode):
    """examples/train_digits_elastic.py unchanged under the new flags, in mode='auto', which runs
    gossip and allreduce (the tests above: allreduce alone; gossip alone across a lost worker:
    test_elastic_trials)."""
    argv = training(6, 0.05)
    argv[1] = mode
    job = Job(hosts, tmp_path, [1, 2], ["-np", "2", "--min-np", "1", *argv])
    try:
        job.wait_for(r"rank 1 of 2: epoch", 90)
        kill_host(hosts, "host2")
        code = job.finish(120)
    finally:
        job.kill()
        hosts.restart_sshd("host2")
    assert code == 0, job.out
    results = job.results()
    assert len(results) == 1 and results[0][1]["size"] == 1 and results[0][1]["accuracy"] > 0.8, job.out
    nothing_left(hosts)
