"""Gradient compression as BytePS does it (compressors, error feedback, Nesterov momentum), and
MXNet's 2bit and 1bit quantizers (registered by importing thresholds)."""

from .codecs import CODECS, Codec, register_codec
from .pipeline import (
           CompressionSpec,
           PartitionState,
           codec_from_header,
           compress_on_worker,
           merge_on_server,
           rng_for,
)
from .thresholds import (
           DEFAULT_THRESHOLD,  # registers '2bit' and '1bit' in every process that compresses
)

__all__ = ["CODECS", "Codec", "CompressionSpec", "DEFAULT_THRESHOLD", "PartitionState", "codec_from_header", "compress_on_worker",
           "merge_on_server", "register_codec", "rng_for"]
