"""Encoding of the Python values an elastic job syncs, without pickle.

The state sync sends rank 0's values through the servers; anybody who can push could
put bytes there, and unpickling them would run their code on every worker. So values
travel as msgpack with two extension types: numpy arrays (dtype, shape, raw bytes;
numeric and boolean dtypes only, never ``object``) and tuples (kept apart from lists).
Decoding builds nothing else: a payload is data or a :class:`ProtocolError`.

Supported: None, bool, int (64-bit), float, str, bytes, list, tuple, dict (str or int
keys), numpy arrays and numpy scalars (which come back as 0-d arrays' items, i.e. numpy
scalars). Anything else is a TypeError at ``encode`` naming the type.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from ..errors import ProtocolError

ARRAY, TUPLE, SCALAR = 1, 2, 3
ALLOWED_KINDS = "biufc"  # bool, int, uint, float, complex: never object, void or strings
MAX_DIMS = 32


def encode(value: Any) -> bytes:
    """msgpack bytes of ``value`` (see the module docstring for what is supported)."""
    try:
        return msgpack.packb(value, default=_extend, use_bin_type=True, strict_types=True)
    except (TypeError, OverflowError, ValueError) as exc:
        raise TypeError(f"cannot send {exc} (supported: None, bool, int, float, str, bytes, "
                        "list, tuple, dict, numpy arrays and scalars)") from None


def decode(data: bytes) -> Any:
    """The value ``encode`` made; ProtocolError for anything that is not such a payload."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False, use_list=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"elastic state: undecodable payload: {exc}") from None


def _extend(value: Any) -> msgpack.ExtType:
    if isinstance(value, tuple):
        return msgpack.ExtType(TUPLE, encode(list(value)))
    if isinstance(value, np.ndarray):
        return msgpack.ExtType(ARRAY, _array_bytes(value))
    if isinstance(value, np.generic):
        return msgpack.ExtType(SCALAR, _array_bytes(np.asarray(value)))
    for base in (bool, int, float, str, bytes, list, dict):  # subclasses (IntEnum, OrderedDict...)
        if isinstance(value, base):
            return base(value)
    raise TypeError(f"a {type(value).__name__}")


def _array_bytes(array: np.ndarray) -> bytes:
    if array.dtype.kind not in ALLOWED_KINDS:
        raise TypeError(f"a numpy array of dtype {array.dtype}")
    header = {"dtype": array.dtype.str, "shape": list(array.shape)}
    return msgpack.packb([header, np.ascontiguousarray(array).tobytes()], use_bin_type=True)


def _ext(code: int, data: bytes) -> Any:
    if code == TUPLE:
        items = decode(data)
        if not isinstance(items, list):
            raise ProtocolError("elastic state: a tuple that is not a list of items")
        return tuple(items)
    if code in (ARRAY, SCALAR):
        array = _array(data)
        return array[()] if code == SCALAR else array
    raise ProtocolError(f"elastic state: unknown extension type {code}")


def _array(data: bytes) -> np.ndarray:
    parts = msgpack.unpackb(data, raw=False)
    if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], dict) and isinstance(parts[1], bytes)):
        raise ProtocolError("elastic state: malformed array")
    header, raw = parts
    dtype = np.dtype(str(header.get("dtype")))
    shape = header.get("shape")
    if dtype.kind not in ALLOWED_KINDS or dtype.hasobject:
        raise ProtocolError(f"elastic state: arrays of dtype {dtype} are not accepted")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ProtocolError(f"elastic state: malformed array shape {shape!r}")
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(raw):
        raise ProtocolError(f"elastic state: {len(raw)} bytes do not hold {dtype} {tuple(shape)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
