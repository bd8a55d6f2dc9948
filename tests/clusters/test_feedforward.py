"""MXNet's legacy FeedForward API with kvstore='bpsgossip' (issue 23, item 1): it decides gradient
scaling by the store's type as for dist_sync, so 2 workers with batch B each must train as one
process with batch 2B on both shards (SGD without momentum: the step is the mean gradient)."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

JOB = '''
import logging, warnings
import mxnet as mx, numpy as np
import mxnet_plugin as bps
warnings.simplefilter("ignore")  # FeedForward is deprecated in MXNet
logging.getLogger().setLevel(logging.ERROR)
bps.init()
rank, size = bps.rank(), bps.size()
B, STEPS = 8, 4
rs = np.random.RandomState(0)
X = rs.uniform(-1, 1, (size, STEPS * B, 20)).astype(np.float32)
Y = rs.randint(0, 5, (size, STEPS * B)).astype(np.float32)
data = mx.sym.Variable("data")
net = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.Activation(
    mx.sym.FullyConnected(data, num_hidden=16, name="fc1"), act_type="tanh"), num_hidden=5, name="fc2"), name="softmax")
start = {"fc1_weight": rs.uniform(-0.3, 0.3, (16, 20)), "fc1_bias": np.zeros(16),
         "fc2_weight": rs.uniform(-0.3, 0.3, (5, 16)), "fc2_bias": np.zeros(5)}


def train(x, y, batch, kvstore, arg_params):
    model = mx.model.FeedForward(net, ctx=mx.cpu(), num_epoch=1, optimizer="sgd", learning_rate=0.5,
                                 numpy_batch_size=batch, arg_params=arg_params, aux_params={},
                                 initializer=mx.init.Zero())
    model.fit(mx.io.NDArrayIter(x, y, batch_size=batch), kvstore=kvstore)
    return {name: value.asnumpy() for name, value in model.arg_params.items()}


# ranks start apart; the store gives every rank root's values (rank 0 holds `start`)
mine = {name: mx.nd.array(value + rank) for name, value in start.items()}
trained = train(X[rank], Y[rank], B, "bpsgossip", mine)
# one process: each step takes batch i of every shard, in rank order
merged_x = np.concatenate([X[:, i * B:(i + 1) * B].reshape(-1, 20) for i in range(STEPS)])
merged_y = np.concatenate([Y[:, i * B:(i + 1) * B].reshape(-1) for i in range(STEPS)])
reference = train(merged_x, merged_y, B * size, None, {k: mx.nd.array(v) for k, v in start.items()})
report({"rank": rank, "max_difference": max(float(np.abs(trained[k] - reference[k]).max()) for k in start),
        "moved": max(float(np.abs(reference[k] - start[k]).max()) for k in start),
        "digest": float(sum(v.sum() for v in trained.values()))})
bps.shutdown()
'''


@pytest.mark.timeout(120)
def test_feedforward_trains_as_one_process_on_the_global_batch(cluster):
    job = cluster(2)
    done = job.run_workers(JOB, timeout=100)
    assert_all_ok(done, job)
    results = [f.result for f in done]
    assert results[0]["digest"] == results[1]["digest"], results  # ranks identical
    assert all(r["moved"] > 1e-2 for r in results), results  # the comparison means something
    assert all(r["max_difference"] < 1e-5 for r in results), results
    job.wait_servers_exit()
