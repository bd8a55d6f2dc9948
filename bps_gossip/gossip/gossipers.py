"""Gossipers: one round of message exchange over the peer channel.

PushSum (SGP): send (p * x, p * w) to each out-peer of the round, keep p, and add what
the in-peers sent. Column-stochastic, so the sums of x and of w over all ranks never
change; z = x / w is the de-biased model. ``begin`` scales x and w down at once (the
sent mass is in flight), ``absorb`` adds the received mass, so a round can stay open
while the next step computes (overlap) without breaking the mass balance.

Peers on the same host get the payload through shared memory (``link.send_scaled``:
one pass writes the scaled share); the receiver reads it in place and acknowledges it
(``link.consumed``). The link (see :mod:`.link`) is passed in: gossipers hold no global state.

PushPull (D-PSGD): send the full x to each neighbour of a symmetric, regular round
and replace x by the uniform average of itself and its neighbours: doubly stochastic,
so no weight is needed; x must not change between ``begin`` and ``absorb``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..compat import zip_exact
from ..futures import wait
from .graphs import Graph, symmetric_mixing_is_doubly_stochastic
from .link import Link
from .mixing import UniformMixing


@dataclasses.dataclass
class PendingRound:
    """A round whose messages were sent and whose receipts may not be in yet."""

    rnd: int
    future: concurrent.futures.Future | None  # the link's expect(); None when the round has no in-peers
    sources: list[int]
    kept: float | None = None  # the share x keeps, when begin() left scaling x to absorb()
    started: float = dataclasses.field(default_factory=time.monotonic)  # when this rank began the round
    delays: dict[int, float] = dataclasses.field(default_factory=dict)  # source -> seconds after ``started``
    transits: dict[int, float] = dataclasses.field(default_factory=dict)  # source -> its transit + clock offset
    waited: float = 0.0  # seconds this rank blocked for the messages

    def arrived(self) -> bool:
        """True when every in-peer's message is in (absorbing will not wait)."""
        return self.future is None or self.future.done()

    def wait(self, tag: str, timeout: float | None) -> Any:
        """The expect() result: {source: (header, arrays)}; notes when each message arrived
        (the link stamps ``arrived``, a monotonic time; else now)."""
        before = time.monotonic()
        received = wait(self.future, timeout, f"gossip {tag!r} round {self.rnd}")
        now = time.monotonic()
        self.waited = now - before
        for src, (header, _) in received.items():
            arrived, transit = header.get("arrived", now), header.get("transit")
            self.delays[src] = arrived - self.started if isinstance(arrived, float) else now - self.started
            if isinstance(transit, float) and math.isfinite(transit):
                self.transits[src] = transit
        return received


