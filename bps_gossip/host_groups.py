"""Which workers reduce together before the servers: one push per host.

Workers on one host (the same address in their gossip endpoints, so they share /dev/shm)
sum their partitions through shared memory first; the host's leader, its lowest rank,
pushes that sum to the servers and hands the result back (bps_gossip.worker.host_reduce).
The server's link then carries one copy per host instead of one per worker (BytePS's local
reduce, Horovod's hierarchical allreduce).

Servers and workers compute the groups from the same address book, so they always agree.
Each worker registers its BPS_GOSSIP_HOST_REDUCE ("off" where shared memory is unusable):
with any worker "off", nobody reduces by host; with any "on", the job does; all "auto" (the
default), it does when some server runs on another host than a group of workers.
For push_pull, a job whose workers all share one host is one group too (``one_host_job``): its
leader's sums are the results, with no server's hop; gossip keeps to ``host_groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .transport.framing import endpoint_host

if TYPE_CHECKING:
    from .protocol.control import BookEntry

HOST_REDUCE_MODES = ("auto", "on", "off")  # BPS_GOSSIP_HOST_REDUCE


def same_host(a: BookEntry, b: BookEntry) -> bool:
    """Whether two workers of an address book run on one machine (their gossip endpoints' host)."""
    return endpoint_host(a.addr) == endpoint_host(b.addr)


def host_groups(workers: Sequence[BookEntry], servers: Sequence[str]) -> list[tuple[int, ...]]:
    """The ranks of each host, each group in rank order and the groups by their leader (lowest
    rank); ``workers`` are the address book's entries in rank order (their gossip endpoints and
    host-reduce modes), ``servers`` the servers' endpoints. Every rank is alone unless the job
    reduces by host (module docstring). Gossip goes by these groups."""
    modes = [worker.host_reduce for worker in workers]
    alone = [(rank,) for rank in range(len(workers))]
    if "off" in modes:
        return alone
    by_host: dict[str, list[int]] = {}
    for rank, worker in enumerate(workers):
        by_host.setdefault(endpoint_host(worker.addr), []).append(rank)
    groups = sorted((tuple(ranks) for ranks in by_host.values()), key=lambda group: group[0])
    if "on" in modes:
        return groups
    shared = {endpoint_host(workers[group[0]].addr) for group in groups if len(group) > 1}
    return groups if any(endpoint_host(server) not in shared or len(shared) > 1 for server in servers) \
        and shared else alone


def one_host_job(workers: Sequence[BookEntry]) -> bool:
    """Whether every worker of the job is on one host and none turned the host reduce off: its
    leader's sums are then push_pull's results and the servers take no uncompressed push
    (bps_gossip.worker.host_reduce; gossip keeps to ``host_groups``)."""
    return len(workers) > 1 and all(worker.host_reduce != "off" for worker in workers) \
        and len({endpoint_host(worker.addr) for worker in workers}) == 1


def push_pull_groups(workers: Sequence[BookEntry], servers: Sequence[str]) -> list[tuple[int, ...]]:
    """The groups push_pull reduces by: the whole job where one host holds it, else ``host_groups``."""
    return [tuple(range(len(workers)))] if one_host_job(workers) else host_groups(workers, servers)


def group_of(groups: Sequence[tuple[int, ...]], rank: int) -> tuple[int, ...]:
    """The group that holds ``rank`` (alone if none does)."""
    for group in groups:
        if rank in group:
            return group
    return (rank,)
