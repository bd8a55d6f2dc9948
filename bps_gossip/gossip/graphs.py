"""Gossip topologies: who sends to whom at round t, the same schedule on every rank.

Every named graph is circulant at each round (a rank's peers are fixed offsets from
it, modulo the world size), so in- and out-degrees are equal everywhere: regular.
Phone books never hold duplicates or the rank itself (SGP's hold duplicates for small
worlds), and the number of phases of the exponential graphs is computed with integers
(SGP's float logarithm is off by one when n is an exact power of k + 1, e.g. 3^5).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence


def _check(world_size: int, peers_per_itr: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"graph: world_size={world_size!r} must be an int >= 1")
    if isinstance(peers_per_itr, bool) or not isinstance(peers_per_itr, int) or peers_per_itr < 1:
        raise ValueError(f"graph: peers_per_itr={peers_per_itr!r} must be an int >= 1")


def exponential_phases(world_size: int, base: int) -> int:
    """The smallest m with base**m >= world_size (0 for one worker), in integers."""
    phases, reach = 0, 1
    while reach < world_size:
        reach *= base
        phases += 1
    return phases


class Graph(abc.ABC):
    """A per-round directed graph over ranks 0..world_size-1."""

    name = "graph"

    def __init__(self, world_size: int, peers_per_itr: int = 1) -> None:
        _check(world_size, peers_per_itr)
        self.world_size = world_size
        self.peers_per_itr = peers_per_itr

    @abc.abstractmethod
    def out_peers(self, rank: int, rnd: int) -> list[int]:
        """The ranks ``rank`` sends to at round ``rnd`` (sorted, no duplicates, not itself)."""

    def in_peers(self, rank: int, rnd: int) -> list[int]:
        """The ranks that send to ``rank`` at round ``rnd``."""
        return [src for src in range(self.world_size) if rank in self.out_peers(src, rnd)]

    def symmetric_peers(self, rank: int, rnd: int) -> list[int]:
        """In- and out-peers together: the neighbourhood used by push-pull averaging."""
        return sorted(set(self.out_peers(rank, rnd)) | set(self.in_peers(rank, rnd)))

    @property
    def period(self) -> int:
        """Rounds after which the schedule repeats."""
        return 1

    @property
    def is_dynamic(self) -> bool:
        """True when the peers change from round to round."""
        return self.period > 1

    @property
    def is_regular(self) -> bool:
        """True when every rank has the same in- and out-degree at every round."""
        for rnd in range(self.period):
            degrees = {(len(self.out_peers(r, rnd)), len(self.in_peers(r, rnd))) for r in range(self.world_size)}
            if len(degrees) > 1 or any(out != inn for out, inn in degrees):
                return False
        return True

    @property
    def is_bipartite(self) -> bool:
        """True when every edge joins an even rank and an odd rank."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, peers_per_itr={self.peers_per_itr})"


class CirculantGraph(Graph):
    """A graph whose round-t peers are rank + offset (mod n) for a per-round offset list."""

    def offsets(self, rnd: int) -> list[int]:
        """The offsets used at round ``rnd``."""
        raise NotImplementedError

    def out_peers(self, rank: int, rnd: int) -> list[int]:
        """rank + each offset, mod n, without 0 or duplicates."""
        n = self.world_size
        return sorted({(rank + o) % n for o in self.offsets(rnd) if o % n})

    def in_peers(self, rank: int, rnd: int) -> list[int]:
        """rank - each offset, mod n."""
        n = self.world_size
        return sorted({(rank - o) % n for o in self.offsets(rnd) if o % n})

    @property
    def is_regular(self) -> bool:
        """Circulant graphs are always regular."""
        return True


class NPeerDynamicDirectedExponential(CirculantGraph):
    """npdde: at phase i = t mod m, send to rank + j * (k+1)**i for j = 1..k. With
    n = (k+1)**m and uniform mixing, m rounds give the exact average."""

    name = "npdde"

    def __init__(self, world_size: int, peers_per_itr: int = 1) -> None:
        super().__init__(world_size, peers_per_itr)
        self.base = peers_per_itr + 1
        self.phases = exponential_phases(world_size, self.base)

    def offsets(self, rnd: int) -> list[int]:
        """The k offsets of this round's phase."""
        if self.phases == 0:
            return []
        step = self.base ** (rnd % self.phases)
        return [j * step for j in range(1, self.base)]

    @property
    def period(self) -> int:
        """One round per phase."""
        return max(1, self.phases)


class DynamicDirectedExponential(NPeerDynamicDirectedExponential):
    """dde: npdde with one peer per round (rank + 2**i); peers_per_itr must be 1."""

    name = "dde"

    def __init__(self, world_size: int, peers_per_itr: int = 1) -> None:
        if peers_per_itr != 1:
            raise ValueError(f"graph 'dde' has one peer per round (peers_per_itr={peers_per_itr}); use 'npdde'")
        super().__init__(world_size, 1)


class Ring(CirculantGraph):
    """ring: static, send to rank + 1 .. rank + k."""

    name = "ring"

    def offsets(self, rnd: int) -> list[int]:
        """The same k offsets every round."""
        return list(range(1, self.peers_per_itr + 1))


