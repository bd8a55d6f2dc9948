"""Checked field reads (bps_gossip/fields.py) and push decoding, property-based: any
value a msgpack peer can send becomes a field of the promised type and range, or a
ProtocolError/ValueError; never another exception, never a conversion."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bps_gossip import fields
from bps_gossip.errors import ProtocolError
from bps_gossip.protocol import Push

# everything msgpack can carry
scalars = (st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=5), max_leaves=20)
FIELDS = ["req", "rank", "key", "part", "seq", "count", "wire", "dtype", "shape", "kind", "gen", "size", "name",
          "ack", "shm", "offset", "hosted", "codec"]
VALID_PUSH = {"req": 1, "gen": 0, "key": 3, "part": 0, "seq": 0, "name": "w", "count": 2, "wire": "<f4",
              "dtype": "float32", "shape": [2], "kind": "sum"}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), values), st.sets(st.sampled_from(sorted(VALID_PUSH))))
def test_any_push_header_is_a_push_or_a_rejection(changed, dropped):
    """A valid push with any fields changed or dropped decodes to a Push whose fields have
    their types, or is refused with a ProtocolError (nothing else escapes)."""
    header = {key: value for key, value in {**VALID_PUSH, **changed}.items() if key not in dropped - changed.keys()}
    header = msgpack.unpackb(msgpack.packb({"op": "push", **header}), strict_map_key=False)  # as it arrives
    try:
        push = Push.decode(header)
        push.check_payload([b"12345678"])
    except ProtocolError:
        return
    assert isinstance(push.count, int) and not isinstance(push.count, bool) and push.count >= 0
    assert push.nbytes == 8 or push.shm is not None
    assert all(isinstance(d, int) and not isinstance(d, bool) for d in push.signature["shape"])


@settings(max_examples=300, deadline=None)
@given(values)
def test_integer_accepts_only_integers_in_range(value):
    try:
        got = fields.integer({"x": value}, "x", 0, 1000)
    except ProtocolError:
        assert isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000
        return
    assert got is value and 0 <= got <= 1000


@settings(max_examples=200, deadline=None)
@given(values)
def test_text_and_lists(value):
    for read in (lambda m: fields.text(m, "x", 10), lambda m: fields.integers(m, "x", 3),
                 lambda m: fields.strings(m, "x", 3, 10), lambda m: fields.flag(m, "x"),
                 lambda m: fields.optional_integer(m, "x")):
        try:
            read({"x": value})
        except ProtocolError:
            pass


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), True, "7", 7.0, None, [], 1 << 64])
def test_the_attacks_of_the_issue_are_rejected(bad):
    with pytest.raises(ProtocolError, match="'x'"):
        fields.integer({"x": bad}, "x")


def test_missing_fields_and_defaults():
    with pytest.raises(ProtocolError, match="missing"):
        fields.integer({}, "x")
    assert fields.integer({}, "x", default=5) == 5
    assert fields.optional_integer({"x": None}, "x") is None
    assert fields.text({"x": "abc"}, "x", 3) == "abc"
    with pytest.raises(ProtocolError, match="more than 3"):
        fields.text({"x": "abcd"}, "x", 3)


@settings(max_examples=300, deadline=None)
@given(values)
def test_number_accepts_only_finite_numbers(value):
    import math
    try:
        got = fields.number({"x": value}, "x")
    except ProtocolError:
        assert isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) > fields.MAX_INT
        return
    assert isinstance(got, float) and math.isfinite(got)
