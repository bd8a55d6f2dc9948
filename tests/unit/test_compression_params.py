"""BytePS's compression_params, in-process (no job: every check here fails before anything
would reach bps_gossip's runtime, so it fails alike on every rank). Issue 33, item 6: a
misspelled key trained uncompressed without a word."""

from __future__ import annotations

import mxnet as mx
import pytest

import mxnet_plugin as bps
from mxnet_plugin.compression import KNOWN_KEYS, parse_compression_params

KNOWN = "known keys: compressor, ef, momentum, scaling, k, seed, partition, normalize, fp16"


def params() -> mx.gluon.ParameterDict:
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    return net.collect_params()


def test_the_known_keys_are_bytepss():
    # byteps.mxnet's DistributedTrainer reads these, and BytePS's *_gc.py examples pass them.
    assert set(KNOWN_KEYS) == {"compressor", "ef", "momentum", "scaling", "k", "seed", "partition", "normalize",
                               "fp16"}
    every = {"compressor": "dithering", "ef": "vanilla", "momentum": "nesterov", "scaling": False, "k": 4,
             "seed": 1, "partition": "natural", "normalize": "l2", "fp16": False}
    spec, fp16 = parse_compression_params(every, {"momentum": 0.9})
    assert spec is not None and spec.compressor == "dithering" and not fp16


@pytest.mark.parametrize("given, named", [
    ({"compresor": "topk", "k": 0.1}, "unknown key 'compresor' (did you mean 'compressor'?)"),
    ({"compressor": "topk", "K": 0.1}, "unknown key 'K' (did you mean 'k'?)"),
    ({"compressor": "", "fp_16": True}, "unknown key 'fp_16' (did you mean 'fp16'?)"),
    ({"compressor": "onebit", "error_feedback": "vanilla"}, "unknown key 'error_feedback'; "),
    ({"compresor": "", "normalise": "l2"},
     "unknown keys 'compresor' (did you mean 'compressor'?), 'normalise' (did you mean 'normalize'?)"),
])
def test_an_unknown_key_is_named_with_the_known_ones(given, named):
    with pytest.raises(ValueError) as raised:
        parse_compression_params(given, {})
    message = str(raised.value)
    assert message.startswith("compression_params: " + named), message
    assert message.endswith(KNOWN), message


def test_empty_or_no_params_are_still_no_compression():
    assert parse_compression_params(None, {}) == (None, False)
    assert parse_compression_params({}, {}) == (None, False)


@pytest.mark.parametrize("mode", [None, "gossip", "allreduce", "auto"])
def test_the_trainer_rejects_a_misspelled_key_in_every_mode(mode):
    """Before: {'compresor': 'topk', 'k': 0.1} built a trainer that trained uncompressed."""
    with pytest.raises(ValueError, match=r"unknown key 'compresor' \(did you mean 'compressor'\?\)"):
        bps.DistributedTrainer(params(), "sgd", {"learning_rate": 0.1}, mode=mode,
                               compression_params={"compresor": "topk", "k": 0.1})
