"""The hosts of a multi-host job: ``-H host1:4,host2:4`` and ``--hostfile FILE``, as Horovod
and Open MPI write them, and where each worker process goes.

A host is a name or an IPv4 address, optionally ``user@`` before it, and a number of slots
(worker processes it may run; 1 when not given). Workers fill the hosts in the order given,
each up to its slots, like ``horovodrun`` and ``mpirun`` by slot.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ..errors import ConfigError

# user@ is optional; a host is letters, digits, dots, dashes and underscores, not starting with '-'
# (so nothing on the ssh command line can be read as an option).
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_SLOTS = 4096


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine of the job: how ssh reaches it and how many worker processes it may run."""

    target: str  # what ssh is given: host or user@host
    slots: int = 1

    @property
    def address(self) -> str:
        """The host without ``user@``: what the other hosts connect to."""
        return self.target.rpartition("@")[2]


@dataclasses.dataclass(frozen=True)
class Placement:
    """The worker processes one host runs: DMLC_WORKER_ID ``index``, ranks ``first_rank`` on."""

    host: Host
    index: int
    workers: int
    first_rank: int


def _host(name: str, where: str) -> str:
    if not _HOST.match(name):
        raise ConfigError(f"{where}: {name!r} is not a host name or IPv4 address (optionally user@host)")
    return name


def _slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots {text!r} is not a whole number") from None
    if not 1 <= slots <= MAX_SLOTS:
        raise ConfigError(f"{where}: slots {slots} must be between 1 and {MAX_SLOTS}")
    return slots


def check_unique(hosts: list[Host], where: str) -> list[Host]:
    """``hosts`` as given; raise ConfigError if a host (by address) is listed twice."""
    seen: set[str] = set()
    for host in hosts:
        if host.address in seen:
            raise ConfigError(f"{where}: host {host.address!r} is listed twice; give it once with all its slots")
        seen.add(host.address)
    return hosts


def _unique(hosts: list[Host], where: str) -> list[Host]:
    check_unique(hosts, where)
    if not hosts:
        raise ConfigError(f"{where}: no hosts")
    return hosts


def parse_host_item(item: str, where: str, default_slots: int = 1) -> Host:
    """One ``host`` or ``host:slots`` (``default_slots`` when not given), validated as ``-H``
    validates it; ``where`` starts the ConfigError's message."""
    name, colon, slots = item.partition(":")
    return Host(_host(name, where), _slots(slots, where) if colon else default_slots)


def parse_hosts(spec: str) -> list[Host]:
    """``host1:4,host2:4,host3`` (``-H``): hosts with their slots (1 when not given)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        where = f"-H {spec!r}"
        if not item:
            raise ConfigError(f"{where}: an empty host between commas")
        hosts.append(parse_host_item(item, where))
    return _unique(hosts, f"-H {spec!r}")


def read_hostfile(path: str) -> list[Host]:
    """A hostfile as Horovod and Open MPI read it: one host per line, ``host slots=N`` (or
    ``host:N``, or the host alone for one slot); ``#`` starts a comment."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: cannot read it: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}, line {number}"
        name, colon, slots = words[0].partition(":")
        count = _slots(slots, where) if colon else 1
        for word in words[1:]:
            key, equals, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots") and equals:
                if key == "slots":
                    count = _slots(value, where)
            else:
                raise ConfigError(f"{where}: {word!r} is not understood (expected 'host slots=N')")
        hosts.append(Host(_host(name, where), count))
    return _unique(hosts, f"--hostfile {path}")


def place_workers(hosts: Sequence[Host], num_proc: int | None) -> list[Placement]:
    """Fill ``hosts`` in order with ``num_proc`` workers (default: every slot); hosts left
    without a worker are not part of the job."""
    total = sum(host.slots for host in hosts)
    if num_proc is None:
        num_proc = total
    if num_proc < 1:
        raise ConfigError(f"-np {num_proc}: the number of workers must be >= 1")
    if num_proc > total:
        raise ConfigError(f"-np {num_proc} is more than the {total} slot(s) of the hosts "
                          f"({', '.join(f'{h.address}:{h.slots}' for h in hosts)})")
    placements, left = [], num_proc
    for host in hosts:
        if left == 0:
            break
        workers = min(host.slots, left)
        placements.append(Placement(host, len(placements), workers, num_proc - left))
        left -= workers
    return placements
