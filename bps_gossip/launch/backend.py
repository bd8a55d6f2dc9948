"""What a launcher backend is: the interface every way bpslaunch runs a job implements.

A backend is one way of running a job; bpslaunch has four, tried in the order of
:data:`bps_gossip.launch.cli.BACKENDS` (the first whose :meth:`Backend.from_args` claims the
command line runs the job): ``ssh`` (``-H``/``--hostfile``: every process, on several hosts),
``local`` (``-np``: every process, on this machine), ``batch`` (inside ``srun`` or ``mpirun``:
one task's share) and ``byteps`` (the fallback: the role or workers DMLC_* names).

A backend answers two questions, and the supervisor (:mod:`.supervisor`) does the rest:

1. The layout (:meth:`Backend.plan`): which processes this bpslaunch starts, each one's
   environment (the DMLC_* variables that place it) and where it runs (:attr:`Process.host`,
   None for this machine). Everything wrong with the job is a ConfigError here, before anything
   starts.
2. Starting (:meth:`Backend.start`): a planned process becomes a child of the Supervisor. A
   backend whose processes run elsewhere starts a local process that stands for the remote one
   (``ssh`` runs ``python -m bps_gossip.launch.remote``, which stops its command when the
   connection closes).

Stopping is the supervisor's, the same for every backend: a signal to each child's process
group, a grace period, SIGKILL; the whole job stops on the first failure unless
:attr:`Backend.fail_fast` is off. :meth:`Backend.supervise` may wait differently (elastic
restarts) and :meth:`Backend.close` releases what ``plan`` made. Adding a backend (LSF's
blaunch, say): docs/architecture.md, "Adding a launcher backend".
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..errors import ConfigError
from .hostfile import Host
from .supervisor import SERVICE_EXIT_SECONDS, Child, Supervisor


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of the job as a backend plans it."""

    role: str  # "scheduler", "server" or "worker"
    label: str  # for bpslaunch's messages and the --output-dir file name
    prefix: str | None  # before each output line; None: the process shares bpslaunch's output
    env: dict[str, str]  # its whole environment, DMLC_* included
    host: Host | None = None  # where it runs; None: on this machine


def check_command(command: Sequence[str], env: Mapping[str, str]) -> None:
    """Raise ConfigError unless ``command`` names an executable on ``env``'s PATH."""
    if not command:
        raise ConfigError("no command given for the workers (e.g. bpslaunch python train.py)")
    if shutil.which(command[0], path=env.get("PATH")) is None:
        raise ConfigError(f"command not found or not executable: {command[0]!r}")


def note(message: str) -> None:
    """Print one line of bpslaunch's own on stderr (before a Supervisor runs; then use its note)."""
    print(f"bpslaunch: {message}", file=sys.stderr, flush=True)


class Backend(abc.ABC):
    """One way of running a job: plan its processes, start them, wait for them.

    Subclasses implement :meth:`from_args` and :meth:`plan`; the rest has defaults for
    processes that run on this machine.
    """

    fail_fast: ClassVar[bool] = True  # the first failure stops every process
    # How long the scheduler and servers get to exit after the workers (None: no limit).
    services_seconds: ClassVar[float | None] = SERVICE_EXIT_SECONDS
    python: str = sys.executable  # the interpreter that runs the scheduler and servers

    @classmethod
    @abc.abstractmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> Backend | None:
        """This backend set up for bpslaunch's command line and environment, or None when the
        command line asks for another one."""

    @abc.abstractmethod
    def plan(self, command: list[str]) -> list[Process]:
        """Every process this bpslaunch starts, services first; raise ConfigError if the job
        cannot run."""

    def argv(self, process: Process, command: list[str]) -> list[str]:
        """What ``process`` runs: the user's command for a worker, else the role's module."""
        if process.role == "worker":
            return command
        return [self.python, "-m", f"bps_gossip.{process.role}"]

    def start(self, sup: Supervisor, process: Process, command: list[str]) -> Child:
        """Start ``process`` under ``sup``; ending the returned child's process group must end
        the process, wherever it runs."""
        return sup.start(self.argv(process, command), process.env, process.role, process.label, process.prefix)

    def supervise(self, sup: Supervisor, children: list[Child], command: list[str]) -> int:
        """Wait for the job (``children``: what :meth:`start` returned, in plan order); return
        bpslaunch's exit status."""
        return sup.wait(fail_fast=self.fail_fast, services_seconds=self.services_seconds)

    def close(self) -> None:  # noqa: B027 (an optional hook: most backends make nothing to release)
        """Release what :meth:`plan` made; called once the job is over, also after a failure."""

    def run(self, command: list[str]) -> int:
        """Plan, start and supervise the job; return bpslaunch's exit status."""
        try:
            processes = self.plan(command)
            with Supervisor() as sup:
                children = [self.start(sup, process, command) for process in processes]
                return self.supervise(sup, children, command)
        finally:
            self.close()
