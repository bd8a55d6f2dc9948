"""The BytePS backend: bpslaunch without ``-np``, ``-H`` or a batch task runs the role that
DMLC_ROLE names, as BytePS's own launcher does.

``DMLC_ROLE=scheduler bpslaunch`` and ``DMLC_ROLE=server bpslaunch`` run that role in this
process (they exit by themselves once every worker has shut down); ``DMLC_ROLE=worker
bpslaunch COMMAND...`` runs COMMAND BYTEPS_LOCAL_SIZE times, with BYTEPS_LOCAL_RANK = 0..L-1,
and returns the first non-zero exit code. The user's DMLC_* variables are the layout.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Mapping

from ..config import load_config
from .backend import Backend, Process, check_command, note


class BytepsBackend(Backend):
    """This machine's share of a job laid out by the DMLC_* variables (the fallback)."""

    fail_fast = False  # surviving workers see the loss themselves (and elastic jobs go on)

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> BytepsBackend:
        if env.get("SLURM_JOB_ID") and not args.no_batch_env and not env.get("DMLC_ROLE"):
            note("in a Slurm job but not in an srun step: running one worker here; "
                 "'srun bpslaunch ...' runs one per task")
        return cls(env)

    def plan(self, command: list[str]) -> list[Process]:
        check_command(command, self.env)
        size = load_config(self.env).local_size
        envs = [{**self.env, "BYTEPS_LOCAL_RANK": str(rank), "BYTEPS_LOCAL_SIZE": str(size)} for rank in range(size)]
        if size > 1:
            for child_env in envs:
                load_config(child_env)
                child_env.setdefault("PYTHONUNBUFFERED", "1")
        return [Process("worker", f"local rank {rank}", f"[{rank}] " if size > 1 else None, child_env)
                for rank, child_env in enumerate(envs)]

    def run(self, command: list[str]) -> int:
        """A scheduler or server runs here, in this process; workers as children."""
        role = load_config(self.env).role
        if role == "worker":
            return super().run(command)
        if command:
            note(f"DMLC_ROLE={role} runs the {role}; ignoring the command {' '.join(command)!r}")
        return int(importlib.import_module(f"bps_gossip.{role}").main())