def _wire(header: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    return {**header, "keys": keys}


CHUNK = 1 << 16  # elements: a chunk stays in cache from its scaling to its last addition


def scale_and_add(x: np.ndarray, scale: float, addends: list[np.ndarray]) -> None:
    """x <- scale * x + sum(addends), in place, chunk by chunk: one pass over memory instead
    of one per operation (the same operations in the same order: bit-identical results)."""
    factor = x.dtype.type(scale)
    for start in range(0, x.size, CHUNK):
        part = x[start:start + CHUNK]
        part *= factor
        for addend in addends:
            part += addend[start:start + CHUNK]


def mix_model(z: np.ndarray, last: np.ndarray, step_scale: float | None, weight: float, addends: list[np.ndarray],
              total: float) -> None:
    """The model form of push-sum's mix (x = weight * z, z the model's own memory): z <- (x +
    sum(addends)) / total, where x = weight * last + step_scale * (z - last) when the caller
    moved z from ``last`` since (``step_scale`` None: x = weight * z); ``last`` becomes the new
    z. Chunk by chunk: one pass over memory."""
    dtype = z.dtype.type
    inverse, kept = dtype(1.0 / total), dtype(weight)
    moved = None if step_scale is None else dtype(step_scale)
    scratch = np.empty(min(CHUNK, z.size), dtype=z.dtype)
    for start in range(0, z.size, CHUNK):
        part, before = z[start:start + CHUNK], last[start:start + CHUNK]
        if moved is None:
            part *= kept
        else:  # the step (z - last) counts moved times, the rest weight times
            part -= before
            part *= moved
            held = scratch[:part.size]
            np.multiply(before, kept, out=held)
            part += held
        for addend in addends:
            part += addend[start:start + CHUNK]
        part *= inverse
        before[...] = part


def move_model(z: np.ndarray, last: np.ndarray, factor: float) -> None:
    """z <- last + factor * (z - last), and last <- z: the caller's step since ``last`` taken
    ``factor`` times (exactly z when it did not move), chunk by chunk."""
    scale = z.dtype.type(factor)
    for start in range(0, z.size, CHUNK):
        part, before = z[start:start + CHUNK], last[start:start + CHUNK]
        if factor != 1.0:
            part -= before
            part *= scale
            part += before
        before[...] = part


class PushSum:
    """Push-sum over a directed (possibly irregular) graph; see the module docstring."""

    def __init__(self, graph: Graph, link: Link, tag: str, mixing: Any = None, track_weight: bool = True) -> None:
        self.graph = graph
        self.link = link
        self.tag = tag
        self.mixing = mixing or UniformMixing()
        self.track_weight = track_weight

    def begin(self, rnd: int, x: Mapping[str, np.ndarray], weight: float, defer_scaling: bool = False,
              out_peers: Sequence[int] | None = None, sources: Sequence[int] | None = None,
              heavy: Mapping[int, float] | None = None, holds_model: bool = False) -> tuple[PendingRound, float]:
        """Send this round's shares and keep ours: scales ``x`` in place (or, with
        ``defer_scaling``, leaves that to :meth:`absorb`, which must come before x changes);
        returns the kept weight. With ``holds_model`` ``x`` is the model z (the numerators
        are weight * z): the shares sent are share * weight * z, and x is left as it is (the
        kept share is in the returned weight alone). ``out_peers`` and ``sources`` (the in-peers to wait for)
        default to the graph's for the round; ``heavy`` (out-peer -> factor) multiplies those
        out-peers' shares before the weights are normalized again (still column-stochastic)."""
        rank = self.link.rank
        out_peers = self.graph.out_peers(rank, rnd) if out_peers is None else list(out_peers)
        sources = self.graph.in_peers(rank, rnd) if sources is None else list(sources)
        future = self.link.expect(self.tag, rnd, sources) if sources else None
        kept, shares = self.mixing.weights(rank, out_peers)
        if heavy:
            shares = {peer: share * heavy.get(peer, 1.0) for peer, share in shares.items()}
            total = kept + sum(shares.values())
            kept, shares = kept / total, {peer: share / total for peer, share in shares.items()}
        keys = list(x)
        if holds_model and not self.track_weight:
            raise ValueError("gossip: the model form of push-sum needs the weights to travel")
        cache: dict[float, list[np.ndarray]] = {}
        for peer, share in shares.items():
            header = _wire({"tag": self.tag, "round": rnd, "weight": share * weight if self.track_weight else None},
                           keys)
            factor = share * weight if holds_model else share
            if self.link.is_local(peer):  # the share is written straight into shared memory
                self.link.send_scaled(peer, header, [x[k] for k in keys], factor)
                continue
            arrays = cache.get(factor)
            if arrays is None:  # uniform mixing: one scaled copy serves every peer
                arrays = cache[factor] = [x[k] * x[k].dtype.type(factor) for k in keys]
            self.link.send(peer, header, arrays)
        pending = PendingRound(rnd, future, sources, kept if defer_scaling and not holds_model else None)
        if not defer_scaling and not holds_model:
            for key in keys:
                x[key] *= x[key].dtype.type(kept)
        # Untracked (regular graph, closed at once): kept + received weights sum to 1 exactly.
        return pending, kept * weight if self.track_weight else weight

    def absorb(self, pending: PendingRound, x: Mapping[str, np.ndarray], weight: float,
               timeout: float | None = None) -> float:
        """Wait for the round's messages and add them to ``x`` (scaling x first if begin left
        that here); returns the new weight."""
        received, addends, got = self.collect(pending, x, timeout)
        weight += got
        for key, value in x.items():
            if pending.kept is not None:
                scale_and_add(value, pending.kept, addends[key])
            else:
                for array in addends[key]:
                    value += array
        if received:
            self.link.consumed(received)
        return weight

    def collect(self, pending: PendingRound, keys: Mapping[str, Any], timeout: float | None = None
                ) -> tuple[dict[int, Any], dict[str, list[np.ndarray]], float]:
        """Wait for the round's messages: (what expect() gave, the received arrays by key, the
        sum of the received weights, 0 when they do not travel). Hand the first to the link's
        ``consumed`` once the arrays are read."""
        received = pending.wait(self.tag, timeout) if pending.future is not None else {}
        addends: dict[str, list[np.ndarray]] = {key: [] for key in keys}
        weight = 0.0
        for src in pending.sources:
            header, arrays = received[src]
            for key, array in zip_exact(header["keys"], arrays):
                addends[key].append(array)
            if self.track_weight:
                if header.get("weight") is None:
                    raise ValueError(f"gossip {self.tag!r} round {pending.rnd}: rank {src} sent no push-sum weight")
                weight += float(header["weight"])
        return received, addends, weight


class PushPull:
    """Symmetric averaging with the neighbours of each round (D-PSGD); see the module docstring."""

    def __init__(self, graph: Graph, link: Link, tag: str) -> None:
        if not symmetric_mixing_is_doubly_stochastic(graph):
            raise ValueError(f"push_sum=False needs neighbours of equal degree (doubly stochastic mixing); "
                             f"{graph.name!r} does not have them: use push_sum=True")
        self.graph = graph
        self.link = link
        self.tag = tag

    def begin(self, rnd: int, x: Mapping[str, np.ndarray], weight: float,
              defer_scaling: bool = False) -> tuple[PendingRound, float]:
        """Send x to every neighbour of the round (x is scaled in :meth:`absorb` either way)."""
        neighbours = self.graph.symmetric_peers(self.link.rank, rnd)
        future = self.link.expect(self.tag, rnd, neighbours) if neighbours else None
        keys = list(x)
        header = _wire({"tag": self.tag, "round": rnd, "weight": None}, keys)
        arrays = None
        for peer in neighbours:
            if self.link.is_local(peer):
                self.link.send_scaled(peer, header, [x[k] for k in keys], 1.0)
                continue
            if arrays is None:  # x is rewritten by absorb while the send may be in flight
                arrays = [x[k].copy() for k in keys]
            self.link.send(peer, header, arrays)
        return PendingRound(rnd, future, neighbours), weight

    def absorb(self, pending: PendingRound, x: Mapping[str, np.ndarray], weight: float,
               timeout: float | None = None) -> float:
        """Average x with what the neighbours sent."""
        if pending.future is None:
            return weight
        received = pending.wait(self.tag, timeout)
        scale = 1.0 / (len(pending.sources) + 1)
        for src in pending.sources:
            header, arrays = received[src]
            for key, array in zip_exact(header["keys"], arrays):
                x[key] += array
        self.link.consumed(received)
        for key in x:
            x[key] *= x[key].dtype.type(scale)
        return weight
