"""Which server sums each partition: the same answer on every worker, with no message to agree.

By default a tensor's partitions go to servers (key + partition) mod servers, the key a hash of
the tensor's name: stateless, so workers may declare and push tensors in any order. With few
large partitions a hash loads servers unevenly (resnet18_v1's 20 partitions: the busiest of 4
servers had 51% of the bytes, 2 of 2 servers 55%), and no function of one tensor alone can do
better, since tensors of one size differ only by their hashed names.

:func:`plan_servers` balances a set of tensors known on every rank (a model's gradients, as a
trainer fuses them): every partition of the set, largest first (ties by key and partition), goes
to the server with the fewest bytes so far. The set is sorted before it is assigned, so the
order in which ranks list it does not matter, and each plan is assigned on its own (a rank's
earlier plans do not shift it: a worker that joins later and makes only this one agrees); a
tensor named by several plans keeps the first one's servers. The assignment is worked out
again, the same way, for any number of servers (a server lost in an elastic job). Every rank
must plan the same tensors before it pushes any of them: a rank that did not would send them
elsewhere, and the round would wait for it. Planning a tensor this process already pushed
raises instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..protocol.data import partitions
from .tensors import key_of

_lock = threading.Lock()
_plans: list[tuple[tuple[int, tuple[int, ...]], ...]] = []  # each call's (key, partition bytes), sorted
_planned: set[int] = set()
_by_servers: dict[int, dict[int, tuple[int, ...]]] = {}  # servers -> key -> server of each partition
_sent: set[int] = set()  # keys this process has routed: a plan may no longer move them


def server_of(key: int, index: int, nservers: int) -> int:
    """The server (0 to ``nservers`` - 1) of partition ``index`` of the tensor with ``key``."""
    if key not in _sent:  # once per tensor: from here on no plan may move it
        with _lock:
            _sent.add(key)
    if nservers > 1 and key in _planned:
        table = _by_servers.get(nservers)
        if table is None:
            table = _table(nservers)
        servers = table.get(key)
        if servers is not None and index < len(servers):
            return servers[index]
    return (key + index) % nservers


def _table(nservers: int) -> dict[int, tuple[int, ...]]:
    with _lock:
        table = _by_servers.get(nservers)
        if table is None:
            table = {}
            for plan in reversed(_plans):  # a tensor in several plans: the first one's servers
                table.update(assign(plan, nservers))
            _by_servers[nservers] = table
        return table


def assign(plan: Iterable[tuple[int, tuple[int, ...]]], nservers: int) -> dict[int, tuple[int, ...]]:
    """Each key's server per partition for one plan, (key, bytes of each partition) pairs: its
    partitions largest first (ties by key, then partition) onto the server with the fewest bytes
    so far; among equally loaded servers the first from the plan's smallest key mod servers, so
    that small plans do not all start on server 0."""
    if nservers < 1:
        raise ValueError(f"nservers must be at least 1, got {nservers}")
    plan = dict(plan)
    loads = [0] * nservers
    first = min(plan, default=0) % nservers
    order = [(first + i) % nservers for i in range(nservers)]
    table = {key: [0] * len(sizes) for key, sizes in plan.items()}
    for _, key, index in sorted((-size, key, index) for key, sizes in plan.items() for index, size in enumerate(sizes)):
        server = min(order, key=loads.__getitem__)
        loads[server] += plan[key][index]
        table[key][index] = server
    return {key: tuple(servers) for key, servers in table.items()}


def plan_of(tensors: Iterable[tuple[str, int, int]], partition_bytes: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(key, bytes of each partition) of ``tensors``, (name, elements, itemsize) each, split as
    push_pull splits them (BYTEPS_PARTITION_BYTES = ``partition_bytes``), sorted by key: the
    same whatever order they are listed in."""
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be at least 1, got {partition_bytes}")
    plan: dict[int, tuple[int, ...]] = {}
    for name, count, itemsize in tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"plan_servers: a tensor needs a non-empty string name, got {name!r}")
        if count < 0 or itemsize < 1:
            raise ValueError(f"plan_servers({name!r}): {count} elements of {itemsize} bytes")
        plan[key_of(name)] = tuple(n * itemsize for _, n in partitions(count, itemsize, partition_bytes))
    return tuple(sorted(plan.items()))


def routed(name: str) -> bool:
    """Whether this process has sent tensor ``name`` (a plan may no longer move it)."""
    return key_of(name) in _sent


def plan_servers(tensors: Iterable[tuple[str, int, int]], partition_bytes: int) -> None:
    """Balance the servers' bytes over ``tensors`` (see :func:`plan_of` and the module docstring);
    a tensor planned before keeps its servers."""
    plan = plan_of(tensors, partition_bytes)
    with _lock:
        moved = sum(key in _sent and key not in _planned for key, _ in plan)
        if moved:
            raise ValueError(f"plan_servers: {moved} of these tensors were pushed already; plan a "
                             "tensor before its first push_pull, on every rank")
        if plan and plan not in _plans:
            _plans.append(plan)
            _planned.update(key for key, _ in plan)
            _by_servers.clear()


def reset() -> None:
    """Forget every plan and every routed key (tests; a process that starts a new job)."""
    with _lock:
        _plans.clear()
        _planned.clear()
        _by_servers.clear()
        _sent.clear()
