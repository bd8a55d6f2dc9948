"""The scheduler of a local bpslaunch job cleans up after bpslaunch if bpslaunch is killed.

bpslaunch made the job's secret file and removes it once it has stopped every worker it
started (a replacement may still be starting, about to read it). Killed with SIGKILL, it
cannot: its children get a parent-death signal (SIGHUP for the scheduler), and the scheduler,
told by BPS_GOSSIP_SECRET_FILE_OWNED that the file is bpslaunch's, removes it and the shared
memory of the workers (killed too). getppid() alone cannot tell that bpslaunch died: the kernel
sends the signal as bpslaunch's main thread ends and may first hand its children to its other
threads.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping

from ..config import OWNED_SECRET_VAR
from ..local_processes import REGISTRATIONS_VAR
from ..transport import shm


class LauncherWatch:
    """Notes whether the launcher died (:meth:`clean_up` then removes what it left), and whether it
    asked for the workers' registrations on stderr."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env  # bpslaunch's own variables for its scheduler
        self.owned = env.get("BPS_GOSSIP_SECRET_FILE") if env.get(OWNED_SECRET_VAR) == "1" else None
        self.port = env.get("DMLC_PS_ROOT_PORT", "")
        self.launcher = os.getppid()
        self.died = False
        # bpslaunch reads the scheduler's stderr for the workers that registered (local_processes.py)
        self.report_registrations = env.get(REGISTRATIONS_VAR) == "1"

    def install(self) -> None:
        """Handle SIGHUP, bpslaunch's parent-death signal (main thread only)."""
        signal.signal(signal.SIGHUP, self._on_hangup)

    def _on_hangup(self, signum: int, _frame: object) -> None:
        # Once: the kernel signals again each time it hands us on (to another of the dying
        # launcher's threads, then to init), and a second exit would cut the clean-up short.
        if not self.died:
            self.died = True
            sys.exit(128 + signum)

    def clean_up(self) -> None:
        """If bpslaunch made the secret file and is gone: remove the file and its workers' segments."""
        if not self.owned or not (self.died or os.getppid() != self.launcher):
            return
        try:
            os.unlink(self.owned)
        except OSError:
            pass
        if self.port.isdigit():
            time.sleep(0.5)  # its workers die of their own parent-death signal meanwhile
            shm.sweep(self.port)
