"""DistributedTrainer's start-up broadcast (tests/clusters/test_broadcast_once.py): a net with
deferred and given shapes trains 3 steps under a BytePS trace; each rank reports its parameters'
sums after the first step."""

from __future__ import annotations

import os

import mxnet as mx
from job_tools import report, run

import mxnet_plugin as bps


def three_steps() -> None:
    """3 steps in mode $TEST_MODE from values that differ by rank: each parameter's sum after the first."""
    bps.init()
    mx.random.seed(10 + bps.rank())  # different values on every rank: the broadcast makes them agree
    net = mx.gluon.nn.HybridSequential()
    # deferred shapes (the first Dense's weight), given shapes (the second Dense), and both kinds of bias
    net.add(mx.gluon.nn.Dense(8, activation="relu"), mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     mode=os.environ["TEST_MODE"])
    first = None
    for step in range(3):
        with mx.autograd.record():
            loss = net(mx.nd.ones((4, 5))).sum()
        loss.backward()
        trainer.step(4)
        if step == 0:
            first = {name: p.data().asnumpy().sum().item() for name, p in sorted(net.collect_params().items())}
    bps.shutdown()
    report(first)


run({"three_steps": three_steps})
