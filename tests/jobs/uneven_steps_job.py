"""Ranks that wait for each other in different places (tests/clusters/test_uneven_steps.py):
2 workers train a Dense layer with DistributedTrainer in gossip mode; each scenario reports
[error class, message, seconds] of its work, "ok" if it raised nothing."""

from __future__ import annotations

import time

import mxnet as mx
import numpy as np
from job_tools import report, run

import bps_gossip
import mxnet_plugin as bps


class Trainer:
    """This rank's net, DistributedTrainer and constant batch (rank + 1.0)."""

    def __init__(self) -> None:
        bps.init()
        self.rank = bps.rank()
        self.net = mx.gluon.nn.Dense(4, in_units=3)
        self.net.initialize(mx.init.Constant(0.5))
        self.trainer = bps.DistributedTrainer(self.net.collect_params(), "sgd", {"learning_rate": 0.1})
        self.x = mx.nd.full((2, 3), self.rank + 1.0)

    def step(self):
        """One training step on the constant batch."""
        with mx.autograd.record():
            loss = self.net(self.x).sum()
        loss.backward()
        self.trainer.step(2)


def attempt(work):
    """Run work(); report [error class, message, seconds] ("ok" and "" if it raised nothing)."""
    began = time.monotonic()
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report([type(exc).__name__, str(exc), time.monotonic() - began])
        return False
    report(["ok", "", time.monotonic() - began])
    return True


def step_more() -> None:
    """Rank r takes 3 + r steps, then average_parameters()."""
    t = Trainer()

    def work():
        for _ in range(3 + t.rank):
            t.step()
        t.trainer.average_parameters()
    attempt(work)


def evaluate_alone() -> None:
    """4 steps; rank 0 sleeps 4 s (evaluating alone) before its third."""
    t = Trainer()

    def work():
        for index in range(4):
            if t.rank == 0 and index == 2:
                time.sleep(4)  # evaluating alone
            t.step()
    attempt(work)


def stop_early() -> None:
    """Rank r takes 3 + r steps and shuts down."""
    t = Trainer()

    def work():
        for _ in range(3 + t.rank):
            t.step()
    attempt(work)
    bps.shutdown()


def slow_by_turns(t, steps):
    """``steps`` steps, rank index % 2 sleeping 0.7 s before step ``index``."""
    for index in range(steps):
        if t.rank == index % 2:
            time.sleep(0.7)
        t.step()


def evaluate(t, inputs):
    """How many of ``inputs`` the net scores above 0."""
    return float((t.net(mx.nd.array(inputs)).asnumpy().sum(axis=1) > 0).sum())


def evaluation_patterns() -> None:
    """docs/gossip.md's evaluation patterns between steps slow by turns; then the final weights."""
    t = Trainer()

    def work():
        slow_by_turns(t, 2)
        # every rank evaluates its shard, one push_pull sums [correct, count]
        shard = np.random.RandomState(0).randn(40, 3)[t.rank::2]
        totals = mx.nd.array([evaluate(t, shard), len(shard)])
        bps.byteps_push_pull(totals, name="eval.totals", is_average=False)
        assert totals.asnumpy()[1] == 40, totals
        slow_by_turns(t, 2)
        if t.rank == 1:
            time.sleep(0.7)  # rank 0 waits in the average past the notice
        t.trainer.average_parameters()
        if t.rank == 0:
            time.sleep(4.5)  # evaluating alone, longer than BPS_GOSSIP_TIMEOUT
            evaluate(t, np.ones((4, 3)))
        bps_gossip.barrier()
        slow_by_turns(t, 2)
        t.trainer.average_parameters()
    attempt(work)
    report(t.net.weight.data().asnumpy().tolist())
    bps.shutdown()


run({"step_more": step_more, "evaluate_alone": evaluate_alone, "stop_early": stop_early,
     "evaluation_patterns": evaluation_patterns})
