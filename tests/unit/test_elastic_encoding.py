"""The elastic state's wire format (bps_gossip/elastic/encoding.py): no pickle, data only."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bps_gossip.elastic import encoding
from bps_gossip.errors import ProtocolError


def test_round_trip_of_what_states_hold():
    value = {"epoch": 3, "remaining": np.arange(5, dtype=np.int64), "lr": 0.1, "name": "x", "flag": True,
             "nested": [(1, 2.5, None), {"a": np.float32(2.0)}], 7: b"raw",
             "optimizer": {0: (np.ones((2, 3), np.float16), np.zeros(3, np.float32)), 1: None}}
    back = encoding.decode(encoding.encode(value))
    assert back.keys() == value.keys()
    np.testing.assert_array_equal(back["remaining"], value["remaining"])
    assert back["remaining"].dtype == np.int64
    assert back["nested"][0] == (1, 2.5, None) and isinstance(back["nested"][0], tuple)
    assert back["nested"][1]["a"] == np.float32(2.0) and isinstance(back["nested"][1]["a"], np.float32)
    first = back["optimizer"][0]
    assert isinstance(first, tuple) and first[0].dtype == np.float16 and first[0].shape == (2, 3)
    assert back[7] == b"raw" and back["optimizer"][1] is None


def test_objects_are_refused_at_encode():
    with pytest.raises(TypeError, match="object"):
        encoding.encode({"x": object()})
    with pytest.raises(TypeError, match="dtype object"):
        encoding.encode(np.array([object()]))


def test_a_pickle_is_not_decoded():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(ProtocolError):
        encoding.decode(pickle.dumps(Evil()))


@pytest.mark.parametrize("payload", [
    msgpack.packb(msgpack.ExtType(9, b"")),
    msgpack.packb(msgpack.ExtType(encoding.ARRAY, msgpack.packb([{"dtype": "|O", "shape": [1]}, b"\0" * 8]))),
    msgpack.packb(msgpack.ExtType(encoding.ARRAY, msgpack.packb([{"dtype": "<f8", "shape": [4]}, b"\0" * 8]))),
    msgpack.packb(msgpack.ExtType(encoding.ARRAY, msgpack.packb([{"dtype": "<f8", "shape": [-1]}, b""]))),
    msgpack.packb(msgpack.ExtType(encoding.ARRAY, b"\xc1")),
])
def test_malformed_extensions_are_rejected(payload):
    with pytest.raises(ProtocolError):
        encoding.decode(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_data_or_a_rejection(data):
    try:
        encoding.decode(data)
    except ProtocolError:
        pass
