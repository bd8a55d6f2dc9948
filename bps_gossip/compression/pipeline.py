"""Where compression runs, as in BytePS: per partition, on workers and on the server.

Worker, for each partition of a large enough float tensor: Nesterov momentum
(``m = mu*m + g; g = g + mu*m``), then error feedback (``p = g + e; c = C(p);
e = p - D(c)``), then the compressor. Server: decompress every push, sum, error feedback
on the sum when enabled, compress the merged result once; every worker gets the same
bytes and decompresses them. So each rank sees ``D(C_s(EF_s(sum_i D(C_i(EF_i(mom_i(g_i)))))))``.
MXNet's quantizers (thresholds.py) keep error feedback on the worker and none on the server,
which sends the float32 sum: ``sum_i D(C_i(EF_i(g_i)))``, as MXNet's dist_sync does.

Error feedback here has no learning-rate correction (BytePS rescales the error by the
ratio of the last two learning rates, read from a file): with a constant learning rate
the two are the same.

Random draws (randomk, dithering) use ``default_rng([seed, partition, round, role])``:
with a seed every worker draws the same sequence as BytePS's seeded workers do (role 0)
and the server its own (role 1); without one, fresh entropy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import fields
from ..errors import ProtocolError
from .codecs import CODECS, MAX_NAME_CHARS, Codec

MAX_HEADER_FIELDS = 16  # a codec header's entries (workers send 8)
MAX_PARTITION_ELEMENTS = 1 << 26  # what a server decompresses one push into: at most 256 MiB


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """A validated compression setting (BytePS's compression_params)."""

    compressor: str
    k: float = 1.0  # topk, randomk: elements kept (below 1: a fraction); dithering: levels
    scaling: bool = False  # onebit
    ef: bool = False  # vanilla error feedback
    momentum: float | None = None  # Nesterov momentum mu, applied before compression
    seed: int | None = None
    natural: bool = False  # dithering partition: linear or natural
    l2: bool = False  # dithering normalize: max or l2
    threshold: float | None = None  # MXNet's 2bit and 1bit (thresholds.py); None: MXNet's default

    def __post_init__(self) -> None:
        if self.compressor not in CODECS:
            raise ValueError(f"compressor {self.compressor!r} is not one of {', '.join(CODECS)}")
        if isinstance(self.k, bool) or not isinstance(self.k, (int, float)) or not self.k > 0 \
                or not np.isfinite(self.k):
            raise ValueError(f"k={self.k!r} must be a positive number")
        if self.threshold is not None and not CODECS[self.compressor].mxnet_type:
            raise ValueError(f"{self.compressor}: takes no threshold (threshold={self.threshold!r})")
        CODECS[self.compressor].check_spec(self)
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"momentum mu={self.momentum!r} must be in [0, 1)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer")

    def compresses(self, nbytes: int, min_compress_bytes: int) -> bool:
        """Whether a float tensor of ``nbytes`` is compressed: from BYTEPS_MIN_COMPRESS_BYTES up, as
        in BytePS, or at any size for a codec that says so (MXNet's quantizers)."""
        return nbytes >= min_compress_bytes or CODECS[self.compressor].any_size

    def count(self, n: int) -> int:
        """topk/randomk: the elements kept of a partition of ``n``."""
        kept = int(self.k * n) if self.k < 1 else int(self.k)
        return max(1, min(kept, n))

    def codec(self, n: int) -> Codec:
        """The codec of one partition of ``n`` elements."""
        return CODECS[self.compressor].from_spec(self, n)

    def header(self, n: int) -> dict[str, Any]:
        """What a push tells the server about its partition's compression: the codec's own
        fields over the settings every header has carried since the first wire format
        (k=0 and the spec's flags, in this key order), then ``ef`` and ``seed``."""
        header = {"name": self.compressor, "n": n, "k": 0, "scaling": self.scaling, "ef": self.ef, "seed": self.seed,
                  "natural": self.natural, "l2": self.l2}
        header.update(self.codec(n).header_fields())  # keeps the order of the keys it overwrites
        return header

    def describe(self) -> str:
        """Text for signatures and errors: ranks must agree on it."""
        parts = [self.compressor] if CODECS[self.compressor].mxnet_type else [self.compressor, f"k={self.k:g}"]
        parts += [name for name, on in (("scaling", self.scaling), ("ef", self.ef), ("natural", self.natural),
                                        ("l2", self.l2)) if on]
        if self.momentum is not None:
            parts.append(f"nesterov={self.momentum:g}")
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        if self.threshold is not None:
            parts.append(f"threshold={self.threshold!r}")
        return " ".join(parts)


