"""The codec registry (bps_gossip/compression/codecs.py): a compressor is one Codec class
plus one entry in CODECS, and nothing else names it. A codec defined here, registered with
register_codec, runs the whole way in-process (spec, worker, header on the wire, server,
worker); every registered codec round-trips its header and rejects bad header fields."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from bps_gossip import fields
from bps_gossip.compression import (
    CODECS,
    Codec,
    CompressionSpec,
    PartitionState,
    codec_from_header,
    compress_on_worker,
    merge_on_server,
    register_codec,
    rng_for,
)
from bps_gossip.errors import ProtocolError

ROOT = Path(__file__).resolve().parents[2]


class Sign(Codec):
    """k * sign(x), one int8 per element: the whole of a new compressor."""

    name = "sign"
    needs_k = True

    def __init__(self, n: int, k: int) -> None:
        super().__init__(n)
        self.k = k

    @classmethod
    def check_spec(cls, spec):
        if spec.k != int(spec.k) or not 1 <= spec.k <= 100:
            raise ValueError(f"sign: k={spec.k!r} must be an integer in [1, 100]")

    @classmethod
    def from_spec(cls, spec, n):
        return cls(n, int(spec.k))

    def header_fields(self):
        return {"k": self.k}

    @classmethod
    def from_header(cls, header, n):
        return cls(n, fields.integer(header, "k", 1, 100))

    @property
    def nbytes(self):
        return self.n

    def compress(self, x, rng):
        return np.sign(np.asarray(x, np.float32)).astype(np.int8).view(np.uint8)

    def decompress(self, data):
        return (data.view(np.int8).astype(np.float32) * np.float32(self.k)).astype(np.float32)


@pytest.fixture
def sign_codec():
    assert register_codec(Sign) is Sign
    yield Sign
    del CODECS["sign"]


def wire(header):
    """A header as the server gets it: through msgpack."""
    return msgpack.unpackb(msgpack.packb(header), raw=False)


def test_registry_order_and_names():
    assert list(CODECS) == ["onebit", "topk", "randomk", "dithering", "2bit", "1bit"]  # BytePS's, then MXNet's
    assert ", ".join(CODECS) == "onebit, topk, randomk, dithering, 2bit, 1bit" and "topk" in CODECS
    assert all(issubclass(cls, Codec) and cls.name == name for name, cls in CODECS.items())
    assert [name for name, cls in CODECS.items() if cls.needs_k] == ["topk", "randomk", "dithering"]


def test_register_codec_refuses_what_cannot_work():
    class Nameless(Codec):
        pass

    class Long(Codec):
        name = "x" * 17

    class Onebit2(Codec):
        name = "onebit"

    with pytest.raises(TypeError):
        register_codec(int)
    for cls in (Nameless, Long, Onebit2):
        with pytest.raises(ValueError):
            register_codec(cls)
    assert register_codec(CODECS["topk"]) is CODECS["topk"]  # the same class again: no change
    assert list(CODECS) == ["onebit", "topk", "randomk", "dithering", "2bit", "1bit"]


def test_a_registered_codec_runs_end_to_end_in_process(sign_codec):
    spec = CompressionSpec("sign", k=2, ef=True, momentum=0.5, seed=7)
    assert spec.describe() == "sign k=2 ef nesterov=0.5 seed=7"
    with pytest.raises(ValueError, match="sign: k=1.5"):
        CompressionSpec("sign", k=1.5)
    n, workers = 50, 2
    states = [PartitionState() for _ in range(workers)]
    server = PartitionState()
    momentum = [np.zeros(n, np.float32) for _ in range(workers)]
    error = [np.zeros(n, np.float32) for _ in range(workers)]
    server_error = np.zeros(n, np.float32)
    for step in range(4):
        grads = [np.random.default_rng([rank, step]).normal(size=n).astype(np.float32) for rank in range(workers)]
        total, expected_total = np.zeros(n, np.float32), np.zeros(n, np.float32)
        for rank in range(workers):
            codec = spec.codec(n)
            data = compress_on_worker(spec, codec, grads[rank], states[rank], rng_for(spec.seed, 0, step, 0))
            assert data.dtype == np.uint8 and data.size == codec.nbytes == n
            header = spec.header(n)
            assert header["name"] == "sign" and header["k"] == 2
            server_codec, ef, seed = codec_from_header({"codec": wire(header)}, data.size)
            assert server_codec == codec and (ef, seed) == (True, 7)
            total += server_codec.decompress(data)
            # the reference: momentum, error feedback, 2 * sign
            momentum[rank] = np.float32(0.5) * momentum[rank] + grads[rank]
            p = grads[rank] + np.float32(0.5) * momentum[rank] + error[rank]
            sent = 2 * np.sign(p)
            error[rank] = p - sent
            expected_total += sent
        np.testing.assert_array_equal(total, expected_total)
        merged = merge_on_server(ef, server_codec, total, server, rng_for(seed, 0, step, 1))
        q = expected_total + server_error
        expected = (2 * np.sign(q)).astype(np.float32)
        server_error = q - expected
        np.testing.assert_array_equal(spec.codec(n).decompress(merged), expected)
        np.testing.assert_array_equal(server.error, server_error)
    with pytest.raises(ProtocolError, match=re.escape("sign: field 'k'=101")):
        codec_from_header({"codec": dict(spec.header(n), k=101)}, n)


def test_a_registered_codec_needs_no_change_in_the_mxnet_plugin(sign_codec):
    compression = pytest.importorskip("mxnet_plugin.compression")
    spec, fp16 = compression.parse_compression_params({"compressor": "sign", "k": 3}, {})
    assert spec == CompressionSpec("sign", k=3) and not fp16
    with pytest.raises(ValueError, match="sign compressor needs k"):
        compression.parse_compression_params({"compressor": "sign"}, {})


def specs_of(name):
    """Valid specs of every shape for the codec ``name``."""
    out = []
    for k in (1, 3, 0.25, 1000):
        for flag in ("scaling", "natural", "l2", None):
            try:
                out.append(CompressionSpec(name, k=k, ef=k == 3, seed=k if k == 3 else None,
                                           **({flag: True} if flag else {})))
            except ValueError:  # a setting this codec refuses
                pass
    assert out, f"{name}: no valid spec"
    return out


@pytest.mark.parametrize("name", list(CODECS))
def test_every_codec_round_trips_its_header(name):
    for spec in specs_of(name):
        for n in (1, 7, 1000):
            codec = spec.codec(n)
            header = spec.header(n)
            assert set(header) == {"name", "n", "k", "scaling", "ef", "seed", "natural", "l2"}
            assert header["name"] == name and header["n"] == n
            assert set(codec.header_fields()) <= set(header)
            back, ef, seed = codec_from_header({"codec": wire(header)}, codec.nbytes)
            assert back == codec and back.nbytes == codec.nbytes and (ef, seed) == (spec.ef, spec.seed)
            with pytest.raises(ProtocolError, match="bytes"):
                codec_from_header({"codec": header}, codec.nbytes + 1)


MISSING = object()


@pytest.mark.parametrize("name", list(CODECS))
def test_every_codec_rejects_bad_header_fields(name):
    n = 10
    spec = specs_of(name)[0]
    header = spec.header(n)
    own = spec.codec(n).header_fields()
    assert name == "onebit" or own  # the other codecs have settings to check
    bad_values = (MISSING, "x", -1, 1 << 40, 0.5, None, [1])
    if CODECS[name].mxnet_type:  # k is a float threshold: any finite number (1bit), above 0 (2bit)
        bad_values = (MISSING, "x", None, [1], True, float("nan"), float("inf")) + ((-1, 0.0) if name == "2bit" else ())
    for key in own:
        for bad in bad_values:
            changed = {k: v for k, v in header.items() if k != key}
            if bad is not MISSING:
                changed[key] = bad
            with pytest.raises(ProtocolError, match=re.escape(f"{name}: field {key!r}")):
                codec_from_header({"codec": changed}, spec.codec(n).nbytes)
    for key, bad in (("name", "zip"), ("name", 3), ("n", 0), ("n", 1 << 40), ("n", 2.0), ("ef", 1),
                     ("seed", -1), ("seed", "1")):
        with pytest.raises(ProtocolError):
            codec_from_header({"codec": dict(header, **{key: bad})}, spec.codec(n).nbytes)


def test_the_sparse_and_dithering_ranges():
    base = {"name": "topk", "n": 10, "k": 10, "scaling": False, "ef": False, "seed": None, "natural": False,
            "l2": False}
    assert codec_from_header({"codec": base}, 80)[0].k == 10
    with pytest.raises(ProtocolError, match=re.escape("topk: field 'k'=11 is outside [1, 10]")):
        codec_from_header({"codec": dict(base, k=11)}, 88)
    dithering = dict(base, name="dithering", k=30, natural=True)  # 2^29 levels: int32
    assert codec_from_header({"codec": dithering}, 4 + 40)[0].s == 30
    with pytest.raises(ProtocolError, match=re.escape("dithering: field 'k'=31 is outside [1, 30]")):
        codec_from_header({"codec": dict(dithering, k=31)}, 44)


@pytest.mark.parametrize("path", ["bps_gossip/compression/pipeline.py", "mxnet_plugin/compression.py"])
def test_no_compressor_is_named_outside_its_codec(path):
    """Dispatch goes through CODECS: no string constant in these files is a codec's name."""
    tree = ast.parse((ROOT / path).read_text())
    named = [node.value for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CODECS]
    assert not named, f"{path} names compressors {named}: dispatch through CODECS instead"
