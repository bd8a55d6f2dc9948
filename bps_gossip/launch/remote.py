"""The remote end of a multi-host bpslaunch: ``python -m bps_gossip.launch.remote``, run by ssh.

It reads one JSON line on stdin, ``{"argv": [...], "cwd": "...", "env": {...}, "secret": "..."}``,
starts ``argv`` in that directory in a session of its own, with ``env`` over the host's own
environment and the job secret in a file only this user can read (BPS_GOSSIP_SECRET_FILE), and
exits with the command's status. Then it keeps reading stdin: when bpslaunch stops the job, or
dies, or the connection drops, stdin ends and the command's whole process group is stopped
(SIGTERM, then SIGKILL after a grace period). That is how nothing outlives its job on a remote
host even when ssh gives the remote side no signal (it does not without a terminal).

``python -m bps_gossip.launch.remote --probe`` prints this host's facts for bpslaunch's check: a free
TCP port (for the scheduler), the Python version and the host name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..transport import shm

GRACE_SECONDS = 3.0
MAX_SPEC_BYTES = 1 << 20  # the launcher's line: argv, cwd and the forwarded environment


def probe(program: str = "", path: str = "") -> dict[str, Any]:
    """What bpslaunch asks a host before it starts anything there; with ``program``, the file it
    would run here with the forwarded PATH ``path`` (relative to nothing: "" if none)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        port = sock.getsockname()[1]
    found = {}
    if program and os.sep in program and not os.path.isabs(program):
        found["program"] = program  # relative to the job's directory, which the probe is not in
    elif program:
        where = program if os.path.isabs(program) else shutil.which(program, path=path)
        found["program"] = where if where and os.path.exists(where) else ""
    return {"port": port, "python": sys.version.split()[0], "hostname": socket.gethostname(), **found}


def read_spec(fd: int) -> tuple[list[str], str, dict[str, str], str | None]:
    """Read and check the launcher's line from file descriptor ``fd`` (read unbuffered, so the
    stdin watcher can go on reading it raw); ValueError says what is wrong with it."""
    line = b""
    while b"\n" not in line:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        line += chunk
        if len(line) > MAX_SPEC_BYTES:
            raise ValueError(f"the job description is longer than {MAX_SPEC_BYTES} bytes")
    if not line.strip():
        raise ValueError("no job description on stdin (this is run by bpslaunch -H, not by hand)")
    spec = json.loads(line.split(b"\n", 1)[0])
    if not isinstance(spec, dict):
        raise ValueError("the job description must be a JSON object")
    argv, cwd, env, secret = spec.get("argv"), spec.get("cwd"), spec.get("env"), spec.get("secret")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a non-empty list of strings")
    if not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map strings to strings")
    if secret is not None and not isinstance(secret, str):
        raise ValueError("secret must be a string")
    return argv, cwd, env, secret


def _stop_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + GRACE_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill_group(proc)  # the leader's leftovers too


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


SECRET_PREFIX = "bpsg_secret_remote_"  # then this process's pid: whose file it is


def _write_secret(secret: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"{SECRET_PREFIX}{os.getpid()}_")  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_secret_files() -> list[str]:
    """Remove the secret files of this user's remote ends that were killed before they could
    (a host that lost power keeps its /tmp until it reboots, or until the next job here); the
    paths removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(SECRET_PREFIX + "*"):
        pid = path.name[len(SECRET_PREFIX):].split("_", 1)[0]
        try:
            info = path.lstat()
        except OSError:
            continue
        if pid.isdigit() and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not _alive(int(pid)):
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass
    return removed


def run(argv: list[str], cwd: str, env: Mapping[str, str], secret: str | None, stdin_fd: int) -> int:
    """Run the job's command here until it exits or ``stdin`` ends; return its exit status."""
    sweep_secret_files()
    secret_file = None
    child_env = dict(os.environ)
    child_env.update(env)
    if secret is not None:
        secret_file = child_env["BPS_GOSSIP_SECRET_FILE"] = _write_secret(secret)
        child_env.pop("BPS_GOSSIP_SECRET", None)
    try:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:
            print(f"bpslaunch on {socket.gethostname()}: cannot start {argv[0]!r} in {cwd}: {exc.strerror}",
                  file=sys.stderr, flush=True)
            return 127
        stopping = threading.Event()

        def stop(sig: int = signal.SIGTERM) -> None:
            if not stopping.is_set():
                stopping.set()
                _stop_group(proc, sig)

        def watch_stdin() -> None:
            while os.read(stdin_fd, 65536):
                pass  # nothing more is sent: anything read is ignored until the end
            stop()

        threading.Thread(target=watch_stdin, name="bpsg-remote-stdin", daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: threading.Thread(target=stop, args=(signum,)).start())
        code = proc.wait()
        if not stopping.is_set():
            _kill_group(proc)  # what the command started and left running goes with it
        shm.sweep_after(proc.pid, child_env)  # a killed worker could not unlink its segments
        return 128 - code if code < 0 else code
    finally:
        if secret_file is not None:
            os.unlink(secret_file)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``--probe``, or run the job's command described on stdin."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--probe"] or (len(args) == 4 and args[:2] == ["--probe", "--which"]):
        print(json.dumps(probe(*args[2:])), flush=True)
        return 0
    if args:
        print(f"bps_gossip.launch.remote: unknown arguments {args!r}", file=sys.stderr)
        return 2
    stdin_fd = sys.stdin.fileno()
    try:
        command, cwd, env, secret = read_spec(stdin_fd)
    except ValueError as exc:
        print(f"bps_gossip.launch.remote on {socket.gethostname()}: {exc}", file=sys.stderr, flush=True)
        return 2
    return run(command, cwd, env, secret, stdin_fd)


if __name__ == "__main__":
    sys.exit(main())
