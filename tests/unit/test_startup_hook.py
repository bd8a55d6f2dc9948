"""The start-up hook that lets MXNet 1.9.1 import under numpy >= 1.24 (Python 3.12+; see
startup/ and setup.py). On 3.12 and 3.13 the real thing runs in .ci/pythons (the README's
first command imports mxnet before mxnet_plugin); here: it is installed, it acts only on the
first import of mxnet, only with numpy >= 1.24, and only on the aliases numpy lacks."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

STARTUP = Path(__file__).resolve().parents[2] / "startup"
JOB = Path(__file__).resolve().parents[1] / "jobs" / "startup_job.py"


def run(scenario: str, *args: str) -> str:
    """What scenario ``scenario`` of tests/jobs/startup_job.py prints, in a Python of its own."""
    done = subprocess.run([sys.executable, str(JOB), scenario, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_installed_in_site_packages_as_in_the_checkout():
    site = Path(sysconfig.get_path("purelib"))
    for name in ("bps_gossip_numpy_aliases.pth", "bps_gossip_numpy_aliases.py"):
        assert (site / name).is_file(), f"{name} missing from {site}: reinstall with pip install -e ."
        assert filecmp.cmp(site / name, STARTUP / name, shallow=False), f"{site / name} is stale: reinstall"


@pytest.mark.timeout(60)
def test_waits_for_mxnet_then_steps_aside():
    out = run("hook_waits_for_mxnet")  # at start, after another first import, after importing mxnet
    assert out.split() == ["True", "True", "False"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version,expected", [
    ("1.23.5", []),                                               # has the aliases: untouched
    ("1.26.4", ["bool", "int", "float", "complex", "object", "str"]),
    ("2.1.0", ["int", "float", "complex", "object", "str"]),      # numpy 2 has np.bool again
])
def test_restores_only_what_numpy_lacks(version, expected):
    out = run("hook_restores_aliases", version)  # under a fake numpy of that version
    added, bool_after = out.split("|")
    assert [name for name in added.split(",") if name] == expected
    assert bool_after == ("numpy.bool" if version.startswith("2") else "<class 'bool'>" if expected else "None")
