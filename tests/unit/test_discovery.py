"""bps_gossip.launch.discovery on its own: the hosts a discovery script prints, what a failing
script leaves in place and says (once), its timeout killing the script's whole process group,
and the blacklist's cooldowns on a fake clock."""

from __future__ import annotations

import os
import random
import stat
import time
from pathlib import Path

import pytest

from bps_gossip.errors import ConfigError
from bps_gossip.launch.discovery import (
    MAX_OUTPUT_BYTES,
    Blacklist,
    FixedHosts,
    ScriptDiscovery,
    check_cooldown_range,
)
from bps_gossip.launch.hostfile import Host, parse_hosts

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def script(tmp_path: Path, body: str, name: str = "discover.sh") -> str:
    """An executable ``#!/bin/sh`` script running ``body``."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def switchable(tmp_path: Path) -> tuple[str, Path]:
    """A script that prints the file ``out`` and exits with the code in the file ``code``."""
    out, code = tmp_path / "out", tmp_path / "code"
    code.write_text("0")
    return script(tmp_path, f'cat "{out}"; exit "$(cat "{code}")"'), tmp_path


def set_output(folder: Path, text: str, code: int = 0) -> None:
    (folder / "out").write_text(text)
    (folder / "code").write_text(str(code))


def discovery(path: str, **kwargs) -> tuple[ScriptDiscovery, list[str]]:
    notes: list[str] = []
    return ScriptDiscovery(path, note=notes.append, **kwargs), notes


def test_output_with_and_without_slots(tmp_path):
    path = script(tmp_path, "echo a:4; echo me@b; echo 10.0.0.3:2")
    found, notes = discovery(path)
    assert found.hosts() == [Host("a", 4), Host("me@b", 1), Host("10.0.0.3", 2)]
    assert notes == [] and found.failures == 0
    assert found.describe() == f"--host-discovery-script {path}"
    more, _ = discovery(script(tmp_path, "echo a:4; echo b", "d2.sh"), default_slots=8)  # --slots-per-host 8
    assert more.hosts() == [Host("a", 4), Host("b", 8)]


def test_comments_and_blank_lines_are_ignored(tmp_path):
    path = script(tmp_path, "printf '# the pool\\n\\n  a:2  \\n\\t\\nb # spare\\n'")
    assert discovery(path)[0].hosts() == [Host("a", 2), Host("b", 1)]


def test_empty_output_is_every_host_gone(tmp_path):
    path, folder = switchable(tmp_path)
    set_output(folder, "a\nb\n")
    found, notes = discovery(path)
    assert len(found.hosts()) == 2
    set_output(folder, "# nothing left\n")
    assert found.hosts() == [] and notes == [] and found.failures == 0


def test_a_garbage_line_keeps_the_last_good_list_and_is_noted_once(tmp_path):
    path, folder = switchable(tmp_path)
    set_output(folder, "a:2\nb:2\n")
    found, notes = discovery(path)
    good = found.hosts()
    set_output(folder, "a:2\nb c\n")
    assert found.hosts() == good and found.hosts() == good
    assert found.failures == 2 and len(notes) == 1, notes
    assert "line 2" in notes[0] and "'b c'" in notes[0] and "last good list of 2 hosts" in notes[0]


def test_exit_1_keeps_the_last_good_list_and_notes_its_output_once(tmp_path):
    path, folder = switchable(tmp_path)
    set_output(folder, "a:2\nb:2\n")
    found, notes = discovery(path)
    good = found.hosts()
    set_output(folder, "cloud API said no\n", code=1)
    assert found.hosts() == good and found.hosts() == good
    assert notes == [f"host discovery: {path} exited with code 1 (keeping the last good list of 2 hosts): "
                     "cloud API said no"]
    assert found.failures == 2


def test_stderr_is_in_the_note_and_long_output_is_cut(tmp_path):
    found, notes = discovery(script(tmp_path, "echo out; echo err >&2; yes x | head -n 2000; exit 3"))
    assert found.hosts() == []
    assert len(notes) == 1 and "exited with code 3" in notes[0] and "(keeping the last good list of 0 hosts)" in notes[0]
    assert "out" in notes[0] and "err" in notes[0] and len(notes[0]) < 600


def test_recovery_is_noted_once_and_a_later_failure_again(tmp_path):
    path, folder = switchable(tmp_path)
    set_output(folder, "", code=2)
    found, notes = discovery(path)
    assert found.hosts() == [] and len(notes) == 1
    set_output(folder, "a:3\n")
    assert found.hosts() == [Host("a", 3)] and found.hosts() == [Host("a", 3)]
    assert notes[1:] == [f"host discovery works again: {path} lists 1 host"]
    set_output(folder, "", code=2)
    assert found.hosts() == [Host("a", 3)]
    assert len(notes) == 3 and "last good list of 1 host)" in notes[2]


def _gone(pid: int) -> bool:
    """No such process, or a zombie that only waits to be reaped (its parent was killed)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_script_past_its_timeout_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    found, notes = discovery(script(tmp_path, f'echo a; sleep 30 & echo $! > "{pidfile}"; sleep 30'), timeout=0.5)
    start = time.monotonic()
    assert found.hosts() == []
    assert time.monotonic() - start < 5
    assert len(notes) == 1 and "did not finish within 0.5 s (killed)" in notes[0], notes
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), f"the script's child sleep {child} outlived the timeout"


