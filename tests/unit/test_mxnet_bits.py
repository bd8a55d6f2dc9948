"""MXNet's 2bit and 1bit quantizers (bps_gossip/compression/thresholds.py) against numbers worked out
by hand from MXNet's formulas (src/kvstore/gradient_compression-inl.h), over two pushes so that the
residual carried from the first push decides the second; their byte layouts; the server's float32
sum; and MXNet's compression_params as mxnet_plugin reads them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bps_gossip.compression import (
    CODECS,
    CompressionSpec,
    PartitionState,
    codec_from_header,
    compress_on_worker,
    merge_on_server,
    rng_for,
)
from bps_gossip.errors import ProtocolError

f32 = np.float32


def push(spec, state, grad):
    """One worker's push through the pipeline: (bytes on the wire, what they decode to)."""
    grad = np.array(grad, np.float32)
    codec = spec.codec(grad.size)
    data = compress_on_worker(spec, codec, grad, state, rng_for(None, 0, 0, 0))
    return data, codec.decompress(data)


def test_2bit_two_pushes_by_hand():
    spec, state = CompressionSpec("2bit", threshold=0.5), PartitionState()
    # push 1: residual 0 + g; >= 0.5 sends +0.5, <= -0.5 sends -0.5 (0.5 and -0.5 themselves included)
    data, sent = push(spec, state, [0.6, -0.6, 0.3, -0.2, 0.5, -0.5, 0.0, 1.7])
    np.testing.assert_array_equal(sent, [0.5, -0.5, 0, 0, 0.5, -0.5, 0, 0.5])
    np.testing.assert_array_equal(state.error, np.array([f32(0.6) - f32(0.5), f32(-0.6) + f32(0.5), 0.3, -0.2, 0, 0, 0,
                                                         f32(1.7) - f32(0.5)], np.float32))
    # 11 = +t, 10 = -t, 00 = 0, four values a byte from the highest bits; 16 values a float32 word
    assert data.tolist() == [0b11100000, 0b11100011, 0, 0]
    # push 2: what stayed behind carries: 0.1 + 0.3 < 0.5 stays, 0.3 + 0.3 goes, 1.2 + 0 goes again
    _, sent = push(spec, state, [0.3, -0.3, 0.3, -0.2, 0.1, 0.0, -0.5, 0.0])
    np.testing.assert_array_equal(sent, [0, 0, 0.5, 0, 0, 0, -0.5, 0.5])
    np.testing.assert_allclose(state.error, [0.4, -0.4, 0.1, -0.4, 0.1, 0, 0, 0.7], atol=1e-6)


def test_1bit_two_pushes_by_hand_any_threshold():
    spec, state = CompressionSpec("1bit", threshold=0.0), PartitionState()
    # above the threshold +1, anything else (0 itself included) -1; the residual keeps r - sent
    data, sent = push(spec, state, [0.3, -0.3, 0.0, 2.0])
    np.testing.assert_array_equal(sent, [1, -1, -1, 1])
    np.testing.assert_allclose(state.error, [-0.7, 0.7, 1.0, 1.0], atol=1e-6)
    assert data.tolist() == [0b10010000, 0, 0, 0]  # one bit a value, highest first; 32 to a word
    _, sent = push(spec, state, [0.5, -0.5, -0.5, -3.0])
    np.testing.assert_array_equal(sent, [-1, 1, 1, -1])
    np.testing.assert_allclose(state.error, [0.8, -0.8, -0.5, -1.0], atol=1e-6)
    _, sent = push(CompressionSpec("1bit", threshold=-0.5), PartitionState(), [-0.4, -0.5, -0.6])
    np.testing.assert_array_equal(sent, [1, -1, -1])  # MXNet 2.0's tests use -0.5, 0 and 0.5


def test_the_residual_is_kept_without_ef_and_the_server_sends_the_float32_sum():
    spec = CompressionSpec("2bit", threshold=0.25)
    assert not spec.ef
    workers = [PartitionState(), PartitionState()]
    grads = [np.array([0.3, 0.1, -0.3], np.float32), np.array([0.3, -0.1, 0.2], np.float32)]
    codec = spec.codec(3)
    total = sum(codec.decompress(push(spec, state, g)[0]) for state, g in zip(workers, grads))
    server = PartitionState()
    merged = merge_on_server(True, codec, total.copy(), server, rng_for(None, 0, 0, 1))
    assert server.error is None and merged.nbytes == codec.result_nbytes == 12  # no compression of the sum
    np.testing.assert_array_equal(codec.decode_result(merged), [0.5, 0, -0.25])  # +-2t does not fit 2 bits
    np.testing.assert_allclose(workers[0].error, [0.05, 0.1, -0.05], atol=1e-6)


