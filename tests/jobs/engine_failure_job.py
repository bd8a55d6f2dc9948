"""A training script with a user's off-by-one: rank 1 takes one step more than rank 0, and
nothing calls ``bps.shutdown()`` (as in README's snippet). Run under bpslaunch.

Usage: ``engine_failure_job.py ENTRY READ`` with ENTRY in allreduce (DistributedTrainer(
mode='allreduce')), kvstore (gluon.Trainer with the 'bpsgossip' KVStore); READ 1 to read the
weights after the loop (as saving or evaluating does), 0 to end without reading anything. The last
step of rank 1 has no partner: its push_pull fails inside MXNet's engine when rank 0 leaves. The
test (tests/clusters/test_engine_failures.py) checks that rank 1, and the job, exit non-zero with that error,
and that no rank reports NaN weights as trained.
"""

import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn

import mxnet_plugin as bps

ENTRY, READ = sys.argv[1], sys.argv[2] == "1"
STEPS = 3

bps.init()
rank = bps.rank()
mx.random.seed(rank)
net = nn.HybridSequential()
net.add(nn.Dense(16, activation="relu"), nn.Dense(4))
net.initialize()
net.hybridize()
if ENTRY == "kvstore":
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="bpsgossip")
else:
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, mode=ENTRY)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
data = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (8, 10)))
label = mx.nd.array(np.arange(8) % 4)
for _step in range(STEPS + rank):  # the off-by-one: rank 1 takes one step more
    with autograd.record():
        loss = loss_fn(net(data), label)
    loss.backward()
    trainer.step(8)
if READ:
    weights = [p.data().asnumpy() for p in net.collect_params().values()]
    print(f"TRAINED rank {rank} finite={all(np.isfinite(w).all() for w in weights)}", flush=True)
print(f"END rank {rank}", flush=True)