def test_a_duplicate_host_is_a_failure(tmp_path):
    found, notes = discovery(script(tmp_path, "echo a:2; echo b; echo me@a"))
    assert found.hosts() == [] and found.failures == 1
    assert "'a' is listed twice" in notes[0]


@pytest.mark.parametrize("line,why", [("-oProxyCommand=x", "not a host name"), ("a:0", "between 1 and"),
                                      ("a:two", "not a whole number"), ("a b", "not a host name")])
def test_bad_hosts_are_refused(tmp_path, line, why):
    found, notes = discovery(script(tmp_path, f"echo good; echo '{line}'"))
    assert found.hosts() == [] and len(notes) == 1 and why in notes[0], notes


def test_too_much_output_is_a_failure(tmp_path):
    found, notes = discovery(script(tmp_path, "yes a"))
    start = time.monotonic()
    assert found.hosts() == []
    assert time.monotonic() - start < 5
    assert len(notes) == 1 and f"wrote more than {MAX_OUTPUT_BYTES} bytes" in notes[0]


def test_a_script_that_cannot_run_is_refused_up_front(tmp_path):
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\necho a\n")
    with pytest.raises(ConfigError, match="not executable"):
        ScriptDiscovery(str(plain))
    with pytest.raises(ConfigError, match="not found"):
        ScriptDiscovery(str(tmp_path / "missing.sh"))
    with pytest.raises(ConfigError, match="not found"):
        ScriptDiscovery("")
    with pytest.raises(ConfigError, match="slots-per-host"):
        ScriptDiscovery(script(tmp_path, "echo a"), default_slots=0)


def test_a_script_that_goes_away_keeps_the_list(tmp_path):
    path = script(tmp_path, "echo a")
    found, notes = discovery(path)
    assert found.hosts() == [Host("a")]
    os.remove(path)
    assert found.hosts() == [Host("a")] and found.hosts() == [Host("a")]
    assert len(notes) == 1 and "could not be started" in notes[0]


def test_the_script_gets_the_environment_given(tmp_path):
    found, _ = discovery(script(tmp_path, 'echo "$POOL_HOST:2"'), env={"POOL_HOST": "n7", "PATH": os.defpath})
    assert found.hosts() == [Host("n7", 2)]


def test_fixed_hosts():
    hosts = parse_hosts("a:2,b")
    fixed = FixedHosts(hosts, "-H a:2,b")
    assert fixed.hosts() == hosts and fixed.describe() == "-H a:2,b"
    fixed.hosts().clear()
    assert fixed.hosts() == hosts


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_without_a_cooldown_a_failed_host_stays_out_for_good():
    clock = Clock()
    out = Blacklist(clock=clock)
    assert out.add("a", "worker 3 exited with code 1") is None
    clock.now += 1e9
    assert "a" in out and "b" not in out
    assert out.why("a") == "worker 3 exited with code 1" and out.why("b") is None
    assert out.active() == {"a": "worker 3 exited with code 1"}


def test_the_cooldown_doubles_with_jitter_and_is_capped():
    clock = Clock()
    out = Blacklist((2, 10), clock=clock, rng=random.Random(7))
    first = out.add("a", "lost")
    assert 2 <= first <= 2.2
    assert 4 <= out.add("a", "lost") <= 4.4
    assert 8 <= out.add("a", "lost") <= 8.8
    assert out.add("a", "lost") == 10 and out.add("a", "lost") == 10
    assert 2 <= out.add("b", "lost") <= 2.2  # each host counts its own failures
    for _ in range(200):
        assert out.add("c", "again") <= 10


def test_jitter_spreads_hosts_that_failed_together():
    out = Blacklist((2, 10), clock=Clock(), rng=random.Random(1))
    assert len({out.add(f"h{n}", "lost") for n in range(10)}) > 1


def test_a_host_may_come_back_after_its_cooldown():
    clock = Clock()
    out = Blacklist((5, 5), clock=clock)
    assert out.add("a", "lost") == 5  # jitter never goes above HI
    clock.now += 4.9
    assert "a" in out and out.active() == {"a": "lost"}
    clock.now += 0.2
    assert "a" not in out and out.why("a") is None and out.active() == {}
    assert out.add("a", "lost again") == 5 and "a" in out


@pytest.mark.parametrize("values", [(0, 1), (-1, 2), (3, 2), (1, float("inf")), (float("nan"), 1), (1,), (1, 2, 3),
                                    ("x", 1)])
def test_bad_cooldown_ranges(values):
    with pytest.raises(ConfigError, match="--blacklist-cooldown-range"):
        check_cooldown_range(values)
    with pytest.raises(ConfigError):
        Blacklist(values)


def test_good_cooldown_range():
    assert check_cooldown_range([1, 1]) == (1.0, 1.0) and check_cooldown_range((0.5, 60.0)) == (0.5, 60.0)
