"""Compressed gossip: CHOCO-Gossip (Koloskova, Stich and Jaggi, 2019) with BytePS's compressors.

Compressing push-sum messages would lose mass: what a compressor drops is gone. CHOCO
sends compressed *differences* instead. Every worker keeps public copies x_hat of its
own model and of its neighbours' on a ring (the same copies on every worker that keeps
them, since everyone adds the same decompressed bytes). Each round worker i sends
q_i = C(x_i - x_hat_i) to its neighbours, everybody adds D(q) to the matching copy, and
worker i moves x_i += gamma * w * sum_j (x_hat_j - x_hat_i) with w = 1 / (neighbours + 1).
What compression drops stays in x_i - x_hat_i and goes out later (CHOCO's error
feedback), and the sum over workers of x is unchanged by every round: the ring is
symmetric, so every difference is added once and subtracted once.

``gamma`` is the consensus step: 1 mixes like plain gossip when nothing is dropped; with
compression a smaller step keeps consensus stable (measured on a ring of 3 with topk 10%:
0.4 stalls at a distance of 0.05, 0.2 and below reach exact consensus; the default is 0.2).
onebit's one scale per buffer leaves a small floor on the consensus distance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..compat import zip_exact
from ..compression import CompressionSpec, rng_for
from ..futures import wait
from .averager import GossipAverager
from .link import Link, default_link


class ChocoAverager(GossipAverager):
    """Gossip averaging with compressed messages (collective: every rank creates one with the
    same keys, shapes and arguments, and steps it in lockstep). ``start_equal``: every rank
    starts from the same values (after a broadcast), so the public copies start there too;
    otherwise they start at zero, as in CHOCO. ``link``: as for :class:`GossipAverager`."""

    def __init__(self, buffers: Mapping[str, np.ndarray], spec: CompressionSpec, gamma: float = 0.2,
                 tag: str = "choco", start_equal: bool = False, link: Link | None = None) -> None:
        if not 0 < gamma <= 1:
            raise ValueError(f"compressed gossip: gamma={gamma!r} must be in (0, 1]")
        self.link = default_link() if link is None else link
        self.rank, self.size = self.link.rank, self.link.size
        self.x = {key: np.array(value, copy=True).reshape(-1) for key, value in buffers.items()}
        for key, value in self.x.items():
            if value.dtype.kind != "f":
                raise TypeError(f"ChocoAverager: buffer {key!r} is {value.dtype}; gossip averages floating point only")
        self.weight, self.rnd, self.tag = 1.0, 0, tag
        self.overlap, self.synch_freq, self.open = False, 0, []
        self.spec, self.gamma = spec, gamma
        self.neighbors = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        self.mix = 1.0 / (len(self.neighbors) + 1)
        self.codecs = {key: spec.codec(value.size) for key, value in self.x.items()}
        start = (lambda v: v.astype(np.float32)) if start_equal else (lambda v: np.zeros(v.size, np.float32))
        self.hat = {r: {key: start(value) for key, value in self.x.items()} for r in [self.rank, *self.neighbors]}

    def _round(self, tracer: Any = None) -> None:
        """One round: send C(x - x_hat) to both ring neighbours, update the copies, mix."""
        rnd, self.rnd = self.rnd, self.rnd + 1
        if not self.neighbors:
            return
        future = self.link.expect(self.tag, rnd, self.neighbors)
        keys = list(self.x)
        mine = self.hat[self.rank]
        payload = []
        for index, key in enumerate(keys):
            codec = self.codecs[key]
            data = codec.compress(self.x[key] - mine[key], rng_for(self.spec.seed, index, rnd, 2 + self.rank))
            mine[key] += codec.decompress(data)
            payload.append(data)
        for peer in self.neighbors:
            self.link.send(peer, {"tag": self.tag, "round": rnd, "keys": keys}, payload)
        received = wait(future, self.link.timeout(), f"compressed gossip {self.tag!r} round {rnd}")
        for peer in self.neighbors:
            header, arrays = received[peer]
            if list(header.get("keys", ())) != keys or len(arrays) != len(keys):
                raise ValueError(f"compressed gossip {self.tag!r} round {rnd}: rank {peer} sent other buffers")
            for key, data in zip_exact(keys, arrays):
                self.hat[peer][key] += self.codecs[key].decompress(np.asarray(data, dtype=np.uint8))
        self.link.consumed(received)
        step = np.float32(self.gamma * self.mix)
        for key, value in self.x.items():
            pull = sum(self.hat[peer][key] for peer in self.neighbors) - len(self.neighbors) * mine[key]
            value += (step * pull).astype(value.dtype)

    def average_exactly(self) -> None:
        """The exact average through the servers; the public copies restart from it."""
        super().average_exactly()
        for copies in self.hat.values():
            for key, value in self.x.items():
                copies[key] = value.astype(np.float32)
