"""allgather: every rank's array concatenated along the first dimension, in rank order
(Horovod's ``allgather``), built on :func:`~bps_gossip.collectives.gather_rows`.

Ranks may differ in the first dimension only. Two gathers do it: first each rank's
description (problem code, dtype, number of dimensions, shape) as one int64 row, then its
bytes, padded to the longest rank's and cut into pieces that fit one partition each. Every
rank decides from the same gathered descriptions, so a rank whose tensor is unusable, or
whose dtype or trailing shape differs, fails the call on every rank with the same message,
at once. Since the servers keep of each push only its sender's row, no rank can write into
another's part of the result. The data travels as raw bytes: the result is bit-exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .api import job_config, rank
from .collectives import gather_rows, gather_rows_async, synchronize
from .errors import TensorMismatchError
from .worker.tensors import SUPPORTED_DTYPES, check_name

MAX_DIMS = 32
HEADER = 3  # problem, dtype index, ndim; then MAX_DIMS dimensions
OK, NOT_AN_ARRAY, BAD_DTYPE, NO_DIMENSION, TOO_MANY_DIMS, MALFORMED = range(6)
PROBLEMS = {NOT_AN_ARRAY: "something that is not a numpy array", BAD_DTYPE: "a dtype that is not supported",
            NO_DIMENSION: "a 0-d array (allgather needs a first dimension)",
            TOO_MANY_DIMS: f"an array of more than {MAX_DIMS} dimensions", MALFORMED: "a malformed description"}
WINDOW = 16  # data pieces in flight at once (a server bounds the early pushes of a connection)


def _problem(array: Any) -> int:
    if not isinstance(array, np.ndarray):
        return NOT_AN_ARRAY
    if array.dtype not in SUPPORTED_DTYPES:
        return BAD_DTYPE
    if array.ndim == 0:
        return NO_DIMENSION
    return TOO_MANY_DIMS if array.ndim > MAX_DIMS else OK


def describe(array: Any) -> np.ndarray:
    """This rank's description row: [problem, dtype index, ndim, shape..., 0...] (int64)."""
    row = np.zeros(HEADER + MAX_DIMS, np.int64)
    row[0] = _problem(array)
    if row[0] == OK:
        row[1] = SUPPORTED_DTYPES.index(array.dtype)
        row[2] = array.ndim
        row[HEADER:HEADER + array.ndim] = array.shape
    return row


def _local_error(array: Any, problem: int, name: str, rank: int) -> Exception:
    where = f"allgather({name!r}) [on rank {rank}]"
    if problem == NOT_AN_ARRAY:
        return TypeError(f"{where}: expected a numpy.ndarray, got {type(array).__name__}")
    if problem == BAD_DTYPE:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        return TypeError(f"{where}: dtype {array.dtype} is not supported (use one of {names})")
    return ValueError(f"{where}: got {PROBLEMS[problem]}")


def _checked(row: np.ndarray) -> int:
    """The row's problem code; MALFORMED for a row no honest rank sends (it came over the wire)."""
    code, dtype, ndim = (int(v) for v in row[:HEADER])
    if code != OK:
        return code if code in PROBLEMS else MALFORMED
    if not (0 <= dtype < len(SUPPORTED_DTYPES) and 1 <= ndim <= MAX_DIMS) or (row[HEADER:] < 0).any() \
            or row[HEADER + ndim:].any():
        return MALFORMED
    return OK


