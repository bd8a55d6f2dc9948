"""Elastic jobs in bpslaunch: the flags, the restart of crashed workers, and ``--join``.

Local mode with ``--min-np``/``--max-np`` (or BPS_GOSSIP_ELASTIC=1) does not stop the job
when a worker fails: it starts a replacement process for the same slot (same
BYTEPS_LOCAL_RANK), which joins the running job at its next commit, until ``--reset-limit``
restarts have been used. Whether the job can go on with fewer workers is the scheduler's
call (BPS_GOSSIP_MIN_WORKERS, BPS_GOSSIP_ELASTIC_TIMEOUT); when it fails the job, bpslaunch
quotes its reason and stops everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping

from ..config import Config, load_config
from ..errors import ConfigError
from ..local_processes import start_ticks
from ..rendezvous import scheduler_answers
from .backend import check_command
from .diagnosis import (
    NO_WORKER_REGISTERED,
    SAME_FAILURES_TO_STOP,
    StartupFailures,
    error_line,
    not_worth_a_restart,
)
from .secret_files import find_secret_file
from .sessions import describe_exit
from .supervisor import Child, Supervisor

SETTLE_SECONDS = 2.0  # a worker failure is acted on this long after it, at the earliest
QUICK_FAILURE_SECONDS = 30.0  # a worker that fails this soon after starting failed "at start-up"
MAX_BACKOFF_SECONDS = 60.0  # the longest wait before restarting a slot that keeps failing at start-up
_POLL_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """The elastic flags of local mode; None means 'not given'."""

    min_np: int | None = None
    max_np: int | None = None
    reset_limit: int | None = None  # None: no limit (Horovod's default)
    timeout: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ElasticOptions:
        """The flags as bpslaunch's command line gives them."""
        return cls(args.min_np, args.max_np, args.reset_limit, args.elastic_timeout)

    @property
    def requested(self) -> bool:
        """True when a flag makes the job elastic (--min-np or --max-np)."""
        return self.min_np is not None or self.max_np is not None

    def check(self, num_proc: int) -> None:
        """Raise ConfigError unless 1 <= min-np <= np <= max-np and the rest makes sense."""
        if self.min_np is not None and not 1 <= self.min_np <= num_proc:
            raise ConfigError(f"--min-np {self.min_np}: must be between 1 and -np {num_proc}")
        if self.max_np is not None and self.max_np < num_proc:
            raise ConfigError(f"--max-np {self.max_np}: must be at least -np {num_proc}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit {self.reset_limit}: must be >= 0")
        if self.timeout is not None and not 0 < self.timeout < float("inf"):
            raise ConfigError(f"--elastic-timeout {self.timeout}: must be a positive number of seconds")

    def env(self) -> dict[str, str]:
        """The variables these flags set for every process of the job."""
        env = {"BPS_GOSSIP_ELASTIC": "1"} if self.requested else {}
        if self.min_np is not None:
            env["BPS_GOSSIP_MIN_WORKERS"] = str(self.min_np)
        if self.max_np is not None:
            env["BPS_GOSSIP_MAX_WORKERS"] = str(self.max_np)
        if self.timeout is not None:
            env["BPS_GOSSIP_ELASTIC_TIMEOUT"] = repr(self.timeout)
        return env


def check_elastic_env(options: ElasticOptions, config: Config, num_proc: int) -> None:
    """The flags that need an elastic job need one; BPS_GOSSIP_MIN_WORKERS must fit -np."""
    if not config.elastic:
        if options.reset_limit is not None or options.timeout is not None:
            flag = "--reset-limit" if options.reset_limit is not None else "--elastic-timeout"
            raise ConfigError(f"{flag} needs an elastic job: give --min-np and/or --max-np")
        return
    if config.min_workers > num_proc:
        raise ConfigError(f"BPS_GOSSIP_MIN_WORKERS={config.min_workers} exceeds -np {num_proc}")


def join_command(port: int, command: list[str], secret_file: str | None = None) -> str:
    """The command line that adds one more worker to the local job on ``port`` (with the
    job's secret file, when bpslaunch made one)."""
    line = shlex.join(["bpslaunch", "--join", "--root", f"127.0.0.1:{port}", *command])
    return line if secret_file is None else f"BPS_GOSSIP_SECRET_FILE={shlex.quote(secret_file)} {line}"


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # a --root on this host: its job's secret file is here


