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

from .transport.framing import endpoint_host

HOST_REDUCE_MODES = ("auto", "on", "off")  # BPS_GOSSIP_HOST_REDUCE


def host_groups(addrs: Sequence[str], modes: Sequence[str], servers: Sequence[str]) -> list[tuple[int, ...]]:
    """The ranks of each host, each group in rank order and the groups by their leader (lowest
    rank); ``addrs[rank]`` is a worker's gossip endpoint, ``modes[rank]`` its host-reduce mode,
    ``servers`` the servers' endpoints. Every rank is alone unless the job reduces by host
    (module docstring)."""
    alone = [(rank,) for rank in range(len(addrs))]
    if "off" in modes:
        return alone
    by_host: dict[str, list[int]] = {}
    for rank, addr in enumerate(addrs):
        by_host.setdefault(endpoint_host(addr), []).append(rank)
    groups = sorted((tuple(ranks) for ranks in by_host.values()), key=lambda group: group[0])
    if "on" in modes:
        return groups
    shared = {endpoint_host(addrs[group[0]]) for group in groups if len(group) > 1}
    return groups if any(endpoint_host(server) not in shared or len(shared) > 1 for server in servers) \
        and shared else alone


def one_host_job(addrs: Sequence[str], modes: Sequence[str]) -> bool:
    """Whether every worker of the job is on one host and none turned the host reduce off: its
    leader's sums are then push_pull's results and the servers take no uncompressed push
    (bps_gossip.worker.host_link; gossip keeps to ``host_groups``)."""
    return len(addrs) > 1 and "off" not in modes and len({endpoint_host(addr) for addr in addrs}) == 1


def group_of(groups: Sequence[tuple[int, ...]], rank: int) -> tuple[int, ...]:
    """The group that holds ``rank`` (alone if none does)."""
    for group in groups:
        if rank in group:
            return group
    return (rank,)
