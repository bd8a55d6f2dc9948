"""The code base stays ruff-clean (the rules are in ruff.toml), and structural rules hold."""

from __future__ import annotations

import ast
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


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved; ``from X import y``
    counts as X and X.y, since y may be a module)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("core", ["gossip", "elastic"])
def test_gossip_and_elastic_cores_do_not_import_the_worker_api(core):
    """They are handed a Link / Comm (bps_gossip/worker_comm.py adapts the worker to them)."""
    offenders = {}
    for path in (ROOT / "bps_gossip" / core).rglob("*.py"):
        bad = sorted(name for name in _imported_modules(path)
                     if name in ("bps_gossip.api", "bps_gossip.worker") or name.startswith(("bps_gossip.api.",
                                                                                             "bps_gossip.worker.")))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, f"bps_gossip/{core} must not import the worker API: {offenders}"