def rng_for(seed: int | None, part: int, rnd: int, role: int) -> np.random.Generator:
    """The generator of one partition's round (see the module docstring)."""
    return np.random.default_rng(None if seed is None else [seed, part, rnd, role])


@dataclasses.dataclass
class PartitionState:
    """A worker's (or a server's) memory for one partition: momentum and error."""

    momentum: np.ndarray | None = None
    error: np.ndarray | None = None


def compress_on_worker(spec: CompressionSpec, codec: Codec, grad: np.ndarray, state: PartitionState,
                       rng: np.random.Generator) -> np.ndarray:
    """Momentum, error feedback and compression of one partition; returns the bytes to push."""
    g = np.asarray(grad, dtype=np.float32).copy()
    if spec.momentum is not None:
        if state.momentum is None:
            state.momentum = np.zeros_like(g)
        state.momentum *= np.float32(spec.momentum)
        state.momentum += g
        g += np.float32(spec.momentum) * state.momentum
    # MXNet's residual is this error feedback (thresholds.py): on whatever ``ef`` says.
    return _with_feedback(spec.ef or codec.keeps_residual, codec, g, state, rng)


def merge_on_server(ef: bool, codec: Codec, total: np.ndarray, state: PartitionState,
                    rng: np.random.Generator) -> np.ndarray:
    """Error feedback (if on) and compression of a round's float32 sum, which it may change
    (the round is over); returns the bytes every worker gets: for a codec that ``pulls_sum``,
    the float32 sum itself (MXNet's servers compress nothing they send)."""
    if codec.pulls_sum:
        return np.ascontiguousarray(total, dtype=np.float32).view(np.uint8)
    return _with_feedback(ef, codec, total, state, rng)


def _with_feedback(ef: bool, codec: Codec, p: np.ndarray, state: PartitionState,
                   rng: np.random.Generator) -> np.ndarray:
    if not ef:
        return codec.compress(p, rng)
    if state.error is not None:
        p += state.error
    data, decoded = codec.roundtrip(p, rng)
    state.error = p - decoded
    return data


def codec_from_header(msg: Mapping[str, Any], count: int) -> tuple[Codec, bool, int | None]:
    """The server's view of a push's ``codec`` field (untrusted): (codec, ef, seed).

    ``count`` is the push's payload size in bytes, which must be the codec's.
    """
    spec = msg.get("codec")
    if not isinstance(spec, dict):
        raise ProtocolError("field 'codec' must be a map")
    name = fields.text(spec, "name", MAX_NAME_CHARS)
    if name not in CODECS:
        raise ProtocolError(f"unknown compressor {name!r}")
    n = fields.integer(spec, "n", 1, MAX_PARTITION_ELEMENTS)
    seed = fields.optional_integer(spec, "seed", 0, fields.MAX_INT)
    ef = fields.flag(spec, "ef")
    if len(spec) > MAX_HEADER_FIELDS:
        raise ProtocolError(f"field 'codec' has {len(spec)} entries, more than {MAX_HEADER_FIELDS}")
    try:
        for flag in ("scaling", "natural", "l2"):  # every worker sends them all; a codec reads its own
            fields.flag(spec, flag)
        codec = CODECS[name].from_header(spec, n)
    except ProtocolError as exc:
        raise ProtocolError(f"{name}: {exc}") from None
    if codec.nbytes != count:
        raise ProtocolError(f"{name} of {n} elements takes {codec.nbytes} bytes, the push has {count}")
    return codec, ef, seed