def _shape_text(row: np.ndarray) -> str:
    trailing = ", ".join(str(int(d)) for d in row[HEADER + 1:HEADER + row[2]])
    return f"{SUPPORTED_DTYPES[row[1]]} (*{', ' if trailing else ''}{trailing})"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def agreed_layout(rows: np.ndarray, name: str, rank: int, array: Any = None
                  ) -> tuple[np.dtype, tuple[int, ...], list[int]]:
    """From every rank's description: (dtype, trailing shape, first dimensions by rank).

    The same exception on every rank when any rank's tensor is unusable, or when the ranks
    disagree on the dtype or the dimensions after the first (naming the ranks of each);
    the rank whose own tensor is unusable gets a TypeError or ValueError about it.
    """
    problems = {r: _checked(row) for r, row in enumerate(rows) if _checked(row) != OK}
    if problems.get(rank) is not None:
        raise _local_error(array, problems[rank], name, rank)
    if problems:
        told = "; ".join(f"rank {r} gave {PROBLEMS.get(code, f'problem {code}')}" for r, code in problems.items())
        raise TensorMismatchError(f"allgather({name!r}): {told} [on rank {rank}]")
    groups: dict[str, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(_shape_text(row), []).append(r)
    if len(groups) > 1:
        told = "; ".join(f"{_ranks_text(ranks)}: {text}" for text, ranks in groups.items())
        raise TensorMismatchError(f"allgather({name!r}): every rank's tensor must have the same dtype and the "
                                  f"same dimensions after the first; {told} [on rank {rank}]")
    first = rows[0]
    trailing = tuple(int(d) for d in first[HEADER + 1:HEADER + first[2]])
    return SUPPORTED_DTYPES[first[1]], trailing, [int(d) for d in rows[:, HEADER]]


def pieces(nbytes: int, ranks: int, partition_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) byte ranges of a row of ``nbytes`` such that ``ranks`` rows of one range
    fit one partition."""
    step = max(1, partition_bytes // max(1, ranks))
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _gather_bytes(mine: np.ndarray, ranks: int, name: str, priority: int) -> np.ndarray:
    """Every rank's ``mine`` (uint8, the same length on every rank): a (ranks, len) array."""
    ranges = pieces(mine.size, ranks, job_config().partition_bytes)
    out = np.empty((ranks, mine.size), np.uint8)
    for first in range(0, len(ranges), WINDOW):
        window = ranges[first:first + WINDOW]
        started = [gather_rows_async(mine[start:stop], f"{name}.data{first + i}", priority)
                   for i, (start, stop) in enumerate(window)]
        for (start, stop), future in zip(window, started):
            out[:, start:stop] = synchronize(future)
    return out


def allgather_parts(array: np.ndarray, name: str, priority: int = 0) -> list[np.ndarray]:
    """Every rank's ``array``, by rank, the same on every rank bit for bit: what
    :func:`allgather` concatenates (the checks and errors are the same)."""
    check_name(name, "allgather")
    if isinstance(array, np.generic):
        array = np.asarray(array)
    rows = gather_rows(describe(array), f"{name}.shape", priority)
    dtype, trailing, firsts = agreed_layout(rows, name, rank(), array)
    per_item = int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
    longest = max(firsts) * per_item
    if longest == 0:
        return [np.empty((first, *trailing), dtype) for first in firsts]
    mine = np.zeros(longest, np.uint8)
    own = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    mine[:own.size] = own
    gathered = _gather_bytes(mine, len(firsts), name, priority)
    return [gathered[r, :first * per_item].view(dtype).reshape(first, *trailing) for r, first in enumerate(firsts)]


def allgather(array: np.ndarray, name: str, priority: int = 0) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first dimension, in rank order (Horovod's
    allgather): the same on every rank, bit for bit.

    Ranks may differ in the first dimension; the dtype and the other dimensions must agree, or
    every rank raises :class:`TensorMismatchError` naming the ranks that differ (and the
    rank whose own tensor is not a supported numpy array of at least one dimension gets a
    TypeError or ValueError). Each rank sends the longest rank's size (its own padded), through
    pieces of at most BYTEPS_PARTITION_BYTES for all ranks together; ``name`` identifies the
    call, with ``.shape`` and ``.data<i>`` appended for its gathers.
    """
    return np.concatenate(allgather_parts(array, name, priority))
