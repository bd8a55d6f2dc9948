"""The code base stays ruff-clean (the rules are in ruff.toml), and its structure holds: no
private names imported across modules, the launcher in one package, no import cycle in scripts/,
mxnet_plugin's trainer delegating to one mode object, gossip/ and elastic/ handed their link."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# The project's own files: a script a user keeps in the checkout is theirs, not ours to lint.
PROJECT = ["bps_gossip", "mxnet_plugin", "tests", "scripts", "examples", "startup", "setup.py"]


@pytest.mark.timeout(120)
def test_ruff_clean():
    paths = [str(ROOT / name) for name in PROJECT if (ROOT / name).exists()]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", *paths], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_core_never_imports_mxnet():
    offenders = [str(p) for p in (ROOT / "bps_gossip").rglob("*.py")
                 if "import mxnet" in p.read_text() or "from mxnet" in p.read_text()]
    assert not offenders, f"bps_gossip must not import mxnet: {offenders}"


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    return [node for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom))]


OUR_PACKAGES = {"bps_gossip", "mxnet_plugin"}


def test_no_private_names_imported_across_modules():
    """A name with a leading underscore belongs to its module: what another module needs is public."""
    offenders = []
    for path in sorted([*(ROOT / "bps_gossip").rglob("*.py"), *(ROOT / "mxnet_plugin").rglob("*.py")]):
        for node in _imports(path):
            ours = node.level > 0 if isinstance(node, ast.ImportFrom) else False
            ours = ours or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OUR_PACKAGES)
            if ours:  # MXNet's own privates (mxnet.base._LIB) are how its C API is reached
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name}"
                              for alias in node.names if alias.name.startswith("_")]
    assert not offenders, f"private names imported from another module: {offenders}"


FLAT_LAUNCH_MODULES = ("launcher", "launch_elastic", "launch_ssh", "remote", "supervisor", "batch_env", "hosts")


def test_the_launcher_is_one_package():
    """bpslaunch's parts live in bps_gossip/launch/, one module each, none of them long or tangled."""
    left = [name for name in FLAT_LAUNCH_MODULES if (ROOT / "bps_gossip" / f"{name}.py").exists()]
    assert not left, f"launcher modules back in the package root (they belong in bps_gossip/launch/): {left}"
    long_files = [(p.name, n) for p in (ROOT / "bps_gossip" / "launch").glob("*.py")
                  if (n := len(p.read_text().splitlines())) > 400]
    assert not long_files, f"bps_gossip/launch files over 400 lines: {long_files}"
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "C901", "--config",
                           "lint.mccabe.max-complexity = 12", str(ROOT / "bps_gossip" / "launch")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    from bps_gossip.launch import cli
    from bps_gossip.launch.backend import Backend

    assert all(issubclass(backend, Backend) for backend in cli.BACKENDS)


def _import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> the modules it imports) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other)
                if found:
                    return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_scripts_import_no_cycle():
    """scripts/*.py import each other (by bare name, scripts/ on sys.path) without a cycle, lazy
    imports inside functions included."""
    scripts = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in scripts}
    for name, path in scripts.items():
        for node in _imports(path):
            if isinstance(node, ast.Import):
                targets = {alias.name.split(".")[0] for alias in node.names}
            else:
                targets = {node.module.split(".")[0]} if node.module and not node.level else set()
            graph[name] |= targets & set(scripts)
    assert _import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself
    assert _import_cycle(graph) is None, f"import cycle among scripts/: {_import_cycle(graph)}"


def test_launch_package_imports_no_cycle():
    """Within bps_gossip/launch/ the modules import each other without a cycle (cli at the top,
    supervisor and hosts at the bottom)."""
    package = ROOT / "bps_gossip" / "launch"
    modules = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name in modules:
        for node in _imports(package / f"{name}.py"):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = {node.module} if node.module else {alias.name for alias in node.names}
                graph[name] |= targets & modules
    assert _import_cycle(graph) is None, f"import cycle in bps_gossip/launch: {_import_cycle(graph)}"


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


