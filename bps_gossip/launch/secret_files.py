"""The job secret of a local bpslaunch job, in a file only this user can read.

bpslaunch -np writes a fresh secret into ``<tmp>/bpsg_secret_<port>_*`` (mode 0600); its
processes read it through BPS_GOSSIP_SECRET_FILE, so it is in no command line or environment.
``bpslaunch --join`` on the same host finds it by the job's port, so that the user need not
copy its path.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path


def _prefix(port: int) -> str:
    return f"bpsg_secret_{port}_"


def make_secret_file(port: int, secret: str | None = None) -> str:
    """``secret`` (default: a fresh one) in a file only this user can read; its path."""
    fd, path = tempfile.mkstemp(prefix=_prefix(port))  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write((secret or secrets.token_hex(32)) + "\n")
    return path


def find_secret_file(port: int) -> str | None:
    """The secret file of the local job on ``port``: the newest such file that is a regular file of
    this user's that nobody else can read or write (never a link), or None."""
    found = []
    for path in Path(tempfile.gettempdir()).glob(_prefix(port) + "*"):
        try:
            info = path.lstat()
        except OSError:
            continue  # gone meanwhile
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077:
            found.append((info.st_mtime, str(path)))
    return max(found)[1] if found else None


def remove_secret_file(path: str | None) -> None:
    """Remove a job's secret file (gone already: the scheduler removed it as bpslaunch was killed)."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
