"""The four gradient compressors of BytePS, as numpy: onebit, topk, randomk, dithering.

Each codec works on one partition of ``n`` elements (computed in float32) and has a
fixed compressed size, so a server's merged result has the same byte length as every
push of its round. The math follows BytePS (byteps/common/compressor/impl); the byte
layouts are ours:

- onebit: float32 scale, then the sign bits (1 = negative), packed. The scale is the
  mean absolute value with ``scaling``, else 1; decompression gives -scale or +scale
  (zero decodes as +scale).
- topk: the k elements of largest magnitude (ties: the earlier index), as int32 indices
  then float32 values; decompression scatters them into zeros.
- randomk: k indices drawn uniformly with replacement, values not rescaled; same layout.
- dithering: float32 norm (max |x|, or the L2 norm), then one signed level per element
  (int8, or wider when there are more levels). Linear partition: levels 0..s, value =
  level * norm / s. Natural partition: levels 0 and powers of two up to L = 2^(s-1),
  value = level * norm / L. Rounding between levels is stochastic and unbiased.

Random draws come from numpy's PCG64 seeded by the caller (see pipeline.py), not from
BytePS's xorshift128+: the same distributions, another generator.
"""

from __future__ import annotations

import math

import numpy as np

CODECS = ("onebit", "topk", "randomk", "dithering")
MAX_LEVELS_BITS = 30  # dithering: s (linear) or 2^(s-1) (natural) levels must fit int32


class Codec:
    """Compresses and decompresses partitions of ``n`` float elements."""

    name = ""

    def __init__(self, n: int) -> None:
        self.n = n

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

    def roundtrip(self, x: np.ndarray, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
        """(compressed, decompressed) of ``x``: what error feedback needs."""
        data = self.compress(x, rng)
        return data, self.decompress(data)


class OneBit(Codec):
    name = "onebit"

    def __init__(self, n: int, scaling: bool) -> None:
        super().__init__(n)
        self.scaling = scaling

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

    def __init__(self, n: int, k: int) -> None:
        super().__init__(n)
        self.k = k

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

    def __init__(self, n: int, s: int, natural: bool, l2: bool) -> None:
        super().__init__(n)
        self.s, self.natural, self.l2 = s, natural, l2
        self.top = 2 ** (s - 1) if natural else s  # the largest level
        self.level = np.dtype(np.int8 if self.top < 128 else np.int16 if self.top < 32768 else np.int32)

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

    def decompress(self, data: np.ndarray) -> np.ndarray:
        norm = data[:4].view(np.float32)[0]
        levels = data[4:].view(self.level)
        if levels.size and int(np.abs(levels.astype(np.int64)).max()) > self.top:
            raise ValueError(f"dithering: a level above {self.top}")
        return (levels.astype(np.float32) * (norm / np.float32(self.top))).astype(np.float32)