def join_env(root: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a ``bpslaunch --join`` worker: an elastic worker of the job at ``root``.

    Its rank comes from the running job, so DMLC_WORKER_ID and BYTEPS_LOCAL_RANK are dropped.
    """
    out = {k: v for k, v in env.items() if k not in ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK")}
    out.update({"DMLC_ROLE": "worker", "BPS_GOSSIP_ELASTIC": "1", "BYTEPS_LOCAL_SIZE": "1"})
    if root is not None:
        host, sep, port = root.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--root {root!r}: expected HOST:PORT, e.g. 127.0.0.1:9000")
        out.update({"DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": port})
    elif not out.get("DMLC_PS_ROOT_PORT"):
        raise ConfigError("--join needs the job's scheduler: --root HOST:PORT, or DMLC_PS_ROOT_URI "
                          "and DMLC_PS_ROOT_PORT in the environment")
    if not out.get("BPS_GOSSIP_SECRET") and not out.get("BPS_GOSSIP_SECRET_FILE") \
            and out.get("DMLC_PS_ROOT_URI", "127.0.0.1") in LOCAL_HOSTS:
        found = find_secret_file(int(out["DMLC_PS_ROOT_PORT"]))  # the job bpslaunch -np runs here
        if found is not None:
            out["BPS_GOSSIP_SECRET_FILE"] = found
    load_config(out)  # a bad variable is an error before anything starts
    return out


def run_join(root: str | None, command: list[str], env: Mapping[str, str] | None = None) -> int:
    """``bpslaunch --join``: one worker process that joins the running elastic job at ``root``
    (HOST:PORT, default DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT). Returns its exit code."""
    given = os.environ if env is None else env
    child_env = join_env(root, given)
    check_command(command, child_env)
    host, port = child_env.get("DMLC_PS_ROOT_URI", "127.0.0.1"), int(child_env["DMLC_PS_ROOT_PORT"])
    try:
        answers = scheduler_answers(load_config(child_env))
    except ConfigError as exc:  # a wrong secret, a bad variable: the worker would fail the same way
        print(f"bpslaunch: {exc}: not starting the worker", file=sys.stderr, flush=True)
        return 1
    if not answers:
        print(f"bpslaunch: no job answers at {host}:{port} (it may have finished, or the address is wrong): "
              "not starting the worker", file=sys.stderr, flush=True)
        return 1
    secret_file = child_env.get("BPS_GOSSIP_SECRET_FILE")
    found = "" if secret_file == given.get("BPS_GOSSIP_SECRET_FILE") else f", with the job's secret from {secret_file}"
    child_env["BPS_GOSSIP_JOINER"] = "1"  # it answered: a worker it then ignores for seconds has ended
    print(f"bpslaunch: joining the elastic job at {child_env.get('DMLC_PS_ROOT_URI', '127.0.0.1')}:"
          f"{child_env['DMLC_PS_ROOT_PORT']} (admitted at its next commit{found})", file=sys.stderr, flush=True)
    with Supervisor() as sup:
        sup.start(command, child_env, "worker", "worker", None)
        return sup.wait(fail_fast=False)


def scheduler_reason(scheduler: Child) -> str:
    """The scheduler's own words on why it ended: its 'the job failed' line, else its last line."""
    for pump in scheduler.pumps:
        pump.join(timeout=1.0)  # the output it printed before exiting
    lines = list(scheduler.tail)
    reason = next((line.split("the job failed: ", 1)[-1] for line in reversed(lines) if "the job failed" in line),
                  lines[-1] if lines else "no message")
    if "BPS_GOSSIP_MIN_WORKERS" in reason:  # the scheduler speaks in variables; the user gave flags
        reason += " [set by --min-np and --elastic-timeout]"
    return reason


class ElasticRun:
    """Supervise the workers of an elastic local job: restart the failed, stop on job failure.

    ``sup`` is the launcher's Supervisor, with the scheduler, servers and the first workers
    started; ``workers`` maps each slot (0..N-1) to its first process; ``slot_env(slot)``
    gives a replacement's environment.
    """

    def __init__(self, sup: Supervisor, workers: dict[int, Child], command: list[str],
                 slot_env: Callable[[int], Mapping[str, str]], reset_limit: int | None,
                 restart_delay: float) -> None:
        self.sup = sup
        self.current = dict(workers)  # slot -> its latest process
        self.first_workers = {id(child) for child in workers.values()}
        self.command = command
        self.slot_env = slot_env
        self.reset_limit = reset_limit
        self.restart_delay = max(SETTLE_SECONDS, restart_delay)
        self.restarts = 0
        self.given_up: set[int] = set()  # slots whose failure the ended job no longer needs restarted
        # (slot, failed child, when to act, why not to restart it: None to restart it) to act on
        self.pending: list[tuple[int, Child, float, str | None]] = []
        now = time.monotonic()
        self.born = {id(child): now for child in workers.values()}  # when each worker process started
        self.quick_failures: dict[int, int] = {}  # slot -> its processes that failed at start-up in a row
        self.startup_failures = StartupFailures()  # slot -> the same failure at start-up, repeated
        self.scheduler = next((c for c in sup.children if c.role == "scheduler"), None)
        self.first_error = 0
        self.finished: str | None = None  # the first worker that exited 0: the job is ending

    def _slot_of(self, child: Child) -> int | None:
        return next((slot for slot, c in self.current.items() if c is child), None)

    def run(self) -> int:
        """Wait until every slot's latest worker exited 0 (then 0), or the job fails."""
        sup = self.sup
        while True:
            if sup.signals:
                return self._stopped()
            for child in sup.reap():
                code = self._on_exit(child)
                if code is not None:
                    return code
            code = self._act_on_failures()
            if code is not None:
                return code
            if not self.pending and all(c.code == 0 or s in self.given_up for s, c in self.current.items()):
                break
            time.sleep(_POLL_SECONDS)
        return self._wait_scheduler()

    def _on_exit(self, child: Child) -> int | None:
        """Note one child's exit; return an exit status when it ends the job."""
        code = child.code
        if child is self.scheduler:
            if code != 0:
                return self._fail(f"the scheduler failed the job ({describe_exit(code)}): {self._reason()}", code)
            self._stop_unadmitted()
            return None
        if child.role != "worker":
            if code != 0:  # a lost server opens a new generation; the scheduler decides what follows
                self._note(f"{child.label} exited with {describe_exit(code)}")
            return None
        slot = self._slot_of(child)
        if slot in self.given_up:
            return None  # stopped by us (never admitted) or given up on already
        if code == 0 and self.finished is None:
            # Training is done (as torchrun and the scheduler see it): failed workers are not
            # restarted any more, joiners are told the job is over.
            self.finished = child.label
        if code != 0 and slot is not None and self._job_ended():
            # Failed after the job ended (say, while saving a checkpoint): nothing to restart it into.
            self._note(f"{child.label} (pid {child.proc.pid}) exited with {describe_exit(code)} after the job ended")
            self.given_up.add(slot)
            self.first_error = self.first_error or code
        elif code != 0 and slot is not None:
            self._note(f"{child.label} (pid {child.proc.pid}) exited with {describe_exit(code)}")
            # Decided later: if this is the scheduler failing the job, its reason is the one to report.
            verdict = self._not_restarted(slot, child)
            delay = self.restart_delay if verdict is not None else self._delay(slot, child)
            self.pending.append((slot, child, time.monotonic() + delay, verdict))
        return None

    def _delay(self, slot: int, child: Child) -> float:
        """How long to wait before restarting ``slot``: doubled for each of its processes that failed
        at start-up in a row (a broken script or environment is not restarted in a tight loop)."""
        now = time.monotonic()
        quick = now - self.born.pop(id(child), now) < QUICK_FAILURE_SECONDS
        failures = self.quick_failures[slot] = self.quick_failures.get(slot, 0) + 1 if quick else 0
        delay = min(MAX_BACKOFF_SECONDS, self.restart_delay * 2 ** max(0, failures - 1))
        if failures > 1:
            self._note(f"slot {slot} failed {failures} times in a row within {QUICK_FAILURE_SECONDS:g} s of "
                       f"starting: restarting it in {delay:g} s")
        return delay

    def _act_on_failures(self) -> int | None:
        """Restart (or give up on) the failed workers whose delay has passed."""
        now = time.monotonic()
        due = [p for p in self.pending if now >= p[2]]
        for item in due:
            self.pending.remove(item)
            slot, child, _, verdict = item
            if self._job_ended() or self.finished is not None:  # the survivors finished the training
                self._note(f"{child.label} is not restarted: {self.finished or 'a worker'} finished training")
                self.given_up.add(slot)
                continue
            if verdict is not None:
                return self._fail(verdict, child.code or 1)
            if self.reset_limit is not None and self.restarts >= self.reset_limit:
                return self._fail(f"{child.label} exited with {describe_exit(child.code)} "
                                  f"and the reset limit is reached ({self.restarts} of --reset-limit "
                                  f"{self.reset_limit} restarts used); stopping the job", child.code)
            self.restarts += 1
            label = f"w{len([c for c in self.sup.children if c.role == 'worker'])}"
            limit = "no limit" if self.reset_limit is None else f"--reset-limit {self.reset_limit}"
            self._note(f"starting worker {label} in place of {child.label} "
                       f"(restart {self.restarts}, {limit}); it joins at the job's next commit")
            self.current[slot] = self.sup.start(self.command, self.slot_env(slot), "worker",
                                                f"worker {label}", f"[{label}] ")
            self.born[id(self.current[slot])] = time.monotonic()
        return None

    def _not_restarted(self, slot: int, child: Child) -> str | None:
        """Why restarting ``child`` cannot help (the job then ends with it), or None: it failed
        with a configuration error (or a programming error before it registered), or its slot
        failed at start-up the same way SAME_FAILURES_TO_STOP times in a row (:mod:`.diagnosis`)."""
        for pump in child.pumps:
            pump.join(timeout=1.0)  # the traceback it printed before exiting
        error = error_line(child.tail)
        code = child.code if child.code is not None else 1
        if not_worth_a_restart(error, child.registered):
            return (f"{child.label} failed with {describe_exit(code)} on a configuration or programming error, "
                    f"the same at every start: not restarting it, stopping the job. The error: {error}")
        now = time.monotonic()
        at_start = not child.registered or now - self.born.get(id(child), now) < QUICK_FAILURE_SECONDS
        same = self.startup_failures.count(slot, code, error, at_start)
        if same < SAME_FAILURES_TO_STOP:
            return None
        how = describe_exit(code) if error else f"{describe_exit(code)}, nothing on stderr"
        said = f". The error: {error}" if error else ""
        return (f"slot {slot} failed the same way {same} times in a row at start-up ({how}): not restarting it "
                f"again, stopping the job{said}")

    def _stop_unadmitted(self) -> None:
        """The scheduler ended the job. A replacement still running that never registered is still
        starting and would find no scheduler: it is stopped, and its exit status does not count.
        One that registered trained (or was told the job is over) and is exiting: it counts, as
        first workers do (before, it was stopped with a note although it trained to the end)."""
        for slot, child in self.current.items():
            if child.proc.poll() is None and id(child) not in self.first_workers and not child.registered:
                self.given_up.add(slot)
                self._note(f"{child.label} (a replacement) is still running after the job ended; stopping it")
                self.sup.signal_group(child.proc.pid, signal.SIGTERM)

    def _job_ended(self) -> bool:
        return self.scheduler is not None and self.scheduler.code is not None

    def _wait_scheduler(self) -> int:
        """Every local worker is done: the scheduler exits once every worker (also those that
        joined with --join) has left; then the servers get a bounded time."""
        sup = self.sup
        if self.scheduler is not None and self.scheduler.proc.poll() is None and sup.none_registered():
            return self._fail(NO_WORKER_REGISTERED, 1)  # the scheduler would wait for them until its start timeout
        noted = False
        started = time.monotonic()
        while self.scheduler is not None and self.scheduler.proc.poll() is None:
            if sup.signals:
                return self._stopped()
            if not noted and time.monotonic() - started > 5.0:
                self._note("every local worker has finished; waiting for the scheduler "
                           "(workers that joined with --join may still be running)")
                noted = True
            time.sleep(_POLL_SECONDS)
        sup.reap()
        if self.scheduler is not None and self.scheduler.code != 0:
            code = self.scheduler.code
            return self._fail(f"the scheduler failed the job ({describe_exit(code)}): {self._reason()}", code)
        sup.wait_services()
        if sup.signals:
            return self._stopped()
        return self.first_error

    def _reason(self) -> str:
        return "no scheduler" if self.scheduler is None else scheduler_reason(self.scheduler)

    def _fail(self, message: str, code: int) -> int:
        self._note(message)
        self.sup.stop(signal.SIGTERM)
        return code or 1

    def _stopped(self) -> int:
        sig = self.sup.signals[0]
        self._note(f"got {signal.Signals(sig).name}; stopping every process")
        self.sup.stop(sig)
        return 128 + sig

    def _note(self, message: str) -> None:
        self.sup.note(message)


def restart_delay(config: Config) -> float:
    """How long after a crash its replacement starts: once the scheduler has declared the dead
    worker lost, so that the replacement never counts twice against --max-np. The scheduler of a
    local job sees a process on its host exit within one tick (bps_gossip.local_processes); without
    /proc it waits for the heartbeat timeout."""
    tick = min(0.5, config.heartbeat_interval)
    if start_ticks() is not None:
        return 2 * tick + 0.2
    return config.heartbeat_timeout + tick + 0.2
