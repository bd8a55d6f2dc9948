"""Compressed gossip: CHOCO-Gossip (Koloskova, Stich and Jaggi, 2019) with BytePS's compressors.

Compressing push-sum messages would lose mass: what a compressor drops is gone. CHOCO sends
compressed *differences* instead. Every worker keeps public copies x_hat of its own model and
of its neighbours' on a ring (the same copies everywhere, since everyone adds the same
decompressed bytes). Each round worker i sends q_i = C(x_i - x_hat_i) to its neighbours,
everybody adds D(q) to the matching copy, and worker i moves x_i += gamma * w * sum_j
(x_hat_j - x_hat_i) with w = 1 / (neighbours + 1). What compression drops stays in
x_i - x_hat_i and goes out later (error feedback); the ring is symmetric, so the sum of x over
workers is unchanged by every round.

Each buffer is compressed in pieces, as BytePS compresses gradients: every piece the caller
names (a parameter) on its own, split at ``partition_bytes``, pieces under
``min_compress_bytes`` sent as float32. One scale per piece matters: one scale per buffer
would quantize small weights against BatchNorm's running variances, and CHOCO diverges when
compression errs by more than the difference it sends.

``gamma`` is the consensus step: 0.2 by default, 0.05 for randomk and L2 dithering
(:func:`default_gamma`), which carry little of the difference a round. L2 dithering (QSGD)
errs by up to omega = sqrt(n) / s times what it compresses: what it adds to the copies is
scaled by 1 / (1 + omega), a contraction, as CHOCO's paper does for unbiased compressors
(``Codec.variance``). The measurements behind both: docs/compression.md, "Gossip".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..compat import zip_exact
from ..compression import Codec, CompressionSpec, rng_for
from ..futures import wait
from ..protocol.data import partitions
from .averager import GossipAverager
from .link import Link

DEFAULT_GAMMA = 0.2
WEAK_GAMMA = 0.05  # compressors that carry little of the difference a round: randomk, L2-normalized dithering
RAW_ITEMSIZE = 4  # pieces sent uncompressed travel as float32
ALIGN = 8  # every piece's bytes start at a multiple of this in the message (aligned views)


def default_gamma(spec: CompressionSpec) -> float:
    """The consensus step compressed gossip takes with ``spec`` unless told another: smaller
    for compressors that carry little of the difference a round (randomk's random
    coordinates; L2-normalized dithering, scaled down by 1 / (1 + omega)), where a larger
    step pulls each model toward stale public copies."""
    weak = spec.compressor == "randomk" or (spec.compressor == "dithering" and spec.l2)
    return WEAK_GAMMA if weak else DEFAULT_GAMMA


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a buffer, compressed by ``codec`` (None: sent as float32)
    into bytes [offset, offset + nbytes) of the buffer's message array."""

    start: int
    stop: int
    codec: Codec | None
    offset: int

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes if self.codec is not None else RAW_ITEMSIZE * (self.stop - self.start)

    @property
    def scale(self) -> float:
        """What the decompressed difference is multiplied by: 1 / (1 + omega) for a codec whose
        error may exceed the difference (else x_hat would move away from x every round)."""
        omega = self.codec.variance() if self.codec is not None else None
        return 1.0 if omega is None else 1.0 / (1.0 + omega)


