"""BytePS's compression settings for MXNet: ``compression_params`` and ``Compression``.

``DistributedTrainer(..., compression_params={...})`` reads the dict exactly as
byteps.mxnet does: ``compressor`` (onebit, topk, randomk, dithering; empty: none),
``ef`` ('vanilla' error feedback), ``momentum`` ('nesterov': Nesterov momentum applied
before compression, with mu taken from the optimizer's ``momentum``, which is removed
from the optimizer), ``scaling`` (onebit), ``k`` (topk and randomk: elements kept per
partition, below 1 a fraction; dithering: levels), ``seed``, ``partition`` (linear,
natural) and ``normalize`` (max, l2) for dithering, and ``fp16`` (push float16). Empty
or false values mean off, so BytePS's examples, which always pass every key, run
uncompressed when asked for nothing. Any other key is an error (a misspelled key would
otherwise train uncompressed without a word).

MXNet's own form, ``{'type': '2bit', 'threshold': 0.5}`` (``kv.set_gradient_compression``,
``gluon.Trainer`` and ``Module``'s ``compression_params``), is read by
:func:`parse_mxnet_compression`; DistributedTrainer takes either form.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np

from bps_gossip import job_config
from bps_gossip.compression import CODECS, DEFAULT_THRESHOLD, CompressionSpec

# Every key byteps.mxnet's DistributedTrainer reads from compression_params (and nothing else).
KNOWN_KEYS = ("compressor", "ef", "momentum", "scaling", "k", "seed", "partition", "normalize", "fp16")
MXNET_KEYS = ("type", "threshold")  # MXNet's compression_params (GradientCompressionParam)
_CHOICES = {"ef": ("vanilla",), "momentum": ("nesterov",), "partition": ("linear", "natural"),
            "normalize": ("max", "l2")}


class Compression:
    """What a tensor becomes on the wire, as byteps.mxnet and horovod.mxnet export it:
    ``Compression.none`` and ``Compression.fp16`` (float tensors go as float16)."""

    class none:  # noqa: N801 - BytePS's and Horovod's name
        """No compression."""

        @staticmethod
        def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
            return tensor, None

        @staticmethod
        def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
            return tensor

    class fp16:  # noqa: N801
        """Float tensors as float16 on the wire, cast back after."""

        @staticmethod
        def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
            if np.dtype(tensor.dtype).kind == "f":
                return tensor.astype("float16", copy=False), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
            return tensor if ctx is None else tensor.astype(ctx, copy=False)


def _text(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not value:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"compression_params[{key!r}]={value!r} must be a string")
    value = value.lower()
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ValueError(f"compression_params[{key!r}]={value!r} is not one of {', '.join(_CHOICES[key])}")
    return value


def check_keys(params: Mapping[Any, Any]) -> None:
    """ValueError naming every key of ``params`` that is not in :data:`KNOWN_KEYS`, each with
    the closest known key, and the known ones."""
    unknown = []
    for key in params:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key.lower(), KNOWN_KEYS, n=1) if isinstance(key, str) else []
            unknown.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown:
        raise ValueError(f"compression_params: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known keys: {', '.join(KNOWN_KEYS)}")


def mxnet_types() -> dict[str, str]:
    """MXNet's compression ``type`` -> the codec's name in CODECS."""
    return {cls.mxnet_type: name for name, cls in CODECS.items() if cls.mxnet_type}


def _mxnet_threshold(value: Any, where: str) -> float:
    """MXNet hands every value to C++ as text and parses a float from it: a number, or a
    string holding one, is a threshold; anything else (a bool, None, 'abc') is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.floating, np.integer)):
        raise TypeError(f"{where}: threshold={value!r} must be a number, not {type(value).__name__}")
    try:
        threshold = float(value)
    except ValueError:
        raise TypeError(f"{where}: threshold={value!r} must be a number") from None
    if not math.isfinite(threshold):
        raise ValueError(f"{where}: threshold={value!r} must be a finite number")
    return threshold


