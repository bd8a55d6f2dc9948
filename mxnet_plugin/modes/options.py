"""GossipOptions: DistributedTrainer's gossip settings as one validated, frozen value.

Every field is also a keyword of :class:`~mxnet_plugin.DistributedTrainer` (``graph=``,
``average_every=``, ...); the trainer gathers them here, so each is checked once, with an
error that names it. What depends on the job's size (the graph built for n workers, the
degree conditions of ``push_sum=False``) is checked when gossip starts
(``GossipAverager.check_arguments``).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from bps_gossip.gossip.graphs import GRAPHS, Graph


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_flag(name: str, value: object) -> None:
    # 0, 1 and numpy booleans were accepted before: they still are.
    if isinstance(value, (bool, np.bool_, numbers.Integral)) and value in (0, 1):
        return
    raise ValueError(f"gossip option {name}={value!r} must be True or False")


def _check_graph(graph: object) -> None:
    if isinstance(graph, Graph):
        return
    if not isinstance(graph, str) or graph not in GRAPHS:
        raise ValueError(f"gossip option graph={graph!r} must be one of {', '.join(GRAPHS)} or a "
                         "bps_gossip.gossip.graphs.Graph")


@dataclasses.dataclass(frozen=True)
class GossipOptions:
    """How gossip mode mixes the models (see docs/gossip.md).

    ``graph``: a graph name (npdde, dde, bipartite-exp, linear, bipartite-linear, ring)
    or a :class:`bps_gossip.gossip.graphs.Graph`. ``peers_per_itr``: out-peers per round.
    ``push_sum=False``: symmetric push-pull averaging (D-PSGD). ``overlap``: a round's
    messages arrive while the next step computes, at most ``synch_freq`` + 1 rounds open.
    ``average_every=K``: the exact average through the servers every K steps (0: never).
    ``gossip_gamma``: CHOCO's consensus step, used when ``compression_params`` names a
    compressor (None: the compressor's default, see
    :func:`bps_gossip.gossip.choco.default_gamma`). ``route_slow_links``: the ranks measure
    how late each peer's messages come and route push-sum around a slow worker (its edges
    carry a message every few rounds and nobody waits for them; :mod:`bps_gossip.gossip.routing`).
    Invalid values raise ValueError naming the option.
    """

    graph: str | Graph = "npdde"
    peers_per_itr: int = 1
    push_sum: bool = True
    overlap: bool = False
    synch_freq: int = 0
    average_every: int = 0
    gossip_gamma: float | None = None
    route_slow_links: bool = True

    def __post_init__(self) -> None:
        _check_graph(self.graph)
        if not _is_int(self.peers_per_itr) or self.peers_per_itr < 1:
            raise ValueError(f"gossip option peers_per_itr={self.peers_per_itr!r} must be an int >= 1")
        _check_flag("push_sum", self.push_sum)
        _check_flag("overlap", self.overlap)
        _check_flag("route_slow_links", self.route_slow_links)
        for name in ("synch_freq", "average_every"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"gossip option {name}={value!r} must be an int >= 0")
        if self.overlap and not self.push_sum:
            raise ValueError("gossip option overlap=True needs push_sum=True (push-pull cannot keep a round open)")
        gamma = self.gossip_gamma
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, numbers.Real)
                                  or not 0 < gamma <= 1):
            raise ValueError(f"gossip option gossip_gamma={gamma!r} must be in (0, 1] (or None: the compressor's)")
        # Normalized, so that what the averager receives is exactly what it expects.
        for name in ("push_sum", "overlap", "route_slow_links"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("peers_per_itr", "synch_freq", "average_every"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "gossip_gamma", None if gamma is None else float(gamma))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names (each one also a keyword of DistributedTrainer)."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def merge(cls, base: GossipOptions | None, keywords: Mapping[str, Any], where: str = "DistributedTrainer"
              ) -> GossipOptions:
        """``base`` (default: the defaults) with ``keywords`` applied; TypeError naming a
        keyword that is not an option, as Python does for a function."""
        if base is not None and not isinstance(base, cls):
            raise TypeError(f"{where}: gossip_options must be a GossipOptions, got {type(base).__name__}")
        for name in keywords:
            if name not in cls.names():
                raise TypeError(f"{where}() got an unexpected keyword argument {name!r} "
                                f"(gossip options: {', '.join(cls.names())})")
        return dataclasses.replace(base or cls(), **keywords)

    def averager_arguments(self) -> dict[str, Any]:
        """The keywords of ``GossipAverager`` these options set."""
        return {"graph": self.graph, "peers_per_itr": self.peers_per_itr, "push_sum": self.push_sum,
                "overlap": self.overlap, "synch_freq": self.synch_freq, "route_slow_links": self.route_slow_links}
