"""Optimizer states and update counters carried across a save and a load, in-process, for every
state-carrying optimizer of MXNet 1.9.1 (issue 46): what GluonState (elastic), broadcast_optimizer_states
and load_optimizer_states give a rank must continue the run exactly as if it had never stopped.

The counters are the trap: MXNet keeps one count table per device and each ``Updater.__call__``
points ``optimizer._index_update_count`` back at it, so replacing that attribute alone was undone at the
next update and Adam (bias correction) went on with the old counts.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

from mxnet_plugin.checkpoints import optimizer_counters, set_updater_states, states_to_host

OPTIMIZERS = {
    "sgd": {"momentum": 0.9, "wd": 1e-4}, "nag": {"momentum": 0.9}, "adam": {}, "nadam": {}, "adamax": {},
    "rmsprop": {}, "rmsprop_centered": {"centered": True}, "adagrad": {}, "adadelta": {}, "ftml": {}, "ftrl": {},
    "signum": {}, "lamb": {}, "lars": {"momentum": 0.9},
}
STEPS = 5


def _net() -> mx.gluon.Block:
    mx.random.seed(3)
    # One prefix for every net, as every rank's process names its own: the trainer numbers the
    # parameters in the order of their names, and dense9_ / dense10_ sort the other way round.
    net = mx.gluon.nn.HybridSequential(prefix="counters_")
    with net.name_scope():
        net.add(mx.gluon.nn.Dense(8, activation="relu", in_units=6), mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier())
    return net


def _trainer(net: mx.gluon.Block, name: str) -> mx.gluon.Trainer:
    options = dict(OPTIMIZERS[name])
    return mx.gluon.Trainer(net.collect_params(), name.split("_")[0], {"learning_rate": 0.01, **options},
                            kvstore=None)


def _steps(net: mx.gluon.Block, trainer: mx.gluon.Trainer, steps: range) -> None:
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for step in steps:
        rs = np.random.RandomState(step)
        x, y = mx.nd.array(rs.standard_normal((4, 6))), mx.nd.array(rs.randint(0, 3, 4))
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(4)


def _weights(net: mx.gluon.Block) -> list[np.ndarray]:
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_loaded_rank_continues_the_run_exactly(name):
    straight = _net()
    trainer = _trainer(straight, name)
    _steps(straight, trainer, range(2 * STEPS))

    first = _net()
    first_trainer = _trainer(first, name)
    _steps(first, first_trainer, range(STEPS))
    saved = ({i: states_to_host(s) for i, s in first_trainer._updaters[0].states.items()},
             optimizer_counters(first_trainer._optimizer))

    second = _net()  # a fresh rank: its own trainer, the parameters and the states given to it
    for mine, theirs in zip(second.collect_params().values(), first.collect_params().values()):
        mine.set_data(theirs.data())
    second_trainer = _trainer(second, name)
    _steps(second, second_trainer, range(1))  # it has states and counters of its own to overwrite
    for mine, theirs in zip(second.collect_params().values(), first.collect_params().values()):
        mine.set_data(theirs.data())
    set_updater_states(second_trainer._updaters, *saved)
    _steps(second, second_trainer, range(STEPS, 2 * STEPS))

    assert optimizer_counters(second_trainer._optimizer) == optimizer_counters(trainer._optimizer)
    for got, want in zip(_weights(second), _weights(straight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_counters_survive_the_next_update():
    """The regression itself: counters set, then one update through MXNet's Updater."""
    net = _net()
    trainer = _trainer(net, "adam")
    _steps(net, trainer, range(3))
    set_updater_states(trainer._updaters, None, {"num_update": 40, "devices": [[0, {0: 40, 1: 40, 2: 40, 3: 40}]]})
    _steps(net, trainer, range(1))
    assert trainer._optimizer.num_update == 41
    assert set(trainer._optimizer._index_update_count.values()) == {41}
