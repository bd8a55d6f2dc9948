"""The programs the launcher tests run under bpslaunch (tests/clusters/test_launcher.py,
test_launcher_batch.py, test_launcher_ssh.py, test_quiet_output.py, test_security.py).

A test starts one as ``bpslaunch ... python tests/jobs/launcher_job.py <scenario> [ARG...]``
(test_launcher.job_command). Each prints plain lines (``OUT``, ``READY``, ``RESULT rank=...``)
that the test reads behind bpslaunch's ``[rank] `` prefixes, as a user's script would.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from job_tools import run

import bps_gossip as bps
from bps_gossip.config import load_config


def print_sum() -> None:
    """One push_pull of ones: ``OUT rank size sum pid`` (test_launcher.parse_sums reads it)."""
    print("OUT", bps.rank(), bps.size(), bps.push_pull(np.ones(3), "x", average=False).tolist(), os.getpid())


def sum_of_ones() -> None:
    """The job every launcher mode runs: init, one push_pull, shutdown."""
    bps.init()
    print_sum()
    bps.shutdown()


def sum_then_argv(*argv: str) -> None:
    """sum_of_ones, then the arguments the script got after its scenario's name."""
    sum_of_ones()
    print("ARGV", list(argv))


def print_mode() -> None:
    """The trainer's default mode as bpslaunch --mode set it."""
    bps.init()
    print("MODE", load_config().mode)
    bps.shutdown()


def progress_bars() -> None:
    """A progress bar redrawn with '\\r' on stderr, as tqdm draws it, then a line on stdout."""
    bps.init()
    for step in range(1, 4):
        sys.stderr.write(f"\rprogress {step}/3")
        sys.stderr.flush()
        time.sleep(0.05)
    sys.stderr.write("\r\n")
    print("done")
    bps.shutdown()


def rank_one_exits() -> None:
    """Rank 1 exits with code 3 after half a second; rank 0 would sleep on."""
    bps.init()
    print("PID", os.getpid(), flush=True)
    if bps.rank() == 1:
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(1000)


def ready_until_signal(stubborn: str) -> None:
    """Say READY and sleep; with ``stubborn`` "1" rank 0 ignores SIGTERM and SIGINT (the
    launcher must escalate to SIGKILL)."""
    bps.init()
    if bps.rank() == 0 and stubborn == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("READY", os.getpid(), flush=True)
    time.sleep(1000)


def ready_with_secret_file() -> None:
    """Say READY with the secret file bpslaunch made, and sleep."""
    bps.init()
    print("READY", os.getpid(), os.environ["BPS_GOSSIP_SECRET_FILE"], flush=True)
    time.sleep(1000)


def rank_zero_done_first() -> None:
    """sum_of_ones, with every rank but 0 finishing 2 s later: ``DONE`` when a rank is done."""
    bps.init()
    print_sum()
    if bps.rank() != 0:
        time.sleep(2)  # rank 0's worker is done long before these
    print("DONE", flush=True)
    bps.shutdown()


def rank_one_fails_after_push() -> None:
    """Every rank pushes once; rank 1 exits with code 3 before the second push_pull."""
    bps.init()
    bps.push_pull(np.ones(3), "x")
    if bps.rank() == 1:
        sys.exit(3)
    bps.push_pull(np.ones(3), "y")
    bps.shutdown()


def push_pull_forever() -> None:
    """Say READY after a first push_pull, then push_pull until stopped (Ctrl-C)."""
    bps.init()
    x = np.ones(1000, np.float32)
    bps.push_pull(x, "x")
    print("READY", bps.rank(), flush=True)  # both ranks are past their first push_pull: in the loop next
    while True:  # Ctrl-C lands here (tests/clusters/test_quiet_output.py reads these two lines' numbers)
        bps.push_pull(x, "x")


def secret_per_job() -> None:
    """The secret file bpslaunch made (path, mode, whether keys were read), then sum_of_ones."""
    bps.init()
    path = os.environ["BPS_GOSSIP_SECRET_FILE"]
    print("SECRET", path, oct(os.stat(path).st_mode & 0o777), load_config().keys is not None, flush=True)
    print_sum()
    bps.shutdown()


def across_hosts() -> None:
    """push_pull across ssh hosts; ``RESULT rank= size= host= cwd= extra=``. With DIE=1 the last
    rank dies by SIGKILL after it; with LOOP=1 every rank then sleeps until stopped."""
    bps.init()
    r, n = bps.rank(), bps.size()
    x = np.full(1000, r + 1, dtype=np.float32)
    out = bps.push_pull(x, name="t", average=False)
    assert np.all(out == n * (n + 1) / 2), out[:4]
    print(f"RESULT rank={r} size={n} host={os.environ['DMLC_NODE_HOST']} cwd={os.getcwd()} "
          f"extra={os.environ.get('EXTRA_SETTING')}", flush=True)
    if os.environ.get("DIE") == "1" and r == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("LOOP") == "1":
        while True:
            time.sleep(0.2)
    bps.shutdown()


if __name__ == "__main__":
    run({"sum_of_ones": sum_of_ones, "sum_then_argv": sum_then_argv, "print_mode": print_mode,
         "progress_bars": progress_bars, "rank_one_exits": rank_one_exits, "ready_until_signal": ready_until_signal,
         "ready_with_secret_file": ready_with_secret_file, "rank_zero_done_first": rank_zero_done_first,
         "rank_one_fails_after_push": rank_one_fails_after_push, "push_pull_forever": push_pull_forever,
         "secret_per_job": secret_per_job, "across_hosts": across_hosts})
