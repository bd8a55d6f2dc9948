"""allgather's decisions in-process (bps_gossip/allgather.py): what every rank concludes from the
gathered descriptions, the pieces that fit a partition; objects that cannot be sent fail on every
rank (bps_gossip.elastic.broadcast_object over fake comms)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeWorld, comms, run_ranks

from bps_gossip.allgather import agreed_layout, describe, pieces
from bps_gossip.elastic import broadcast_object
from bps_gossip.errors import TensorMismatchError


def _rows(*arrays):
    return np.stack([describe(a) for a in arrays])


def test_layout_of_agreeing_ranks():
    rows = _rows(np.zeros((1, 2, 3), np.float32), np.zeros((0, 2, 3), np.float32), np.zeros((4, 2, 3), np.float32))
    for rank in range(3):
        assert agreed_layout(rows, "t", rank) == (np.dtype(np.float32), (2, 3), [1, 0, 4])


def test_mismatch_names_the_ranks_on_every_rank():
    rows = _rows(np.zeros((1, 3)), np.zeros((2, 4)), np.zeros((3, 3)), np.zeros((1, 3), np.float32))
    messages = set()
    for rank in range(4):
        with pytest.raises(TensorMismatchError) as caught:
            agreed_layout(rows, "t", rank)
        messages.add(str(caught.value).split(" [on rank")[0])
    assert messages == {"allgather('t'): every rank's tensor must have the same dtype and the same dimensions "
                        "after the first; ranks 0, 2: float64 (*, 3); rank 1: float64 (*, 4); rank 3: float32 (*, 3)"}


def test_an_unusable_tensor_fails_every_rank():
    bad = [1, 2]
    rows = _rows(np.zeros((1,)), bad)
    with pytest.raises(TypeError, match="got list"):
        agreed_layout(rows, "t", 1, bad)
    with pytest.raises(TensorMismatchError, match="rank 1 gave something that is not a numpy array"):
        agreed_layout(rows, "t", 0)
    rows = _rows(np.zeros((1,)), np.zeros((1,), np.complex64), np.array(2.0, np.float32))
    with pytest.raises(TensorMismatchError, match="rank 1 gave a dtype that is not supported; rank 2 gave a 0-d"):
        agreed_layout(rows, "t", 0)


def test_a_malformed_description_is_refused():
    rows = _rows(np.zeros((1, 2)), np.zeros((1, 2)))
    rows[1, 1] = 99  # a dtype index no honest rank sends
    with pytest.raises(TensorMismatchError, match="rank 1 gave a malformed description"):
        agreed_layout(rows, "t", 0)
    rows = _rows(np.zeros((1, 2)), np.zeros((1, 2)))
    rows[1, 3 + 1] = -5
    with pytest.raises(TensorMismatchError, match="malformed"):
        agreed_layout(rows, "t", 0)


def test_pieces_fit_a_partition():
    assert pieces(10, 3, 12) == [(0, 4), (4, 8), (8, 10)]
    assert pieces(0, 3, 12) == []
    assert pieces(5, 4, 2) == [(i, i + 1) for i in range(5)]  # never a zero-length piece


def test_broadcast_object_that_cannot_be_sent_fails_every_rank():
    world = FakeWorld(3)
    ranks = comms(world)

    def body(rank):
        try:
            broadcast_object({1, 2} if rank == 1 else None, "o", root_rank=1, comm=ranks[rank])
        except TypeError as exc:
            return str(exc)
        return "no error"

    for message in run_ranks(3, body):
        assert "root rank 1 could not send its object: cannot send a set" in message, message


def test_broadcast_object_alone_checks_too():
    with pytest.raises(TypeError, match="a set"):
        broadcast_object({1}, "o", comm=comms(FakeWorld(1))[0])
    assert broadcast_object({"a": (1, 2)}, "o", comm=comms(FakeWorld(1))[0]) == {"a": (1, 2)}
