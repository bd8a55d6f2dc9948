"""examples/train_digits.py as a user runs it (issue 33): --fp16-pushpull under bpslaunch,
and its per-epoch lines whole in a log and in a terminal, with tqdm's progress bar about.

Real processes: bpslaunch with 2 workers writing into one log (``> log 2>&1``), and the
example alone on a pseudo-terminal. Every process carries the Job's BPSL_TEST_TAG and is
killed at teardown, pass or fail."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from test_launcher import LAUNCH, Job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "train_digits.py"
SMALL = ["--hidden", "16"]  # a small MLP: seconds per run


class OneLogJob(Job):
    """A Job whose bpslaunch writes stdout and stderr into one file, as ``> log 2>&1`` does."""

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp_path / f"launch{len(self.procs)}.log", "w+")
        proc = subprocess.Popen(LAUNCH + args, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.files = (log,)  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def finish_log(self, proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
        """Wait for ``proc``; its exit code and the log."""
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"bpslaunch did not finish: {self.log(proc)}") from None
        return proc.returncode, self.log(proc)

    @staticmethod
    def log(proc: subprocess.Popen) -> str:
        # Bytes, decoded: read_text() would turn every carriage return into a newline.
        return Path(proc.files[0].name).read_bytes().decode(errors="replace")  # type: ignore[attr-defined]

    def run_on_a_terminal(self, argv: list[str], timeout: float) -> tuple[int, str]:
        """Run ``argv`` with stdout and stderr on one pseudo-terminal; its exit code and all it wrote."""
        main, child = pty.openpty()
        # A terminal 24 x 100, as a user's: a new pseudo-terminal is 0 x 0, where tqdm shows no bar.
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        env = {**self.env}
        env.pop("PYTHONUNBUFFERED", None)  # as a user's shell: a terminal's stdout is line-buffered anyway
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                                start_new_session=True)
        proc.files = ()  # type: ignore[attr-defined]
        self.procs.append(proc)
        os.close(child)
        chunks, deadline = [], time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not select.select([main], [], [], 0.5)[0]:
                    continue
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(main)
        output = b"".join(chunks).decode(errors="replace")
        try:
            return proc.wait(max(1.0, deadline - time.monotonic())), output
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{argv} did not finish: {output}") from None


@pytest.fixture
def job(tmp_path):
    made = OneLogJob(tmp_path)
    yield made
    made.close()


def on_screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: a carriage return goes back to the start of the
    line, and what follows overwrites what was there."""
    shown = []
    for line in raw.split("\n"):
        cells: list[str] = []
        for piece in line.split("\r"):
            cells[:len(piece)] = piece
        shown.append("".join(cells).rstrip())
    return shown


def epoch_line(prefix: str, mode: str, epochs: int) -> str:
    """A regular expression for one whole per-epoch line."""
    return rf"^{prefix}rank (\d) {mode} epoch \d+/{epochs}: loss \d+\.\d{{4}} test accuracy \d\.\d{{4}}$"


@pytest.mark.timeout(120)
def test_fp16_pushpull_trains_with_allreduce(job):
    """Item 7: `--fp16-pushpull` without a mode stopped every rank with 'ValueError: DistributedTrainer:
    fp16 applies to mode='allreduce'' (the example always passed its default mode, gossip)."""
    code, log = job.finish_log(job.start(["-np", "2", sys.executable, str(EXAMPLE), "--epochs", "1", *SMALL,
                                          "--fp16-pushpull"]), timeout=100)
    assert code == 0, log
    assert log.count("final test accuracy (allreduce, 2 workers") == 2, log
    assert "[0] --fp16-pushpull: gradients pushed as float16, mode allreduce\n" in log, log


@pytest.mark.parametrize("argv, env, named", [
    (["--mode", "gossip"], {}, "not --mode gossip"),
    (["--mode", "both"], {}, "not --mode both"),
    ([], {"BPS_GOSSIP_MODE": "auto"}, "not BPS_GOSSIP_MODE=auto (bpslaunch --mode sets it)"),
    # issue 46: it named BPS_GOSSIP_MODE=async, a setting the user never made
    ([], {"BYTEPS_ENABLE_ASYNC": "1"}, "not BYTEPS_ENABLE_ASYNC=1 (mode async)"),
])
def test_fp16_pushpull_with_another_mode_is_a_usage_error(monkeypatch, capsys, argv, env, named):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from train_digits import main

    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--fp16-pushpull"])
    assert stopped.value.code == 2
    assert f"--fp16-pushpull pushes gradients as float16, which only mode allreduce does, {named}" \
        in capsys.readouterr().err


def test_fp16_pushpull_picks_allreduce_where_no_mode_was_chosen(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from train_digits import build_parser, choose_mode

    parser = build_parser()
    for given, expected in (("", "allreduce"), ("gossip", "allreduce"), ("allreduce", "allreduce")):
        monkeypatch.setenv("BPS_GOSSIP_MODE", given)
        assert choose_mode(parser, parser.parse_args(["--fp16-pushpull"])) == expected
        assert choose_mode(parser, parser.parse_args([])) == (given or "gossip")


@pytest.mark.timeout(120)
def test_epoch_lines_are_whole_lines_in_a_log(job):
    """Item 9: rank 0's tqdm bar went into the log too, and its carriage returns put epoch lines
    behind the bar's text on one line (`... accuracy 0.9192och/s]` in a terminal)."""
    epochs = 3
    code, log = job.finish_log(job.start(["-np", "2", sys.executable, str(EXAMPLE), "--epochs", str(epochs),
                                          *SMALL]), timeout=100)
    assert code == 0, log
    assert "\r" not in log, repr(log)
    lines = log.splitlines()
    assert all(re.match(r"^\[\d\] ", line) for line in lines), log
    found = [line for line in lines if re.match(epoch_line(r"\[\d\] ", "gossip", epochs), line)]
    assert len(found) == 2 * epochs, log


@pytest.mark.timeout(120)
def test_bar_and_epoch_lines_share_no_line_on_a_terminal(job):
    """The example alone on a terminal: the bar shows, and every epoch line stands whole on a
    line of its own (before: the bar's text, then the line, on one line)."""
    epochs = 3
    code, raw = job.run_on_a_terminal([sys.executable, str(EXAMPLE), "--epochs", str(epochs), *SMALL], timeout=100)
    assert code == 0, raw
    assert re.search(rf"gossip epochs: 100%\|#+\| {epochs}/{epochs} ", raw), raw  # the bar was there
    shown = on_screen(raw)
    mentions = [line for line in shown if f"/{epochs}: loss" in line]
    assert len(mentions) == epochs, shown
    assert all(re.match(epoch_line("", "gossip", epochs), line) for line in mentions), shown
