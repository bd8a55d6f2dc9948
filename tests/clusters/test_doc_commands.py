"""Every shell command in README.md's and docs/*.md's code blocks runs as written on a fresh clone
(issue 33, item 8): no sudo (the commands say "as root" instead), no [optional] parts, every script
a tracked file, every option one its script (or bpslaunch) accepts, every bench_compression setting
name of the tables one that --only takes, every BPS_GOSSIP_/BYTEPS_/DMLC_ variable one that the
code reads, with values it accepts. The quick commands run for real; the emulated-host ones
(scripts/netns_cluster.py, netns_ssh.py) run where root, iproute2 and sshd are there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bps_gossip.config import HOST_REDUCE_VALUES, load_config
from bps_gossip.errors import ConfigError
from bps_gossip.launch import cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
LAUNCHERS = {"bpslaunch", ".venv/bin/bpslaunch"}
# Programs not ours: their own options are not checked, only a bpslaunch they start.
OTHERS = {"kubectl", "salloc", "srun", "mpirun", "mpiexec", "umask", "rm", "exit", ".venv/bin/pip"}
USER_SCRIPTS = {"train.py"}  # the reader's own training script, in examples of launching one
OUR_VARIABLE = re.compile(r"\b(?:BPS_GOSSIP|BYTEPS|DMLC)_[A-Z0-9_]*[A-Z0-9]\b")
# Named in docs, read by what we start rather than by our code.
FOREIGN_VARIABLES: dict[str, str] = {}  # DMLC_INTERFACE was one until bps_gossip read it too
# bpslaunch prints --join's command with the job's real port.
PLACEHOLDERS = {"127.0.0.1:PORT": "127.0.0.1:29500"}

sys.path.insert(0, str(SCRIPTS))

import bench_compression  # noqa: E402
import netns  # noqa: E402
import netns_ssh  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Command:
    """One simple command of a code block: where it is, its variable assignments and its words."""

    where: str
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]


def fenced_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line number of the first line, lines) of every shell code block of a Markdown text."""
    lines, fence, start, body = text.splitlines(), None, 0, []
    for number, line in enumerate(lines, 1):
        if fence is None and line.startswith("```"):
            fence, start, body = line[3:].strip(), number + 1, []
        elif fence is not None and line.startswith("```"):
            if fence in SHELL_FENCES:
                yield start, body
            fence = None
        elif fence is not None:
            body.append(line)