def parse_mxnet_compression(params: Any, where: str = "set_gradient_compression") -> CompressionSpec:
    """The spec of MXNet's ``compression_params`` (``{'type': '2bit', 'threshold': 0.5}``, as
    ``kv.set_gradient_compression``, gluon.Trainer and Module take it). ``type`` is required;
    ``threshold`` defaults to 0.5 as in MXNet; 2bit needs it above 0, 1bit takes any finite
    number (MXNet 2.0's rules). Unlike MXNet, which ignores keys it does not know, any other
    key is an error: a misspelled ``treshold`` would otherwise train with 0.5."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{where}: compression_params must be a dict such as {{'type': '2bit', 'threshold': 0.5}}, "
                        f"got {type(params).__name__}")
    types = mxnet_types()
    unknown = [key for key in params if key not in MXNET_KEYS]
    if unknown:
        hints = [f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                 for key in unknown
                 for close in [difflib.get_close_matches(str(key).lower(), MXNET_KEYS, n=1)]]
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)} in MXNet's "
                         f"compression_params; known keys: {', '.join(MXNET_KEYS)}")
    kind = params.get("type")
    if kind not in types:
        what = "has no 'type'" if "type" not in params else f"['type']={kind!r} is not a type of gradient compression"
        known = ", ".join(repr(t) for t in sorted(types, reverse=True))
        raise ValueError(f"{where}: compression_params {what}; MXNet's types are {known}")
    threshold = _mxnet_threshold(params["threshold"], where) if "threshold" in params else DEFAULT_THRESHOLD
    try:
        return CompressionSpec(types[kind], threshold=threshold)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def mode_for_compression(mode: str | None, spec: CompressionSpec | None) -> str | None:
    """DistributedTrainer's mode under ``spec``: MXNet's quantizers compress gradients through the
    servers, as in MXNet, so they pick allreduce (a job's default gossip mode would quantize its
    model messages against a threshold meant for gradients); another explicit mode is an error."""
    if spec is None or not CODECS[spec.compressor].mxnet_type:
        return mode
    if mode not in (None, "allreduce"):
        raise ValueError(f"DistributedTrainer: MXNet's {spec.compressor} compression_params compress gradients, "
                         f"which mode={mode!r} does not push: use mode='allreduce' (the default with them), or "
                         f"BytePS's compressors ('compressor') for compressed gossip")
    if mode is None and job_config().enable_async:
        raise ValueError(f"DistributedTrainer: MXNet's {spec.compressor} compression_params compress gradients "
                         "through the servers (mode='allreduce'), but BYTEPS_ENABLE_ASYNC=1 asks for mode='async', "
                         "which pushes uncompressed changes of the weights: unset one of them")
    return "allreduce"


def parse_compression_params(params: Mapping[str, Any] | None, optimizer_params: dict[str, Any]
                             ) -> tuple[CompressionSpec | None, bool]:
    """(compressor spec or None, fp16) from BytePS's ``compression_params``, or from MXNet's
    (a dict with ``type``: :func:`parse_mxnet_compression`).

    With ``momentum='nesterov'`` the optimizer's ``momentum`` moves into the spec: it is
    removed from ``optimizer_params`` (changed in place), as BytePS does.
    """
    if not params:
        return None, False
    if not isinstance(params, Mapping):
        raise TypeError(f"compression_params must be a dict, got {type(params).__name__}")
    if "type" in params:
        return parse_mxnet_compression(params, "compression_params"), False
    check_keys(params)
    fp16 = bool(params.get("fp16"))
    compressor = _text(params, "compressor")
    ef, momentum = _text(params, "ef"), _text(params, "momentum")
    if not compressor:
        if ef or momentum:
            raise ValueError(f"compression_params: ef={ef!r} and momentum={momentum!r} need a compressor "
                             f"({', '.join(CODECS)})")
        return None, fp16
    if compressor not in CODECS:
        raise ValueError(f"compression_params['compressor']={compressor!r} is not one of {', '.join(CODECS)}")
    if CODECS[compressor].mxnet_type:
        raise ValueError(f"compression_params: {compressor} is MXNet's; write it as MXNet does: "
                         f"{{'type': {CODECS[compressor].mxnet_type!r}, 'threshold': 0.5}}")
    mu = None
    if momentum:
        if "momentum" not in optimizer_params:
            raise ValueError("compression_params: momentum='nesterov' takes mu from optimizer_params['momentum'], "
                             "which is not set")
        mu = float(optimizer_params.pop("momentum"))
    if CODECS[compressor].needs_k and params.get("k") is None:
        raise ValueError(f"compression_params: the {compressor} compressor needs k")
    seed = params.get("seed")
    spec = CompressionSpec(
        compressor=compressor, k=params.get("k") or 1, scaling=bool(params.get("scaling")), ef=bool(ef),
        momentum=mu, seed=None if seed is None else int(seed),
        natural=_text(params, "partition") == "natural", l2=_text(params, "normalize") == "l2")
    return spec, fp16
