"""Gossip by host: exact averaging among the workers of one host, gossip between hosts.

When the job reduces by host (:mod:`bps_gossip.host_groups`: workers on one host share
/dev/shm and the servers are elsewhere), flat gossip sends a message per worker pair,
and about half of them cross between hosts on the default exponential graph. Here each
round the workers of a host hand their x to the host's leader through shared memory, the
leader averages them exactly and runs one gossip round with the other hosts' leaders (one
message per host pair, on a graph over hosts), and hands the result back. Every worker of
a host then holds the same model, and the average over workers is kept exactly: a host's
mean stands for all its workers, which is why this needs hosts of equal size
(:func:`fits`); elsewhere gossip stays flat.

The leader's round is a plain :class:`GossipAverager` over a :class:`HostsLink`, a link
whose ranks are hosts. Compressed gossip (CHOCO) and rounds left open (``overlap``) stay
flat, as compressed partitions skip the host reduce of push_pull.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import fields
from ..compat import zip_exact
from ..errors import ProtocolError
from ..futures import wait
from .averager import GossipAverager
from .graphs import Graph
from .link import Link, Received


def fits(groups: Sequence[tuple[int, ...]] | None, graph: str | Graph, overlap: bool = False) -> bool:
    """Whether gossip goes by host for these host groups (None or all alone: no host reduce)
    and arguments: some host has several workers, every host as many, a graph given by name
    (an explicit one is for workers, not hosts) and no round left open. The same answer on
    every rank: the groups and arguments are the same. (Every named graph that a job's
    workers can use builds for any number of hosts: checked for 1-8 with 1-3 peers.)"""
    return (bool(groups) and len(groups[0]) > 1 and len({len(g) for g in groups}) == 1
            and isinstance(graph, str) and not overlap)


class HostsLink:
    """A link whose ranks are hosts: host i is its leader ``leaders[i]`` on ``link``. Only
    the leaders' gossip rounds go through it (never the exact collectives)."""

    tracer = None

    def __init__(self, link: Link, leaders: Sequence[int]) -> None:
        self.link, self.leaders = link, list(leaders)
        self.rank, self.size = self.leaders.index(link.rank), len(self.leaders)
        self._host = {leader: host for host, leader in enumerate(self.leaders)}

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        self.link.send(self.leaders[dst], header, arrays)

    def is_local(self, dst: int) -> bool:
        return self.link.is_local(self.leaders[dst])

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        self.link.send_scaled(self.leaders[dst], header, arrays, scale)

    def consumed(self, received: Received) -> None:
        self.link.consumed({self.leaders[host]: value for host, value in received.items()})

    def expect(self, tag: str, rnd: int, sources: list[int]) -> concurrent.futures.Future:
        by_host: concurrent.futures.Future = concurrent.futures.Future()

        def relabel(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                by_host.set_exception(error)
            else:
                by_host.set_result({self._host[leader]: value for leader, value in done.result().items()})

        self.link.expect(tag, rnd, [self.leaders[host] for host in sources]).add_done_callback(relabel)
        return by_host

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        raise RuntimeError("gossip by host: the exact collectives go through every worker, not the hosts' link")

    def gather_rows(self, row: np.ndarray, name: str) -> np.ndarray:
        raise RuntimeError("gossip by host: the exact collectives go through every worker, not the hosts' link")

    def timeout(self) -> float:
        return self.link.timeout()


class HostAverager(GossipAverager):
    """Gossip averaging by host (collective: every rank creates one with the same keys,
    shapes, ``groups`` and arguments, and steps it in lockstep). ``groups``: the ranks of each
    host, its leader first, as :func:`bps_gossip.host_groups.host_groups` gives them (must
    :func:`fits`); ``graph``, ``peers_per_itr``, ``push_sum``: the leaders' gossip, the graph
    built for the number of hosts."""

    def __init__(self, buffers: Mapping[str, np.ndarray], groups: Sequence[tuple[int, ...]], graph: str = "npdde",
                 peers_per_itr: int = 1, push_sum: bool = True, tag: str = "gossip", link: Link | None = None,
                 **ignored: Any) -> None:
        # every rank checks the leaders' graph, so a bad one fails everywhere, not only on the leaders
        self.check_arguments(len(groups), graph, peers_per_itr, push_sum, False, 0)
        if not fits(groups, graph, ignored.get("overlap", False)):
            raise ValueError(f"gossip by host needs hosts of equal size and a graph name; got {list(groups)}")
        self._start(buffers, link, tag)
        self.group = next(group for group in groups if self.rank in group)
        self.leader = self.group[0]
        self.hosts: GossipAverager | None = None
        if self.rank == self.leader:  # its x is ours: the hosts' round mixes it in place
            hosts_link = HostsLink(self.link, [group[0] for group in groups])
            # not routed: its link has no collective over the leaders alone
            self.hosts = GossipAverager(self.x, graph, peers_per_itr, push_sum, tag=f"{tag}.hosts", link=hosts_link,
                                        route_slow_links=False)
            self.hosts.x = self.x

    def _round(self, tracer: Any = None) -> None:
        """Locals -> leader (exact mean), one round between hosts, leader -> locals."""
        rnd, self.rnd = self.rnd, self.rnd + 1
        keys = list(self.x)
        if self.hosts is None:
            self._send(self.leader, "up", rnd, {})
            received = self._receive("down", rnd, [self.leader])
            header, arrays = received[self.leader]
            try:
                weight = fields.number(header, "weight")
                if weight <= 0:
                    raise ProtocolError(f"field 'weight'={weight} must be positive")
            except ProtocolError as exc:
                raise ValueError(f"gossip by host {self.tag!r} round {rnd}: the leader (rank {self.leader}) sent a "
                                 f"bad weight: {exc}") from None
            for key, array in zip_exact(keys, arrays):
                np.copyto(self.x[key], array)
            self.weight = weight
            self.link.consumed(received)
            return
        locals_ = list(self.group[1:])
        received = self._receive("up", rnd, locals_)
        for index, value in enumerate(self.x.values()):
            for rank in locals_:
                value += received[rank][1][index]
            value /= value.dtype.type(len(self.group))
        self.link.consumed(received)
        self.hosts.step()
        self.weight = self.hosts.weight
        for rank in locals_:
            self._send(rank, "down", rnd, {"weight": float(self.weight)})

    def _send(self, dst: int, direction: str, rnd: int, extra: dict[str, Any]) -> None:
        header = {"tag": f"{self.tag}.{direction}", "round": rnd, "keys": list(self.x), **extra}
        arrays = list(self.x.values())
        if self.link.is_local(dst):  # one copy, into shared memory
            self.link.send_scaled(dst, header, arrays, 1.0)
        else:
            self.link.send(dst, header, [array.copy() for array in arrays])

    def _receive(self, direction: str, rnd: int, sources: list[int]) -> Received:
        """Every source's message of this round, checked: the same buffers, sizes and dtypes, finite."""
        what = f"gossip by host {self.tag!r} round {rnd}"
        received = wait(self.link.expect(f"{self.tag}.{direction}", rnd, sources), self.link.timeout(), what)
        for source in sources:
            header, arrays = received[source]
            if list(header.get("keys", ())) != list(self.x) or len(arrays) != len(self.x):
                raise ValueError(f"{what}: rank {source} sent other buffers")
            for (key, mine), array in zip_exact(self.x.items(), arrays):
                array = np.asarray(array)
                if array.dtype != mine.dtype or array.shape != mine.shape:
                    raise ValueError(f"{what}: rank {source} sent {array.dtype} {array.shape} for buffer {key!r}; "
                                     f"expected {mine.dtype} {mine.shape}")
                if not np.isfinite(array).all():
                    raise ValueError(f"{what}: rank {source} sent values that are not finite for buffer {key!r}")
        return received

    def average_exactly(self, measure: bool = False) -> float | None:
        """The exact average through the servers (every worker takes part)."""
        drift = super().average_exactly(measure)
        if self.hosts is not None:
            self.hosts.weight = 1.0
        return drift
