"""Gradient compression as BytePS does it: compressors, error feedback, Nesterov momentum."""

from .codecs import CODECS, Codec, register_codec
from .pipeline import (
           CompressionSpec,
           PartitionState,
           codec_from_header,
           compress_on_worker,
           merge_on_server,
           rng_for,
)

__all__ = ["CODECS", "Codec", "CompressionSpec", "PartitionState", "codec_from_header", "compress_on_worker",
           "merge_on_server", "register_codec", "rng_for"]
