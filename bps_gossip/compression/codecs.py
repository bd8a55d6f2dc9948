"""The four gradient compressors of BytePS, as numpy: onebit, topk, randomk, dithering.

Each codec works on one partition of ``n`` elements (computed in float32) and has a fixed
compressed size, so a server's merged result has the byte length of every push of its round.
The math follows BytePS (byteps/common/compressor/impl); the byte layouts are ours:

- onebit: float32 scale (the mean |x| with ``scaling``, else 1), then the sign bits (1 =
  negative), packed; decompression gives -scale or +scale (zero decodes as +scale).
- topk: the k elements of largest magnitude (ties: the earlier index), as int32 indices then
  float32 values; decompression scatters them into zeros.
- randomk: k indices drawn uniformly with replacement, values not rescaled; same layout.
- dithering: float32 norm (max |x|, or L2), then one signed level per element (int8, or wider).
  Linear: levels 0..s, value = level * norm / s. Natural: 0 and powers of two up to
  L = 2^(s-1), value = level * norm / L. Rounding between levels is stochastic and unbiased.

Random draws come from numpy's PCG64 seeded by the caller (pipeline.py), not BytePS's
xorshift128+: the same distributions, another generator.

A codec is one class: its math, how it is built from a CompressionSpec (``check_spec``,
``from_spec``), what it writes into a push's header (``header_fields``) and how the server
rebuilds it from that untrusted header (``from_header``). ``CODECS`` maps each name to its
class; nothing else knows the names (docs/compression.md, "Adding a compressor").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from .. import fields

if TYPE_CHECKING:  # pipeline.py imports this module
    from .pipeline import CompressionSpec

MAX_LEVELS_BITS = 30  # dithering: s (linear) or 2^(s-1) (natural) levels must fit int32
MAX_NAME_CHARS = 16  # what a server reads of a header's codec name


class Codec:
    """Compresses and decompresses partitions of ``n`` float elements.

    A subclass sets ``name`` and ``needs_k`` and implements ``nbytes``, ``compress``,
    ``decompress``, ``from_spec``, and, when it has settings, ``check_spec``,
    ``header_fields`` and ``from_header``; then one entry in ``CODECS`` (or
    :func:`register_codec`) makes it usable everywhere.
    """

    name: ClassVar[str] = ""
    needs_k: ClassVar[bool] = False  # the user must give k (mxnet_plugin's compression_params)
    # MXNet's quantizers (thresholds.py) differ from BytePS's compressors in three ways:
    keeps_residual: ClassVar[bool] = False  # workers always run error feedback (the quantizer's residual)
    pulls_sum: ClassVar[bool] = False  # the server sends the float32 sum, not the sum compressed again
    any_size: ClassVar[bool] = False  # compresses float tensors below BYTEPS_MIN_COMPRESS_BYTES too
    mxnet_type: ClassVar[str] = ""  # the `type` of MXNet's compression_params that selects it, if any

    def __init__(self, n: int) -> None:
        self.n = n

    @classmethod
    def check_spec(cls, spec: CompressionSpec) -> None:
        """Raise ValueError if ``spec``'s settings make no sense for this codec."""

    @classmethod
    def from_spec(cls, spec: CompressionSpec, n: int) -> Codec:
        """The codec of one partition of ``n`` elements under a (checked) ``spec``."""
        return cls(n)

    def header_fields(self) -> dict[str, Any]:
        """This codec's settings in a push header: exactly what ``from_header`` reads back."""
        return {}

    @classmethod
    def from_header(cls, header: Mapping[str, Any], n: int) -> Codec:
        """The codec a push's untrusted header describes, for ``n`` elements: every field it
        reads goes through bps_gossip.fields, which raises ProtocolError naming the field."""
        return cls(n)

    def __eq__(self, other: object) -> bool:
        # The header is all a server knows of a codec, so it is the codec's identity.
        return isinstance(other, Codec) and type(self) is type(other) and self.n == other.n \
            and self.header_fields() == other.header_fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        settings = "".join(f", {key}={value!r}" for key, value in self.header_fields().items())
        return f"{type(self).__name__}(n={self.n}{settings})"

    @property
    def nbytes(self) -> int:
        """Bytes of every compressed partition."""
        raise NotImplementedError

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        """``x`` (n floats) -> ``nbytes`` uint8."""
        raise NotImplementedError

    def decompress(self, data: np.ndarray) -> np.ndarray:
        """``nbytes`` uint8 -> n float32."""
        raise NotImplementedError

    @property
    def result_nbytes(self) -> int:
        """Bytes of what the server sends back for a partition."""
        return 4 * self.n if self.pulls_sum else self.nbytes

    def decode_result(self, data: np.ndarray) -> np.ndarray:
        """``result_nbytes`` uint8 from the server -> n float32."""
        return data.view(np.float32).copy() if self.pulls_sum else self.decompress(data)

    def variance(self) -> float | None:
        """omega of an unbiased codec whose error may exceed what it compresses
        (E||D(C(x)) - x||^2 <= omega ||x||^2), or None: compressed gossip then scales what it
        adds to its public copies by 1 / (1 + omega) to stay a contraction (CHOCO)."""
        return None

    def roundtrip(self, x: np.ndarray, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
        """(compressed, decompressed) of ``x``: what error feedback needs."""
        data = self.compress(x, rng)
        return data, self.decompress(data)


class OneBit(Codec):
    name = "onebit"

    def __init__(self, n: int, scaling: bool) -> None:
        super().__init__(n)
        self.scaling = scaling

    @classmethod
    def from_spec(cls, spec: CompressionSpec, n: int) -> Codec:
        return cls(n, spec.scaling)

    def header_fields(self) -> dict[str, Any]:
        return {"scaling": self.scaling}

    @classmethod
    def from_header(cls, header: Mapping[str, Any], n: int) -> Codec:
        return cls(n, fields.flag(header, "scaling"))

    @property
    def nbytes(self) -> int:
        return 4 + (self.n + 7) // 8

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        scale = np.float32(np.abs(x).sum(dtype=np.float64) / self.n) if self.scaling and self.n else np.float32(1)
        out = np.empty(self.nbytes, np.uint8)
        out[:4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
        out[4:] = np.packbits(x < 0)
        return out

    def decompress(self, data: np.ndarray) -> np.ndarray:
        scale = data[:4].view(np.float32)[0]
        negative = np.unpackbits(data[4:], count=self.n).astype(bool)
        return np.where(negative, -scale, scale).astype(np.float32)


class _Sparse(Codec):
    """k (index, value) pairs."""

    needs_k = True

    def __init__(self, n: int, k: int) -> None:
        super().__init__(n)
        self.k = k

    @classmethod
    def from_spec(cls, spec: CompressionSpec, n: int) -> Codec:
        return cls(n, spec.count(n))

    def header_fields(self) -> dict[str, Any]:
        return {"k": self.k}  # the count kept, not the spec's k (which may be a fraction)

    @classmethod
    def from_header(cls, header: Mapping[str, Any], n: int) -> Codec:
        return cls(n, fields.integer(header, "k", 1, n))

    @property
    def nbytes(self) -> int:
        return 8 * self.k

    def _pack(self, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
        out = np.empty(self.nbytes, np.uint8)
        out[:4 * self.k] = indices.astype(np.int32).view(np.uint8)
        out[4 * self.k:] = values.astype(np.float32).view(np.uint8)
        return out

    def decompress(self, data: np.ndarray) -> np.ndarray:
        indices = data[:4 * self.k].view(np.int32)
        values = data[4 * self.k:].view(np.float32)
        if indices.size and (indices.min() < 0 or indices.max() >= self.n):
            raise ValueError(f"{self.name}: an index outside [0, {self.n})")
        out = np.zeros(self.n, np.float32)
        out[indices] = values
        return out


class TopK(_Sparse):
    name = "topk"

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        indices = np.argsort(-np.abs(x), kind="stable")[:self.k]
        return self._pack(indices, x[indices])


class RandomK(_Sparse):
    name = "randomk"

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        indices = (rng or np.random.default_rng()).integers(0, self.n, self.k)
        return self._pack(indices, x[indices])


class Dithering(Codec):
    name = "dithering"
    needs_k = True

    def __init__(self, n: int, s: int, natural: bool, l2: bool) -> None:
        super().__init__(n)
        self.s, self.natural, self.l2 = s, natural, l2
        self.top = 2 ** (s - 1) if natural else s  # the largest level
        self.level = np.dtype(np.int8 if self.top < 128 else np.int16 if self.top < 32768 else np.int32)

    @classmethod
    def check_spec(cls, spec: CompressionSpec) -> None:
        if spec.k != int(spec.k) or not 1 <= spec.k <= MAX_LEVELS_BITS:
            raise ValueError(f"dithering: k={spec.k!r} levels must be an integer in [1, {MAX_LEVELS_BITS}]")

    @classmethod
    def from_spec(cls, spec: CompressionSpec, n: int) -> Codec:
        return cls(n, int(spec.k), spec.natural, spec.l2)

    def header_fields(self) -> dict[str, Any]:
        return {"k": self.s, "natural": self.natural, "l2": self.l2}

    @classmethod
    def from_header(cls, header: Mapping[str, Any], n: int) -> Codec:
        return cls(n, fields.integer(header, "k", 1, MAX_LEVELS_BITS), fields.flag(header, "natural"),
                   fields.flag(header, "l2"))

    @property
    def nbytes(self) -> int:
        return 4 + self.n * self.level.itemsize

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        magnitude = np.abs(x).astype(np.float64)
        norm = math.sqrt(float(np.dot(magnitude, magnitude))) if self.l2 else float(magnitude.max(initial=0.0))
        out = np.empty(self.nbytes, np.uint8)
        out[:4] = np.frombuffer(np.float32(norm).tobytes(), np.uint8)
        if norm == 0.0:
            out[4:] = 0
            return out
        u = magnitude / norm * self.top
        draw = (rng or np.random.default_rng()).random(self.n)
        if self.natural:
            ceiling = np.ceil(u)
            low = np.where(ceiling <= 1, 0.0, np.exp2(np.ceil(np.log2(np.maximum(ceiling, 1)))) / 2)
            width = np.maximum(low, 1.0)
            level = low + width * (draw < (u - low) / width)
        else:
            low = np.floor(u)
            level = low + (draw < u - low)
        level = np.minimum(level, self.top) * np.where(x < 0, -1, 1)
        out[4:] = level.astype(self.level).view(np.uint8)
        return out

    def variance(self) -> float | None:
        """L2-normalized (QSGD): omega = min(n / s^2, sqrt(n) / s) for s levels (Alistarh et al.,
        2017, Lemma 3.1; natural levels add 1/8, Horvath et al., 2019). Normalized by the largest
        magnitude, the error stays below the values in practice: None."""
        if not self.l2:
            return None
        return min(self.n / self.top ** 2, math.sqrt(self.n) / self.top) + (0.125 if self.natural else 0.0)

    def decompress(self, data: np.ndarray) -> np.ndarray:
        norm = data[:4].view(np.float32)[0]
        levels = data[4:].view(self.level)
        if levels.size and int(np.abs(levels.astype(np.int64)).max()) > self.top:
            raise ValueError(f"dithering: a level above {self.top}")
        return (levels.astype(np.float32) * (norm / np.float32(self.top))).astype(np.float32)


CodecT = TypeVar("CodecT", bound=Codec)

# The registry: a compressor's name -> its class. A codec defined here gets its entry in
# this literal; one defined elsewhere calls register_codec.
CODECS: dict[str, type[Codec]] = {"onebit": OneBit, "topk": TopK, "randomk": RandomK, "dithering": Dithering}


def register_codec(cls: type[CodecT]) -> type[CodecT]:
    """Add a :class:`Codec` subclass to ``CODECS`` under its ``name`` (usable as a class
    decorator). Workers and servers must register the same codecs."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"{cls!r} is not a Codec class")
    name = cls.name
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"codec name {name!r} must be a string of 1 to {MAX_NAME_CHARS} characters")
    if name in CODECS and CODECS[name] is not cls:
        raise ValueError(f"codec {name!r} is already registered ({CODECS[name].__name__})")
    CODECS[name] = cls
    return cls
