"""MXNet's legacy FeedForward API with kvstore='bpsgossip' (tests/clusters/test_feedforward.py):
each rank trains on its shard from its own start, and a process of its own trains on the global
batch from root's; each rank reports how far apart the two ended."""

from __future__ import annotations

import logging
import warnings

import mxnet as mx
import numpy as np
from job_tools import report, run

import mxnet_plugin as bps

B, STEPS = 8, 4


def symbol():
    """A 20-16-5 MLP with a softmax output."""
    data = mx.sym.Variable("data")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.Activation(
        mx.sym.FullyConnected(data, num_hidden=16, name="fc1"), act_type="tanh"), num_hidden=5, name="fc2"),
        name="softmax")


def fit(net, x, y, batch, kvstore, arg_params):
    """One epoch of FeedForward on (x, y) from ``arg_params``: the trained values."""
    model = mx.model.FeedForward(net, ctx=mx.cpu(), num_epoch=1, optimizer="sgd", learning_rate=0.5,
                                 numpy_batch_size=batch, arg_params=arg_params, aux_params={},
                                 initializer=mx.init.Zero())
    model.fit(mx.io.NDArrayIter(x, y, batch_size=batch), kvstore=kvstore)
    return {name: value.asnumpy() for name, value in model.arg_params.items()}


def global_batch() -> None:
    """FeedForward on this rank's shard vs. one process on every shard's batches (batch B x size)."""
    warnings.simplefilter("ignore")  # FeedForward is deprecated in MXNet
    logging.getLogger().setLevel(logging.ERROR)
    bps.init()
    rank, size = bps.rank(), bps.size()
    rs = np.random.RandomState(0)
    X = rs.uniform(-1, 1, (size, STEPS * B, 20)).astype(np.float32)
    Y = rs.randint(0, 5, (size, STEPS * B)).astype(np.float32)
    net = symbol()
    start = {"fc1_weight": rs.uniform(-0.3, 0.3, (16, 20)), "fc1_bias": np.zeros(16),
             "fc2_weight": rs.uniform(-0.3, 0.3, (5, 16)), "fc2_bias": np.zeros(5)}
    # ranks start apart; the store gives every rank root's values (rank 0 holds `start`)
    mine = {name: mx.nd.array(value + rank) for name, value in start.items()}
    trained = fit(net, X[rank], Y[rank], B, "bpsgossip", mine)
    # one process: each step takes batch i of every shard, in rank order
    merged_x = np.concatenate([X[:, i * B:(i + 1) * B].reshape(-1, 20) for i in range(STEPS)])
    merged_y = np.concatenate([Y[:, i * B:(i + 1) * B].reshape(-1) for i in range(STEPS)])
    reference = fit(net, merged_x, merged_y, B * size, None, {k: mx.nd.array(v) for k, v in start.items()})
    report({"rank": rank, "max_difference": max(float(np.abs(trained[k] - reference[k]).max()) for k in start),
            "moved": max(float(np.abs(reference[k] - start[k]).max()) for k in start),
            "digest": float(sum(v.sum() for v in trained.values()))})
    bps.shutdown()


run({"global_batch": global_batch})
