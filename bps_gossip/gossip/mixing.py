"""Mixing weights: how a rank splits its mass between itself and its out-peers."""

from __future__ import annotations

import abc


class Mixing(abc.ABC):
    """Column-stochastic weights: what a rank keeps plus what it sends sums to 1."""

    @abc.abstractmethod
    def weights(self, rank: int, out_peers: list[int]) -> tuple[float, dict[int, float]]:
        """(the weight kept, the weight sent to each out-peer)."""


class UniformMixing(Mixing):
    """Keep 1/(d+1) and send 1/(d+1) to each of the d out-peers."""

    def weights(self, rank: int, out_peers: list[int]) -> tuple[float, dict[int, float]]:
        """Uniform weights over the rank and its out-peers."""
        share = 1.0 / (len(out_peers) + 1)
        return share, {peer: share for peer in out_peers}