def logical_lines(first: int, lines: list[str]) -> Iterator[tuple[int, str]]:
    """Lines with their backslash continuations joined, numbered by where they start."""
    pending, start = "", first
    for number, line in enumerate(lines, first):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def split_words(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at && || ; |), comments and redirections dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands: list[list[str]] = [[]]
    words = list(lexer)
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in ("&&", "||", ";", "|"):
            commands.append([])
        elif word in (">", ">>", "<", "2>", "&>"):
            skip = True  # its target
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def assignments(words: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Leading NAME=value words (and `export`'s) apart from the command's words."""
    env = []
    while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] == "export"):
        if words[0] != "export":
            name, value = words[0].split("=", 1)
            env.append((name, value))
        words = words[1:]
    return env, words


def commands_of(text: str, name: str) -> list[Command]:
    """Every simple command of the shell code blocks of one document. A block whose first
    command is no program we know holds output, not commands."""
    found = []
    for first, block in fenced_blocks(text):
        block_commands = []
        for number, line in logical_lines(first, block):
            for words in split_words(line):
                env, argv = assignments(words)
                block_commands.append(Command(f"{name}:{number}", tuple(env), tuple(argv)))
        programs = [c.argv[0] for c in block_commands if c.argv]
        if programs and programs[0] in PYTHONS | LAUNCHERS | OTHERS | {"sudo"}:
            found += block_commands
    return found


@dataclasses.dataclass
class Checker:
    """The problems of commands, and the command lines of our scripts to parse for real."""

    tracked: set[str]
    problems: list[str] = dataclasses.field(default_factory=list)
    script_cases: dict[str, list[tuple[str, list[str]]]] = dataclasses.field(default_factory=dict)

    def command(self, where: str, env: tuple[tuple[str, str], ...], argv: list[str]) -> None:
        """Check one command (and the commands it starts)."""
        for name, value in env:
            self.variable(where, name, value)
        if not argv:
            return
        program, rest = argv[0], [PLACEHOLDERS.get(word, word) for word in argv[1:]]
        if program == "sudo":
            self.problems.append(f"{where}: sudo (not everywhere there is one: say 'as root' instead)")
            self.command(where, (), rest)
        elif program in PYTHONS:
            self.python(where, rest)
        elif program in LAUNCHERS:
            self.bpslaunch(where, rest)
        elif program in OTHERS:
            self.other(where, rest)
        elif program == "bash" and rest[:1] and rest[0].endswith(".sh"):  # a shell script of ours
            if rest[0] not in self.tracked:
                self.problems.append(f"{where}: {rest[0]} is not a file of the repository")
        else:
            self.problems.append(f"{where}: unknown program {program!r} (add it to this test's lists)")

    def python(self, where: str, rest: list[str]) -> None:
        if rest[:1] == ["-c"]:
            compile(rest[1], where, "exec")
        elif rest[:2] == ["-m", "bps_gossip.launch"]:
            self.bpslaunch(where, rest[2:])
        elif rest[:1] == ["-m"]:
            pass  # venv, pytest
        elif rest and rest[0] not in USER_SCRIPTS:
            self.script(where, rest[0], rest[1:])

    def script(self, where: str, path: str, args: list[str]) -> None:
        if path not in self.tracked:
            self.problems.append(f"{where}: {path} is not a file of the repository")
            return
        optional = [word for word in args if word.startswith("[") or word.endswith("]")]
        if optional:
            self.problems.append(f"{where}: {' '.join(optional)}: brackets do not run as written")
        self.script_cases.setdefault(path, []).append((where, args))
        if "--" in args and Path(path).name in ("netns_cluster.py", "netns_ssh.py"):
            nested = args[args.index("--") + 1:]
            if Path(path).name == "netns_ssh.py":
                nested = netns_ssh.expand(nested, ["10.213.0.1", "10.213.0.2"], ["--ssh-port", "22"])
            self.command(where, (), nested)

    def bpslaunch(self, where: str, args: list[str]) -> None:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                parsed = cli.build_parser().parse_args(args)
            cli.check_options(parsed)
        except SystemExit:
            error = said.getvalue().strip().splitlines()[-1:]
            self.problems.append(f"{where}: bpslaunch does not accept {' '.join(args)} ({''.join(error)})")
            return
        except ConfigError as exc:
            self.problems.append(f"{where}: bpslaunch {' '.join(args)}: {exc}")
            return
        for forwarded in (value for flag, value in zip(args, args[1:]) if flag == "-x"):
            name, _, value = forwarded.partition("=")
            if value:
                self.variable(where, name, value)
        command = parsed.command[1:] if parsed.command[:1] == ["--"] else parsed.command
        self.command(where, (), command)

    def other(self, where: str, rest: list[str]) -> None:
        for index, word in enumerate(rest):
            if word in LAUNCHERS:
                self.bpslaunch(where, rest[index + 1:])
                return
            if word == "-x" and index + 1 < len(rest) and "=" in rest[index + 1]:
                self.variable(where, *rest[index + 1].split("=", 1))

    def variable(self, where: str, name: str, value: str) -> None:
        """One of ours must be read by the code and take ``value`` (placeholders aside)."""
        if not OUR_VARIABLE.fullmatch(name):
            return
        if name not in known_variables():
            self.problems.append(f"{where}: {name} is read by nothing in bps_gossip/ or mxnet_plugin/")
        if "$" in value or re.fullmatch(r"[A-Z]", value) or name.endswith(("_FILE", "_DIR")):
            return  # a placeholder, or a path of the reader's machine
        try:
            load_config({name: value})
        except ConfigError as exc:
            if name in str(exc):
                self.problems.append(f"{where}: {name}={value}: {exc}")


def known_variables() -> set[str]:
    """Every BPS_GOSSIP_/BYTEPS_/DMLC_ name our packages read (as a string literal)."""
    if not hasattr(known_variables, "names"):
        text = "\n".join(path.read_text() for package in ("bps_gossip", "mxnet_plugin")
                         for path in (ROOT / package).rglob("*.py"))
        known_variables.names = set(re.findall(r"[\"']((?:BPS_GOSSIP|BYTEPS|DMLC)_[A-Z0-9_]+)[\"']", text))
    return known_variables.names | set(FOREIGN_VARIABLES)


def tracked_files() -> set[str]:
    """What a fresh clone has: git's tracked files (every file, outside a checkout)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*") if path.is_file()}
    return set(done.stdout.split("\0")) - {""}


def check_text(text: str, name: str, tracked: set[str]) -> Checker:
    """Every command of one document checked, except the script parsing that needs a process."""
    checker = Checker(tracked)
    for command in commands_of(text, name):
        checker.command(command.where, command.env, list(command.argv))
    return checker


def parse_errors(script_cases: dict[str, list[tuple[str, list[str]]]]) -> list[str]:
    """Every script command line the script itself refuses: one process per script, together."""
    procs = {path: subprocess.Popen([sys.executable, str(ROOT / "tests" / "jobs" / "doc_args_job.py"), str(ROOT / path),
                                     json.dumps([args for _, args in cases])],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for path, cases in script_cases.items()}
    problems = []
    try:
        for path, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or len(answers) != len(script_cases[path]):
                problems.append(f"{path}: could not be checked: {err[-2000:]}")
                continue
            problems += [f"{where}: {path} {' '.join(args)}: {answer['error']}"
                         for (where, args), answer in zip(script_cases[path], answers) if answer["error"]]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return problems


@pytest.fixture(scope="module")
def checked() -> dict[str, Checker]:
    tracked = tracked_files()
    return {doc.name: check_text(doc.read_text(encoding="utf-8"), doc.relative_to(ROOT).as_posix(), tracked)
            for doc in DOCUMENTS}


@pytest.mark.parametrize("document", [doc.name for doc in DOCUMENTS])
def test_commands_are_runnable_as_written(checked, document):
    assert checked[document].problems == []


@pytest.mark.timeout(120)
def test_every_script_accepts_its_documented_options(checked):
    cases: dict[str, list[tuple[str, list[str]]]] = {}
    for checker in checked.values():
        for path, found in checker.script_cases.items():
            cases.setdefault(path, []).extend(found)
    assert len(cases) >= 8, sorted(cases)  # the extraction still finds the benchmarks and examples
    assert parse_errors(cases) == []


# What the docs said before issue 33 (item 8), and a few more ways to go wrong.
BROKEN = """
```
sudo .venv/bin/python scripts/netns_cluster.py --time-to-accuracy --workers 4 --epochs 10 [--repeats 2]
python scripts/missing.py --fast
bash scripts/missing.sh out
bpslaunch --np 4 python train.py
BPS_GOSSIP_HOST_REDUCE=sometimes BPS_GOSSIP_NO_SUCH=1 bpslaunch -np 2 python train.py
mpirun -np 4 bpslaunch --root 127.0.0.1:PORT python train.py
python scripts/bench_training.py --modle mlp
bpslaunch -np 2 python scripts/netns_cluster.py --slow worker9=20 -- python examples/train_digits.py
```

```
  size  config  ours (tcp) ms
64 KiB    4w1s          7.158
```
"""


def test_the_check_finds_what_does_not_run():
    checker = check_text(BROKEN, "x.md", tracked_files())
    assert [problem.split(": ", 1)[1][:40] for problem in checker.problems] == [
        "sudo (not everywhere there is one: say '",
        "[--repeats 2]: brackets do not run as wr",
        "scripts/missing.py is not a file of the ",
        "scripts/missing.sh is not a file of the ",
        "bpslaunch does not accept --np 4 python ",
        "BPS_GOSSIP_HOST_REDUCE=sometimes: BPS_GO",
        "BPS_GOSSIP_NO_SUCH is read by nothing in",
        "bpslaunch --root 127.0.0.1:29500 python ",
    ]
    errors = sorted(error.split(": error: ", 1)[1][:40] for error in parse_errors(checker.script_cases))
    assert errors == ["--slow names unknown host(s) ['worker9']", "give either a worker command or --time-t",
                      "unrecognized arguments: --modle mlp"], errors


def setting_tables(text: str) -> Iterator[tuple[str, str]]:
    """(mode, setting name) of every row of docs/compression.md's tables whose first column is
    'setting', the mode being that of the bench_compression command above the table."""
    mode, in_table = "allreduce", False
    for line in text.splitlines():
        if "scripts/bench_compression.py" in line:
            mode = "gossip" if "--mode gossip" in line else "allreduce"
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:1] == ["setting"]:
            in_table = True
        elif not cells:
            in_table = False
        elif in_table and not set(cells[0]) <= set("-: "):
            yield mode, cells[0]


def test_the_compression_tables_name_settings_that_only_takes():
    """A row's setting, copied into --only, runs that row (the allreduce table wrote 'onebit,
    scaling, ef, nesterov' where the script knew only 'onebit (scaling, ef, nesterov)')."""
    rows = list(setting_tables((ROOT / "docs" / "compression.md").read_text(encoding="utf-8")))
    assert {mode for mode, _ in rows} == {"allreduce", "gossip"} and len(rows) >= 16, rows
    refused = []
    for mode, name in rows:
        try:
            bench_compression.select_settings(name, mode)
        except ValueError as exc:
            refused.append(f"{mode}: {exc}")
    assert refused == []
    assert bench_compression.parse_args(["--only", "onebit, scaling, ef, nesterov"]).settings == \
        bench_compression.parse_args(["--only", "onebit (scaling, ef, nesterov)"]).settings


def test_host_reduce_names_every_value_it_takes_and_readme_the_same():
    """The error for a bad BPS_GOSSIP_HOST_REDUCE lists exactly what is accepted (it said '1/0,
    true/false' while README listed auto/on/off), and README's row names each of them."""
    with pytest.raises(ConfigError) as caught:
        load_config({"BPS_GOSSIP_HOST_REDUCE": "sometimes"})
    listed = str(caught.value).split("must be one of ", 1)[1].split(", ")
    assert listed == list(HOST_REDUCE_VALUES)
    meaning = {value: load_config({"BPS_GOSSIP_HOST_REDUCE": value.upper()}).host_reduce for value in listed}
    assert set(meaning.values()) == {"auto", "on", "off"}
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| BPS_GOSSIP_HOST_REDUCE |"))
    assert [value for value in listed if not re.search(rf"\b{value}\b", row)] == []


@pytest.mark.parametrize("document", [doc.name for doc in DOCUMENTS])
def test_every_variable_named_is_read_by_the_code(document):
    path = next(doc for doc in DOCUMENTS if doc.name == document)
    named = set(OUR_VARIABLE.findall(path.read_text(encoding="utf-8")))
    assert sorted(named - known_variables()) == []


def all_commands() -> list[Command]:
    return [command for doc in DOCUMENTS
            for command in commands_of(doc.read_text(encoding="utf-8"), doc.relative_to(ROOT).as_posix())]


def plain_env() -> dict[str, str]:
    """This environment without a job's variables: a reader's shell."""
    return {k: v for k, v in os.environ.items() if not OUR_VARIABLE.fullmatch(k)}


def test_the_one_line_python_commands_run():
    """`python -c '...'` lines (the secret a job needs) run and print what they are for."""
    quick = [c for c in all_commands() if c.argv[:1] and c.argv[0] in PYTHONS and c.argv[1:2] == ("-c",)]
    assert quick, "the docs show how to make a secret"
    for command in quick:
        done = subprocess.run([sys.executable, *command.argv[1:]], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}\n", done.stdout), (command, done.stderr)


@pytest.mark.timeout(90)
def test_the_readme_training_command_runs_as_written():
    """README's first command ends with training on 4 workers: run that part as written (the
    virtualenv and pip parts need the network)."""
    written = (".venv/bin/bpslaunch", "-np", "4", ".venv/bin/python", "examples/train_digits.py")
    assert any(c.argv == written and c.where.startswith("README.md") for c in all_commands())
    if not (ROOT / written[0]).exists():
        pytest.skip("no .venv in the checkout (README's set-up makes it)")
    done = subprocess.run(written, cwd=ROOT, env=plain_env(), capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(re.findall(r"rank \d final test accuracy", done.stdout)) == 4, done.stdout[-2000:]


# Emulated hosts, started as `sudo .venv/bin/python scripts/...` would: PATH without the virtualenv.
try:
    netns_ssh.check_prerequisites()
    SSH_SKIP = ""
except netns.NetnsError as exc:
    SSH_SKIP = f"ssh hosts unavailable: {exc}"
try:
    netns.check_prerequisites()
    NETNS_SKIP = ""
except netns.NetnsError as exc:
    NETNS_SKIP = f"emulated hosts unavailable: {exc}"
WHICH_PYTHON = ("import sys, mxnet, bps_gossip as bg; bg.init(); "
                "print('PYTHON', bg.rank(), sys.executable, flush=True); bg.shutdown()")


def sudo_env() -> dict[str, str]:
    """The environment sudo gives: its secure_path, no virtualenv on PATH."""
    env = plain_env()
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def run_as_root(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run an emulated-host script with ``sudo_env``; sweep its namespaces if it had to be killed."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=sudo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            netns.cleanup_leftovers()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pythons_used(done: subprocess.CompletedProcess, ranks: int) -> set[str]:
    """The interpreters the ranks printed (all of them must have printed)."""
    found = dict(re.findall(r"PYTHON (\d+) (\S+)", done.stdout))
    assert done.returncode == 0 and len(found) == ranks, done.stdout[-2000:] + done.stderr[-3000:]
    return set(found.values())


@pytest.mark.skipif(bool(NETNS_SKIP), reason=NETNS_SKIP or "-")
@pytest.mark.timeout(60)
def test_a_bare_python_in_netns_cluster_is_the_scripts_interpreter():
    """docs/netns.md's `netns_cluster.py ... -- python examples/train_digits.py`: the namespaces
    ran the system's python (ModuleNotFoundError: mxnet) when PATH lacked the virtualenv."""
    done = run_as_root([str(SCRIPTS / "netns_cluster.py"), "--workers", "2", "--mbit", "0", "--",
                        "python", "-c", WHICH_PYTHON], timeout=50)
    assert pythons_used(done, 2) == {str(Path(sys.executable).parent / "python")}


@pytest.mark.skipif(bool(SSH_SKIP), reason=SSH_SKIP or "-")
@pytest.mark.timeout(60)
def test_a_bare_bpslaunch_in_netns_ssh_is_the_scripts_and_so_is_python_on_every_host():
    """docs/launcher.md's `netns_ssh.py ... -- bpslaunch ... python ...` failed with 'exec of
    "bpslaunch" failed' unless a virtualenv was activated."""
    done = run_as_root([str(SCRIPTS / "netns_ssh.py"), "--hosts", "2", "--", "bpslaunch", "-np", "2",
                        "-H", "{host0}:1,{host1}:1", "{ssh}", "python", "-c", WHICH_PYTHON], timeout=50)
    assert pythons_used(done, 2) == {str(Path(sys.executable).parent / "python")}
