"""The code base stays ruff-clean (the rules are in ruff.toml)."""

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


# -- mxnet_plugin: DistributedTrainer delegates to one mode object -----------------------
PLUGIN = ROOT / "mxnet_plugin"


def test_plugin_files_stay_small():
    large = {str(p.relative_to(ROOT)): n for p in PLUGIN.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not large, f"mxnet_plugin files over 400 lines: {large}"


@pytest.mark.timeout(120)
def test_plugin_functions_stay_simple():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "C901", "--config",
                           "lint.mccabe.max-complexity = 12", str(PLUGIN)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_trainer_methods_do_not_branch_on_the_mode():
    """DistributedTrainer asks its mode object; mode names live in mxnet_plugin/modes/ only."""
    tree = ast.parse((PLUGIN / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DistributedTrainer")
    for method in trainer.body:
        if isinstance(method, ast.FunctionDef) and method.name != "__init__":
            branches = [n for n in ast.walk(method) if isinstance(n, (ast.If, ast.IfExp))]
            assert not branches, f"DistributedTrainer.{method.name} branches (line {branches[0].lineno})"
    names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ("gossip", "allreduce")]
    assert not names, f"mode names in trainer.py: {names}"


def test_each_averager_is_built_in_one_place():
    """The gossip averagers are constructed at a single call site each in mxnet_plugin."""
    for cls in ("GossipAverager", "ChocoAverager"):
        sites = [(str(p.relative_to(ROOT)), node.lineno) for p in PLUGIN.rglob("*.py")
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == cls]
        assert len(sites) == 1, f"{cls} built at {sites}"
