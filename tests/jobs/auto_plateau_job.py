"""mode='auto' following the loss given to step() (tests/clusters/test_auto_plateau.py): a
model_zoo CNN trains in mode='auto' on fixed step times; each rank reports the mode history, the
window losses the policy saw and this rank sent, its own losses and a digest of its weights."""

from __future__ import annotations

import dataclasses

import mxnet as mx
import numpy as np
from auto_job_helpers import batch, digest, zoo_model
from job_tools import report, run

import mxnet_plugin as bps
from mxnet_plugin.modes.auto_policy import AutoPolicy, Decision


class Forced(AutoPolicy):
    """The real rule on fixed step times (gossip 0.55x allreduce's), or always gossip; records
    each window's loss in ``seen``."""

    drifted = True  # as if the last exact average had found the ranks apart (an exact average is not due here)

    def __init__(self, seen: list, plateau: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen, self.follow = seen, plateau

    def choose_mode(self, window):
        self.seen.append(window.loss)
        window = dataclasses.replace(window, seconds_per_step=0.055 if window.mode == "gossip" else 0.1,
                                     routing_changed=False, slow_lateness=0.0)
        decision = super().choose_mode(window)
        return decision if self.follow else Decision("gossip", "the test gossips")


def watch(mode, plateau):
    """Put Forced in the auto mode ``mode`` and record the window losses sent: (seen, sent)."""
    seen, sent = [], []
    window_loss = mode.window_loss

    def watched_loss():
        sent.append(window_loss())
        return sent[-1]
    mode.window_loss = watched_loss
    mode.policy = Forced(seen, plateau, window=mode.window)
    return seen, sent


def gossip_step(trainer, mode, rank, step, loss, losses):
    """One step giving the loss (NDArray on rank 0, number on rank 1); rank 1 lies from step 9,
    step 0 first gives a string: what that raised, or None."""
    refused = None
    if step == 9 and rank == 1:
        mode.average_seconds = -1.0  # a lie: no window after this one can be decided on
    if step == 0:
        try:
            trainer.step(2, loss="0.5")  # refused before anything happens: the step is taken again
        except TypeError as error:
            refused = str(error)
    losses.append(float(loss.mean().asscalar()))
    trainer.step(2, loss=loss if rank == 0 else losses[-1])  # an NDArray, or a number
    return refused


def train(model: str, steps: str, plateau: str, hybridize: str) -> None:
    """``steps`` steps of ``model`` on random batches in mode='auto' (``plateau``: a loss that never falls)."""
    plateau_run = plateau == "True"
    bps.init()
    rank = bps.rank()
    net = zoo_model(model, rank, hybridize == "True")
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                     mode="auto")
    mode = trainer.mode_object
    seen, sent = watch(mode, plateau_run)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(rank)
    losses, refused = [], None
    for step in range(int(steps)):
        x, y = batch(rng, 2)
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if plateau_run:
            # a loss that never falls (an NDArray on rank 0, a number on rank 1): a plateau after 5 windows' steps
            trainer.step(2, loss=loss * 0 + 1.0 if rank == 0 else 1.0)
        else:
            refused = gossip_step(trainer, mode, rank, step, loss, losses) or refused
    report({"history": list(trainer.mode_history), "seen": seen, "sent": sent, "losses": losses,
            "end": digest(net), "refused": refused})
    bps.shutdown()


run({"train": train})
