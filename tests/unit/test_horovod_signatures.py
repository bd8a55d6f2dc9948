"""mxnet_plugin's Horovod collectives take horovod.mxnet's arguments in horovod.mxnet's order (a
script calling them positionally runs unchanged), and refuse what they cannot do before sending."""

from __future__ import annotations

import inspect

import mxnet as mx
import pytest

import mxnet_plugin as bps

# horovod/mxnet/mpi_ops.py and functions.py (0.28): the leading parameters, in order
HOROVOD = {
    "allgather": ["tensor", "name", "priority", "process_set"],
    "broadcast_object": ["obj", "root_rank", "name"],
    "allgather_object": ["obj", "name"],
    "allreduce": ["tensor", "average", "name", "priority", "prescale_factor", "postscale_factor", "process_set", "op"],
    "allreduce_": ["tensor", "average", "name", "priority", "prescale_factor", "postscale_factor", "process_set", "op"],
    "grouped_allreduce": ["tensors", "average", "name", "priority", "prescale_factor", "postscale_factor",
                          "process_set", "op"],
    "grouped_allreduce_": ["tensors", "average", "name", "priority", "prescale_factor", "postscale_factor",
                           "process_set", "op"],
}


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_horovods_argument_order(name):
    parameters = list(inspect.signature(getattr(bps, name)).parameters)
    assert parameters[:len(HOROVOD[name])] == HOROVOD[name]


def test_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="not both"):
        bps.grouped_allreduce([], True, op=bps.Sum)
    with pytest.raises(ValueError, match="'max' is not supported"):
        bps.grouped_allreduce([], op="max")
    with pytest.raises(NotImplementedError, match="process sets"):
        bps.allgather(mx.nd.ones((1,)), process_set=object())
    with pytest.raises(NotImplementedError, match="process sets"):
        bps.allgather_object(1, process_set=object())
    assert bps.grouped_allreduce([]) == []
