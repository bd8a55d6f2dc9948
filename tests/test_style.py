"""The code base stays ruff-clean (the rules are in ruff.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_ruff_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_core_never_imports_mxnet():
    offenders = [str(p) for p in (ROOT / "bps_gossip").rglob("*.py")
                 if "import mxnet" in p.read_text() or "from mxnet" in p.read_text()]
    assert not offenders, f"bps_gossip must not import mxnet: {offenders}"