def test_sizes_headers_and_what_a_server_refuses():
    for name, n, nbytes in (("2bit", 37, 12), ("2bit", 16, 4), ("1bit", 37, 8), ("1bit", 32, 4)):
        spec = CompressionSpec(name, threshold=0.5)
        codec = spec.codec(n)
        assert codec.nbytes == nbytes and codec.result_nbytes == 4 * n
        header = spec.header(n)
        assert header["k"] == 0.5 and codec_from_header({"codec": header}, nbytes)[0] == codec
    header = CompressionSpec("2bit").header(8)
    assert header["k"] == 0.5  # MXNet's default threshold
    for bad in (0.0, -0.5, float("nan"), "0.5"):
        with pytest.raises(ProtocolError, match=re.escape("2bit: field 'k'")):
            codec_from_header({"codec": dict(header, k=bad)}, 4)
    assert codec_from_header({"codec": dict(header, name="1bit", k=-2.0)}, 4)[0].threshold == -2.0


def test_spec_rules():
    assert CompressionSpec("2bit", threshold=0.5).compresses(4, 65536)  # MXNet compresses every size
    assert not CompressionSpec("topk", k=2).compresses(4, 65536)
    assert CompressionSpec("2bit", threshold=0.5).describe() == "2bit threshold=0.5"
    for kwargs, text in (({"compressor": "topk", "k": 2, "threshold": 0.5}, "takes no threshold"),
                         ({"compressor": "2bit", "threshold": 0}, "greater than 0"),
                         ({"compressor": "2bit", "threshold": 1e-60}, "0 as a float32"),
                         ({"compressor": "1bit", "threshold": float("inf")}, "finite")):
        with pytest.raises(ValueError, match=text):
            CompressionSpec(**kwargs)
    assert [name for name, cls in CODECS.items() if cls.keeps_residual and cls.pulls_sum and cls.any_size] \
        == ["2bit", "1bit"]


MXNET_ERRORS = [
    ({"type": "3bit"}, ValueError, "compression_params ['type']='3bit' is not a type of gradient compression; "
                                   "MXNet's types are '2bit', '1bit'"),
    ({"threshold": 0.5}, ValueError, "has no 'type'"),
    ({"type": "2bit", "threshold": -1}, ValueError, "2bit: threshold=-1.0 must be greater than 0"),
    ({"type": "2bit", "threshold": float("nan")}, ValueError, "threshold=nan must be a finite number"),
    ({"type": "2bit", "threshold": "abc"}, TypeError, "threshold='abc' must be a number"),
    ({"type": "2bit", "threshold": True}, TypeError, "must be a number, not bool"),
    ({"type": "2bit", "threshold": [0.5]}, TypeError, "must be a number, not list"),
    ({"type": "2bit", "treshold": 0.5}, ValueError, "unknown key 'treshold' (did you mean 'threshold'?)"),
    ({"type": "2bit", "compressor": "topk"}, ValueError, "unknown key 'compressor'"),
    ("2bit", TypeError, "must be a dict such as {'type': '2bit', 'threshold': 0.5}"),
]


@pytest.mark.parametrize(("params", "exc", "text"), MXNET_ERRORS, ids=[str(p) for p, _, _ in MXNET_ERRORS])
def test_mxnet_compression_params_errors(params, exc, text):
    compression = pytest.importorskip("mxnet_plugin.compression")
    with pytest.raises(exc, match=re.escape(text)):
        compression.parse_mxnet_compression(params)


def test_mxnet_compression_params_accepted():
    compression = pytest.importorskip("mxnet_plugin.compression")
    parse = compression.parse_mxnet_compression
    assert parse({"type": "2bit"}) == parse({"type": "2bit", "threshold": 0.5}) == CompressionSpec("2bit", threshold=0.5)
    assert parse({"type": "2bit", "threshold": "0.25"}).threshold == 0.25  # MXNet passes values as text
    assert parse({"type": "1bit", "threshold": 0}).threshold == 0.0
    # DistributedTrainer takes MXNet's form beside BytePS's; BytePS's form does not take MXNet's types
    assert compression.parse_compression_params({"type": "1bit", "threshold": -0.5}, {}) \
        == (CompressionSpec("1bit", threshold=-0.5), False)
    with pytest.raises(ValueError, match=re.escape("write it as MXNet does: {'type': '2bit', 'threshold': 0.5}")):
        compression.parse_compression_params({"compressor": "2bit"}, {})


def test_mxnet_compression_beside_byteps_enable_async_says_both(monkeypatch):
    """MXNet's dict picks allreduce; under BYTEPS_ENABLE_ASYNC=1 the user heard that a mode='allreduce'
    they never passed conflicted: the error now names both settings."""
    from bps_gossip import runtime
    from mxnet_plugin.compression import mode_for_compression, parse_compression_params

    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    monkeypatch.setenv("BYTEPS_ENABLE_ASYNC", "1")
    runtime.remember(None)  # the environment is read once per process: read it again
    try:
        spec, _ = parse_compression_params({"type": "2bit", "threshold": 0.5}, {})
        with pytest.raises(ValueError, match="2bit compression_params .* BYTEPS_ENABLE_ASYNC=1 asks for mode='async'"):
            mode_for_compression(None, spec)
    finally:
        monkeypatch.delenv("BYTEPS_ENABLE_ASYNC")
        runtime.remember(None)