# Issue 20: every file of the core and the plugin is small and every function simple.
STRUCTURED = ["bps_gossip", "mxnet_plugin"]
MAX_LINES = 400
# Dispatch on an op's string: `msg["op"] == "book"`, `op == "push"`, `op in ("a", "b")`.
STRING_DISPATCH = re.compile(r"""\[["']op["']\]\s*(==|!=|in\b)|\bop(_name)?\s*(==|!=)\s*f?["']|\bop(_name)?\s+in\s+\(["']""")

def _structured_files():
    for entry in STRUCTURED:
        path = ROOT / entry
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_structured_files_stay_small():
    long = {str(p.relative_to(ROOT)): n for p in _structured_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.timeout(120)
def test_structured_functions_stay_simple():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "C901", "--config",
                           "lint.mccabe.max-complexity=12", *map(str, _structured_files())],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_string_dispatch_on_ops():
    """Ops are protocol.Op members dispatched through handler tables, never compared as strings."""
    found = []
    for path in sorted((ROOT / "bps_gossip").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name.startswith("bps_gossip/protocol/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if STRING_DISPATCH.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "dispatch by op string (use a protocol handler table):\n" + "\n".join(found)


def test_string_dispatch_pattern_catches_the_old_forms():
    for line in ('if msg["op"] == "refused":', "elif op == 'changed':", 'if op_name != "result":',
                 'elif op in ("node_lost", "node_left")', 'if msg["op"] in ("bye", "refused"):'):
        assert STRING_DISPATCH.search(line), line
    for line in ('if kind == "op":', 'header = {"op": "push"}', "op = msg['op']"):
        assert not STRING_DISPATCH.search(line), line


def _package_modules(package: Path) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import, lazy ones inside functions included, but not those under `if TYPE_CHECKING:`."""
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
                   for part in node.body for n in ast.walk(part)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
        else node.module or ""
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names} & set(modules)


@pytest.mark.parametrize("package", ["bps_gossip", "mxnet_plugin"])
def test_packages_import_no_cycle(package):
    """No module of the package imports (through others) a module that imports it back; a
    package's own __init__ is not counted for its submodules (Python runs it first anyway)."""
    modules = _package_modules(ROOT / package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            found |= _targets(name, path, node, modules)
        graph[name] = {t for t in found - {name} if not (modules[t].name == "__init__.py" and name.startswith(t + "."))}
    assert _import_cycle(graph) is None, f"import cycle in {package}: {_import_cycle(graph)}"


BOOK_DICT_READ = re.compile(r"""workers\[[^\]]*\]\[|\b(?:w|worker|entry|me)\[["'](?:addr|uid|pid|host|host_reduce|local_rank|local_size)["']\]"""
                            r"""|workers\[[^\]]*\]\.get\(""")


def test_address_book_entries_are_read_typed():
    """A worker's address-book entry is a BookEntry everywhere past decoding (``.addr``, not ``["addr"]``);
    the scheduler's Membership builds the wire form and is the one place that writes it as a map."""
    offenders = []
    for path in sorted([*(ROOT / "bps_gossip").rglob("*.py"), *(ROOT / "mxnet_plugin").rglob("*.py"),
                        *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        if path.name in {"membership.py", "test_style.py", "test_rounds_membership.py"}:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if BOOK_DICT_READ.search(line)]
    assert not offenders, f"address-book entries read as maps: {offenders}"


def test_book_dict_read_pattern_catches_the_old_forms():
    for line in ('book.workers[dst]["addr"]', "self.workers[rank]['addr']", 'ranks = [w["uid"] for w in workers]',
                 'self.workers[src].get("pid")'):
        assert BOOK_DICT_READ.search(line), line
    assert not BOOK_DICT_READ.search("book.workers[dst].addr")


ENVIRONMENT_READ = re.compile(r"\bos\.environ\b|\bgetenv\(|\benviron\.get\(")
# Where the environment may be read or written: the one parser, and what places or launches processes.
ENVIRONMENT_MODULES = {"bps_gossip/config.py", "bps_gossip/placement.py", "bps_gossip/scheduler/orphaned.py"}


def test_only_config_parses_the_environment():
    """One Config per process: bps_gossip.config parses every variable (the plugin asks
    bps_gossip.job_config()); besides it only the launcher, placement (OpenMP's variables for
    what it places) and the scheduler's watch on bpslaunch (its private hand-over) touch os.environ."""
    offenders = []
    for path in sorted([*(ROOT / "bps_gossip").rglob("*.py"), *(ROOT / "mxnet_plugin").rglob("*.py")]):
        where = str(path.relative_to(ROOT))
        if where in ENVIRONMENT_MODULES or where.startswith("bps_gossip/launch/"):
            continue
        offenders += [f"{where}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if ENVIRONMENT_READ.search(line)]
    assert not offenders, f"environment read outside bps_gossip/config.py: {offenders}"


MAX_DOCSTRING_LINES = 25


def test_docstrings_say_what_and_why_briefly():
    """No docstring of the package, the plugin or the scripts runs over 25 lines: measurements and
    long explanations live in docs/ (a docstring that needs more points there)."""
    long = []
    for path in sorted([*(ROOT / "bps_gossip").rglob("*.py"), *(ROOT / "mxnet_plugin").rglob("*.py"),
                        *(ROOT / "scripts").glob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')} "
                                f"({doc.count(chr(10)) + 1} lines)")
    assert not long, f"docstrings over {MAX_DOCSTRING_LINES} lines: {sorted(set(long))}"


CLUSTER_USE = re.compile(r"def test_\w+\([^)]*\bcluster\b|\brun_workers\(|\bstart_workers\(|\bPopen\(|\bbpslaunch\b")


def test_unit_and_cluster_tests_are_apart():
    """Every test module is in tests/unit/ (in this process: marked unit) or tests/clusters/ (real
    processes: marked cluster); the unit ones start no cluster. .ci/pythons picks by marker."""
    tests = ROOT / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "test modules belong in tests/unit or tests/clusters"
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((tests / "unit").glob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1) if CLUSTER_USE.search(line)
                 and p.name != "test_style.py"]
    assert not offenders, f"unit tests that start processes of a job (move them to tests/clusters/): {offenders}"
    assert "-m" in (ROOT / ".ci" / "pythons").read_text() and "tests/test_" not in (ROOT / ".ci" / "pythons").read_text()
    for marker in ("smoke", "paths"):  # what .ci/pythons selects must select something
        assert any(f"pytest.mark.{marker}" in p.read_text() for p in (tests / "clusters").glob("test_*.py")), marker


INTERNAL_REACH = re.compile(r"\b_rt\(|\b(?:api|engine|routing|pool|servers|hosts|channel|mode|policy|fusion)\._[a-z]\w"
                            r"|\btrainer\d?\._mode\b|_kvstore\._fusion\b|\bsuper\(\)\._[a-z]")


def test_tests_use_the_testing_hooks_not_private_names():
    """Tests and their jobs look inside a worker through bps_gossip.testing (engine(), address_book(),
    host_link(), server_links(), segment_pool()), a trainer through its mode_object, mode='auto'
    through its public hooks (window_loss, average_exactly, AutoPolicy.choose_mode) and a store's
    fusion through BpsGossip.fusion, never through private names."""
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_style.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if INTERNAL_REACH.search(line)]
    assert not offenders, f"tests reaching into private names: {offenders}"


# Issue 35: worker code lives in job modules (tests/jobs/, run by Cluster.run_job or, under
# bpslaunch, as `python tests/jobs/<topic>_job.py <scenario>`), which ruff reads; 2,561 lines of
# it were strings, and none is left.
def _worker_strings(path: Path) -> int:
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and id(node) not in docstrings and node.value.count("\n") >= 5 and "import " in node.value
               and ("bps" in node.value or "mxnet" in node.value))


def test_worker_code_lives_in_job_modules():
    """No test module holds a worker script in a string (5 lines or more with an import, naming bps
    or mxnet): a scenario in tests/jobs/<topic>_job.py instead, started with cluster.run_job (under
    bpslaunch: test_launcher.job_command)."""
    found = {str(path.relative_to(ROOT)): count for path in sorted((ROOT / "tests").rglob("test_*.py"))
             if (count := _worker_strings(path))}
    assert not found, f"worker code in strings (move it to tests/jobs/): {found}"
