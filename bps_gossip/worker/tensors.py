"""Tensor checks, keys from names, and partitioning: everything the engine needs to know
about an array before it goes on the wire."""

from __future__ import annotations

import hashlib

import numpy as np

SUPPORTED_DTYPES = tuple(
    np.dtype(t) for t in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64")
)
_BITS_OF = {1: np.dtype("uint8"), 2: np.dtype("uint16"), 4: np.dtype("uint32"), 8: np.dtype("uint64")}


def key_of(name: str) -> int:
    """The stable 63-bit key of a tensor name: the same on every rank, whatever the
    declaration order (the server keeps the name to detect a collision)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_name(name: object, where: str) -> str:
    """Return ``name`` if it is a non-empty string, else raise ValueError naming ``where``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tensor needs a non-empty string name, got {name!r}")
    return name


def check_array(array: object, name: str, where: str) -> np.ndarray:
    """Return ``array`` as an ndarray of a supported dtype (a numpy scalar becomes a 0-d
    array), else raise TypeError."""
    if isinstance(array, np.generic):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{where}({name!r}): expected a numpy.ndarray, got {type(array).__name__}")
    if array.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{where}({name!r}): dtype {array.dtype} is not supported (use one of {names})")
    return array


def check_out(out: np.ndarray, array: np.ndarray, name: str, where: str) -> np.ndarray:
    """Check that ``out`` can receive the result of ``array`` (same shape and dtype, writable, contiguous)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{where}({name!r}): out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(
            f"{where}({name!r}): out has {out.dtype} {out.shape} but the tensor is {array.dtype} {array.shape}"
        )
    if not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError(f"{where}({name!r}): out must be writable and C-contiguous")
    return out


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype of the same width: summing zeros and one value in it is bit-exact."""
    return _BITS_OF[np.dtype(dtype).itemsize]


