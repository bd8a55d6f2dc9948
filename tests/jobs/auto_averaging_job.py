"""mode='auto''s exact averages while gossip runs (tests/clusters/test_auto_averaging.py):
resnet18_v1 trains in gossip throughout (the real rule for exact averages), the learning rate
falls at step 8; each rank reports the mode history, a digest after each exact average and at
the end."""

from __future__ import annotations

import mxnet as mx
import numpy as np
from auto_job_helpers import batch, digest, zoo_model
from job_tools import report, run

import mxnet_plugin as bps
from mxnet_plugin.modes.auto_policy import AutoPolicy, Decision


class GossipOnly(AutoPolicy):
    """The real rule for exact averages; gossip whatever the step times."""

    def __init__(self, window):
        super().__init__(window=window)
        self.cost["allreduce"] = 1e-6  # as if measured, and cheap: the first exact average's price

    def choose_mode(self, window):
        super().choose_mode(window)
        return Decision("gossip", "the test gossips")


def averages() -> None:
    """14 steps of resnet18_v1 in mode='auto' gossiping, recording [step, digest] at each exact average."""
    bps.init()
    rank = bps.rank()
    net = zoo_model("resnet18_v1", rank, True)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                     mode="auto", route_slow_links=False)  # no slow rank: decisions at once
    mode = trainer.mode_object
    mode.policy = GossipOnly(window=mode.window)
    averaged = []
    average_exactly = mode.average_exactly

    def watched(step):
        average_exactly(step)
        averaged.append([step, digest(net)])
    mode.average_exactly = watched

    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(rank)
    for step in range(14):
        if step == 8:
            trainer.set_learning_rate(0.001)  # every rank: a step decay
        x, y = batch(rng, 2)
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(2)
    report({"history": list(trainer.mode_history), "averaged": averaged, "end": digest(net)})
    bps.shutdown()


run({"averages": averages})
