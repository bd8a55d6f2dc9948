"""mode='auto' at work (tests/clusters/test_auto_mode.py): mobilenet0.25 trains in mode='auto',
on the measured step times or switching every window; each rank reports the mode history and,
for every step, the mode that ran, a digest of its weights and the loss."""

from __future__ import annotations

import mxnet as mx
import numpy as np
from auto_job_helpers import batch, digest, zoo_model
from job_tools import report, run

import mxnet_plugin as bps
from mxnet_plugin.modes.auto_policy import Decision


class Alternate:
    """Every window the other mode: each switch is exercised."""

    def decide(self, window):
        return Decision("gossip" if window.mode == "allreduce" else "allreduce", "the test alternates")

    def reset(self):
        pass


def train(policy: str, steps: str, hybridize: str) -> None:
    """``steps`` steps in mode='auto' under ``policy`` ("measured": the real one; "alternate")."""
    bps.init()
    rank = bps.rank()
    net = zoo_model("mobilenet0.25", rank, hybridize == "True")
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                     mode="auto", route_slow_links=False)  # no slow rank: decisions at once
    assert trainer.mode == "auto" and trainer.active_mode == "gossip"
    if policy == "alternate":
        trainer.mode_object.policy = Alternate()
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(rank)
    ran = []
    for _ in range(int(steps)):
        x, y = batch(rng, 4)
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(4)
        trainer.flush()
        # BatchNorm's running statistics stay each rank's own in allreduce: digest() leaves them out
        ran.append([trainer.active_mode, digest(net), float(loss.mean().asscalar())])
    report({"history": trainer.mode_history, "steps": ran})
    bps.shutdown()


run({"train": train})