def plan_pieces(sizes: Sequence[int], itemsize: int, spec: CompressionSpec, min_compress_bytes: int,
                partition_bytes: int | None) -> list[Piece]:
    """The pieces of one flat buffer made of consecutive parts of ``sizes`` elements: each
    part split at ``partition_bytes`` (None: not split) as push_pull splits a tensor; parts
    under ``min_compress_bytes`` uncompressed; empty parts send nothing."""
    pieces: list[Piece] = []
    start = offset = 0
    for size in sizes:
        compressed = size * itemsize >= min_compress_bytes
        for first, length in partitions(size, itemsize, partition_bytes or max(1, size * itemsize)):
            if length:
                piece = Piece(start + first, start + first + length, spec.codec(length) if compressed else None,
                              offset)
                pieces.append(piece)
                offset = -(-(offset + piece.nbytes) // ALIGN) * ALIGN
        start += size
    return pieces


class ChocoAverager(GossipAverager):
    """Gossip averaging with compressed messages (collective: every rank creates one with the
    same keys, shapes and arguments, and steps it in lockstep). ``start_equal``: every rank
    starts from the same values (after a broadcast), so the public copies start there too;
    otherwise they start at zero, as in CHOCO. ``link``: as for :class:`GossipAverager`.
    ``gamma``: the consensus step (None: :func:`default_gamma`).
    ``parts``: the sizes of the parts each buffer is made of (default: one part), each
    compressed on its own; ``min_compress_bytes`` and ``partition_bytes`` as BytePS's
    BYTEPS_MIN_COMPRESS_BYTES and BYTEPS_PARTITION_BYTES (default: compress every part
    whole)."""

    def __init__(self, buffers: Mapping[str, np.ndarray], spec: CompressionSpec, gamma: float | None = None,
                 tag: str = "choco", start_equal: bool = False, link: Link | None = None,
                 parts: Mapping[str, Sequence[int]] | None = None, min_compress_bytes: int = 0,
                 partition_bytes: int | None = None) -> None:
        gamma = default_gamma(spec) if gamma is None else gamma
        if not 0 < gamma <= 1:
            raise ValueError(f"compressed gossip: gamma={gamma!r} must be in (0, 1]")
        self._start(buffers, link, tag)
        self.spec, self.gamma = spec, gamma
        self.neighbors = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        self.mix = 1.0 / (len(self.neighbors) + 1)
        parts = parts or {}
        self.pieces: dict[str, list[Piece]] = {}
        for key, value in self.x.items():
            sizes = list(parts.get(key, [value.size]))
            if sum(sizes) != value.size or any(size < 0 for size in sizes):
                raise ValueError(f"ChocoAverager: the parts of buffer {key!r} ({sum(sizes)} elements) do not "
                                 f"make up its {value.size}")
            self.pieces[key] = plan_pieces(sizes, value.dtype.itemsize, spec, min_compress_bytes, partition_bytes)
        self.message_bytes = {key: pieces[-1].offset + pieces[-1].nbytes if pieces else 0
                              for key, pieces in self.pieces.items()}
        start = (lambda v: v.astype(np.float32)) if start_equal else (lambda v: np.zeros(v.size, np.float32))
        self.hat = {r: {key: start(value) for key, value in self.x.items()} for r in [self.rank, *self.neighbors]}

    def _compress(self, key: str, first_piece: int, rnd: int) -> np.ndarray:
        """This round's message for buffer ``key``: C(x - x_hat) piece by piece, and x_hat moved
        by what the neighbours will decompress."""
        diff = self.x[key] - self.hat[self.rank][key]
        mine = self.hat[self.rank][key]
        out = np.zeros(self.message_bytes[key], np.uint8)  # padding too: nothing of ours leaks
        for index, piece in enumerate(self.pieces[key], first_piece):
            part = diff[piece.start:piece.stop]
            target = out[piece.offset:piece.offset + piece.nbytes]
            if piece.codec is None:
                target.view(np.float32)[:] = part
            else:
                target[:] = piece.codec.compress(part, rng_for(self.spec.seed, index, rnd, 2 + self.rank))
            mine[piece.start:piece.stop] += self._decompress(piece, target)
        return out

    @staticmethod
    def _decompress(piece: Piece, data: np.ndarray) -> np.ndarray:
        if piece.codec is None:
            return data.view(np.float32)
        value = piece.codec.decompress(data)
        scale = piece.scale
        return value if scale == 1.0 else value * np.float32(scale)

    def _absorb(self, peer: int, key: str, data: Any, rnd: int) -> None:
        """Add a neighbour's message for ``key`` to its public copy (checked: size, finite)."""
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != self.message_bytes[key]:
            raise ValueError(f"compressed gossip {self.tag!r} round {rnd}: rank {peer} sent {data.size} bytes of "
                             f"{data.dtype} for buffer {key!r}; expected {self.message_bytes[key]} bytes")
        copy = self.hat[peer][key]
        for piece in self.pieces[key]:
            value = self._decompress(piece, data[piece.offset:piece.offset + piece.nbytes])
            if not np.isfinite(value).all():
                raise ValueError(f"compressed gossip {self.tag!r} round {rnd}: rank {peer} sent values that are "
                                 f"not finite for buffer {key!r}")
            copy[piece.start:piece.stop] += value

    def _round(self, tracer: Any = None) -> None:
        """One round: send C(x - x_hat) to both ring neighbours, update the copies, mix."""
        rnd, self.rnd = self.rnd, self.rnd + 1
        if not self.neighbors:
            return
        future = self.link.expect(self.tag, rnd, self.neighbors)
        keys = list(self.x)
        payload, first = [], 0
        for key in keys:
            payload.append(self._compress(key, first, rnd))
            first += len(self.pieces[key])
        for peer in self.neighbors:
            self.link.send(peer, {"tag": self.tag, "round": rnd, "keys": keys}, payload)
        received = wait(future, self.link.timeout(), f"compressed gossip {self.tag!r} round {rnd}")
        for peer in self.neighbors:
            header, arrays = received[peer]
            if list(header.get("keys", ())) != keys or len(arrays) != len(keys):
                raise ValueError(f"compressed gossip {self.tag!r} round {rnd}: rank {peer} sent other buffers")
            for key, data in zip_exact(keys, arrays):
                self._absorb(peer, key, data, rnd)
        self.link.consumed(received)
        step = np.float32(self.gamma * self.mix)
        mine = self.hat[self.rank]
        for key, value in self.x.items():
            pull = sum(self.hat[peer][key] for peer in self.neighbors) - len(self.neighbors) * mine[key]
            value += (step * pull).astype(value.dtype)

    def average_exactly(self, measure: bool = False) -> float | None:
        """The exact average through the servers; the public copies restart from it."""
        drift = super().average_exactly(measure)
        for copies in self.hat.values():
            for key, value in self.x.items():
                copies[key] = value.astype(np.float32)
        return drift
