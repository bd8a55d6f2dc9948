"""Is a registered process still alive? Asked of the kernel, for processes on this host.

Heartbeats need BPS_GOSSIP_HEARTBEAT_TIMEOUT (10 s by default) to tell a dead process from a
slow one. On the scheduler's own host the kernel knows at once: the pid is gone, or a zombie
waiting for its parent. A pid alone is not an identity (pids are reused, and a process in
another pid namespace, a container, may show the same address and pid), so a process counts as
this host's only if it reported its own start time (``start_ticks``, /proc/self/stat) and the
process under its pid here started at that very tick.
"""

from __future__ import annotations

import errno
import resource


def start_ticks(pid: int | str = "self") -> int | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), or None
    where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count from after it.
    fields = stat.rpartition(b")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name; None if there is no such process.
    Raises OSError when the kernel cannot be asked (no file descriptor left, for example)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return None
        raise
    return stat.rpartition(b")")[2].split()


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to the hard one (a scheduler or server holds
    a descriptor per connection; 1024 is a common soft default); return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


# A line the scheduler writes on its stderr to ask the bpslaunch that started it to stop one of
# its own workers: "<STOP_REQUEST> <pid> <start ticks>". Only the scheduler's own output stream
# is read for it, and bpslaunch acts only on a child it started (never on a claimed pid).
STOP_REQUEST = "bps_gossip-stop-worker"
# The same channel the other way: with REGISTRATIONS_VAR=1 (set by bpslaunch) the scheduler writes
# "<WORKER_REGISTERED> <pid>" for each worker that registers, so that bpslaunch can tell a worker
# that never reached the job (no bps.init(), no 'bpsgossip' KVStore) from one that did.
WORKER_REGISTERED = "bps_gossip-worker-registered"
# And "<GENERATION_FORMED> <generation> <workers>" each time an address book goes out (the first
# rendezvous, every elastic change): an elastic launcher over several hosts adds workers only to a
# job that has started, and says how long a change took.
GENERATION_FORMED = "bps_gossip-generation"
REGISTRATIONS_VAR = "BPS_GOSSIP_REPORT_REGISTRATIONS"


class LocalProcess:
    """A process that is provably on this host (see the module docstring)."""

    def __init__(self, pid: int, ticks: int) -> None:
        self.pid = pid
        self.ticks = ticks

    @classmethod
    def find(cls, pid: int, ticks: int | None) -> LocalProcess | None:
        """The process ``pid`` if it is here and started at ``ticks``, else None."""
        if ticks is None or pid <= 0 or start_ticks(pid) != ticks:
            return None
        return cls(pid, ticks)

    def alive(self) -> bool | None:
        """False once the process has exited (gone, a zombie, or its pid taken by another); None
        when the kernel cannot tell now (no file descriptor left): unknown is never dead."""
        try:
            fields = _stat_fields(self.pid)
        except OSError:
            return None
        if fields is None or len(fields) < 20:
            return False
        try:
            ticks = int(fields[19])
        except ValueError:
            return False
        return ticks == self.ticks and fields[0] not in (b"Z", b"X")
