"""MXNet's gradient quantizers, '2bit' and '1bit', as numpy (``kv.set_gradient_compression``).

MXNet (src/kvstore/gradient_compression-inl.h) keeps a residual per key on each worker
and, for each push, adds the gradient to it, quantizes the residual, and subtracts what
it sent:

- 2bit (MXNet 1.x and 2.0), threshold t > 0 (default 0.5): ``r >= t`` sends +t, ``r <= -t``
  sends -t, anything else 0. Two bits a value, 16 values to 4 bytes: value i in byte
  i // 4, highest bits first, 11 = +t, 10 = -t (01 and 00 decode as 0).
- 1bit (MXNet 2.0 only; 1.9.1 refuses the type), any finite threshold (default 0.5):
  ``r > t`` sends +1, anything else -1, whatever t is. One bit a value, 32 values to
  4 bytes: value i in byte i // 8, highest bit first, 1 = +1.

These are MXNet's byte layouts, padded as MXNet pads them (to whole float32 words).

The residual is exactly error feedback as the pipeline runs it (``p = g + e; c = C(p);
e = p - D(c)``, in float32, the same operations in the same order as MXNet's), so the
codecs themselves are stateless and say ``keeps_residual``: the worker's pipeline then
keeps that residual per partition whatever the spec's ``ef`` says (in MXNet the residual
belongs to the quantizer, not to an option). ``pulls_sum``: MXNet's servers never
compress what workers pull, so the server sends the float32 sum of the dequantized
pushes instead of compressing it again (a sum of two workers' +-t no longer fits two
bits). ``any_size``: MXNet quantizes every float32 array, however small, so
BYTEPS_MIN_COMPRESS_BYTES does not apply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import fields
from ..errors import ProtocolError
from .codecs import Codec, register_codec

if TYPE_CHECKING:
    from .pipeline import CompressionSpec

DEFAULT_THRESHOLD = 0.5  # MXNet's GradientCompressionParam default
_WORD = 4  # MXNet packs into float32 words


def _words(n: int, per_word: int) -> int:
    return _WORD * (-(-n // per_word))


class _Threshold(Codec):
    """A quantizer with a float32 threshold, carried in the header's ``k`` field."""

    keeps_residual = True
    pulls_sum = True
    any_size = True


    def __init__(self, n: int, threshold: float) -> None:
        super().__init__(n)
        self.threshold = np.float32(threshold)  # MXNet's threshold is a C float

    @classmethod
    def check_threshold(cls, threshold: float) -> None:
        """Raise ValueError unless MXNet would take ``threshold`` for this type."""
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"{cls.name}: threshold={threshold!r} must be a finite number")

    @classmethod
    def check_spec(cls, spec: CompressionSpec) -> None:
        cls.check_threshold(cls._threshold_of(spec))

    @staticmethod
    def _threshold_of(spec: CompressionSpec) -> float:
        return DEFAULT_THRESHOLD if spec.threshold is None else spec.threshold

    @classmethod
    def from_spec(cls, spec: CompressionSpec, n: int) -> Codec:
        return cls(n, cls._threshold_of(spec))

    def header_fields(self) -> dict[str, Any]:
        return {"k": float(self.threshold)}

    @classmethod
    def from_header(cls, header: Mapping[str, Any], n: int) -> Codec:
        threshold = fields.number(header, "k")
        try:
            cls.check_threshold(threshold)
        except ValueError as exc:
            raise ProtocolError(f"field 'k'={threshold!r} is no threshold: {exc}") from None
        return cls(n, threshold)


@register_codec
class TwoBit(_Threshold):
    name = "2bit"
    mxnet_type = "2bit"

    @classmethod
    def check_threshold(cls, threshold: float) -> None:
        super().check_threshold(threshold)
        if not threshold > 0:  # MXNet: CHECK_GT(threshold, 0)
            raise ValueError(f"{cls.name}: threshold={threshold!r} must be greater than 0")
        if not np.float32(threshold) > 0:
            raise ValueError(f"{cls.name}: threshold={threshold!r} is 0 as a float32")

    @property
    def nbytes(self) -> int:
        return _words(self.n, 16)

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        codes = np.zeros(4 * self.nbytes, np.uint8)  # four 2-bit codes a byte
        codes[:self.n][x >= self.threshold] = 0b11
        codes[:self.n][x <= -self.threshold] = 0b10
        quads = codes.reshape(-1, 4)
        return (quads[:, 0] << 6 | quads[:, 1] << 4 | quads[:, 2] << 2 | quads[:, 3]).astype(np.uint8)

    def decompress(self, data: np.ndarray) -> np.ndarray:
        codes = np.stack([data >> 6, data >> 4, data >> 2, data], axis=1).reshape(-1)[:self.n] & 0b11
        out = np.zeros(self.n, np.float32)
        out[codes == 0b11] = self.threshold
        out[codes == 0b10] = -self.threshold
        return out


@register_codec
class OneBitThreshold(_Threshold):
    name = "1bit"
    mxnet_type = "1bit"

    @property
    def nbytes(self) -> int:
        return _words(self.n, 32)

    def compress(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        out = np.zeros(self.nbytes, np.uint8)
        packed = np.packbits(np.asarray(x, dtype=np.float32) > self.threshold)
        out[:packed.size] = packed
        return out

    def decompress(self, data: np.ndarray) -> np.ndarray:
        positive = np.unpackbits(data, count=self.n).astype(bool)
        return np.where(positive, np.float32(1), np.float32(-1)).astype(np.float32)