class DirectedLinear(CirculantGraph):
    """linear: cycle through every offset 1..n-1, k consecutive ones per round."""

    name = "linear"

    def offsets(self, rnd: int) -> list[int]:
        """k consecutive offsets of the cycle 1..n-1."""
        n = self.world_size
        if n == 1:
            return []
        return [1 + (rnd * self.peers_per_itr + j) % (n - 1) for j in range(self.peers_per_itr)]

    @property
    def period(self) -> int:
        """The cycle of offsets, in rounds."""
        n = self.world_size
        if n <= 2:
            return 1
        k = self.peers_per_itr
        period = 1
        while (period * k) % (n - 1):
            period += 1
        return period


class Bipartite(Graph):
    """A perfect matching per round between 'even' and 'odd' positions at an odd offset:
    position p pairs with p + o if p is even, p - o if p is odd (symmetric: out == in).

    With an odd world size one rank sits out each round (rank t mod n), and the others
    are matched the same way by their cyclic order after it, so everybody still mixes.
    """

    def odd_offsets(self, count: int) -> list[int]:
        """The odd offsets below ``count`` used in turn."""
        raise NotImplementedError

    def _layout(self, rnd: int) -> tuple[list[int], int | None]:
        n = self.world_size
        if n % 2 == 0:
            return list(range(n)), None
        idle = rnd % n
        return [(idle + 1 + i) % n for i in range(n - 1)], idle

    def out_peers(self, rank: int, rnd: int) -> list[int]:
        """The round's partner (none for the idle rank or a world of one)."""
        order, idle = self._layout(rnd)
        count = len(order)
        if count < 2 or rank == idle:
            return []
        offsets = self.odd_offsets(count)
        offset = offsets[rnd % len(offsets)]
        position = order.index(rank)
        partner = (position + offset) % count if position % 2 == 0 else (position - offset) % count
        return [order[partner]]

    def in_peers(self, rank: int, rnd: int) -> list[int]:
        """Symmetric: the same partner."""
        return self.out_peers(rank, rnd)

    @property
    def period(self) -> int:
        """Offsets times (odd n) the idle rotation."""
        n = self.world_size
        count = n if n % 2 == 0 else n - 1
        offsets = len(self.odd_offsets(count)) if count >= 2 else 1
        return offsets * n if n % 2 else offsets

    @property
    def is_bipartite(self) -> bool:
        """Even ranks meet odd ranks only (exactly so when n is even)."""
        return self.world_size % 2 == 0 and self.world_size > 1


class BipartiteExponential(Bipartite):
    """bipartite-exp: offsets 1, 3, 7, 15, ... (2**i - 1)."""

    name = "bipartite-exp"

    def odd_offsets(self, count: int) -> list[int]:
        """2**i - 1 below ``count``."""
        offsets, i = [], 1
        while 2**i - 1 < count:
            offsets.append(2**i - 1)
            i += 1
        return offsets or [1]


class BipartiteLinear(Bipartite):
    """bipartite-linear: offsets 1, 3, 5, ... below n."""

    name = "bipartite-linear"

    def odd_offsets(self, count: int) -> list[int]:
        """Every odd number below ``count``."""
        return list(range(1, count, 2)) or [1]


class ExplicitGraph(Graph):
    """A schedule given round by round: ``schedule[t % len(schedule)][rank]`` lists the
    out-peers (for tests and irregular topologies)."""

    name = "explicit"

    def __init__(self, world_size: int, schedule: Sequence[dict[int, list[int]]]) -> None:
        super().__init__(world_size, 1)
        if not schedule:
            raise ValueError("ExplicitGraph: the schedule needs at least one round")
        self.schedule = [{int(r): sorted(set(p) - {int(r)}) for r, p in rnd.items()} for rnd in schedule]
        for rnd in self.schedule:
            for rank, peers in rnd.items():
                if not 0 <= rank < world_size or any(not 0 <= p < world_size for p in peers):
                    raise ValueError(f"ExplicitGraph: rank {rank} -> {peers} is outside 0..{world_size - 1}")

    def out_peers(self, rank: int, rnd: int) -> list[int]:
        """As given."""
        return list(self.schedule[rnd % len(self.schedule)].get(rank, []))

    @property
    def period(self) -> int:
        """The schedule's length."""
        return len(self.schedule)


GRAPHS: dict[str, type[Graph]] = {
    cls.name: cls
    for cls in (NPeerDynamicDirectedExponential, DynamicDirectedExponential, BipartiteExponential,
                DirectedLinear, BipartiteLinear, Ring)
}


def make_graph(name: str, world_size: int, peers_per_itr: int = 1) -> Graph:
    """Build a named graph; ValueError for an unknown name (listing the known ones)."""
    cls = GRAPHS.get(name)
    if cls is None:
        raise ValueError(f"unknown gossip graph {name!r}; choose one of {', '.join(GRAPHS)}")
    if cls in (BipartiteExponential, BipartiteLinear) and peers_per_itr != 1:
        raise ValueError(f"graph {name!r} pairs ranks one to one; peers_per_itr={peers_per_itr} must be 1")
    return cls(world_size, peers_per_itr)


def symmetric_mixing_is_doubly_stochastic(graph: Graph) -> bool:
    """True when averaging uniformly over each rank's symmetric neighbourhood keeps the
    average (neighbours always have equal degrees, so the weight matrix is symmetric)."""
    for rnd in range(graph.period):
        degree = [len(graph.symmetric_peers(r, rnd)) for r in range(graph.world_size)]
        for rank in range(graph.world_size):
            if any(degree[peer] != degree[rank] for peer in graph.symmetric_peers(rank, rnd)):
                return False
    return True
