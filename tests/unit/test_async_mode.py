"""mode='async' chosen and refused in-process (no job); training with servers is in
tests/clusters/test_async_training.py."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import mxnet_plugin as bps
from bps_gossip import runtime
from bps_gossip.errors import ConfigError
from mxnet_plugin.modes import AsyncMode, mode_class


def params() -> mx.gluon.ParameterDict:
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    return net.collect_params()


def test_byteps_enable_async_picks_async(monkeypatch):
    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    monkeypatch.setenv("BYTEPS_ENABLE_ASYNC", "1")
    runtime.remember(None)  # the environment is read once per process: read it again
    assert mode_class(None) is AsyncMode
    assert mode_class("async") is AsyncMode
    with pytest.raises(ValueError, match="mode='gossip' conflicts with BYTEPS_ENABLE_ASYNC=1"):
        mode_class("gossip")


def test_byteps_enable_async_beside_another_mode_is_a_config_error(monkeypatch):
    monkeypatch.setenv("BYTEPS_ENABLE_ASYNC", "1")
    monkeypatch.setenv("BPS_GOSSIP_MODE", "allreduce")
    runtime.remember(None)
    with pytest.raises(ConfigError, match="BYTEPS_ENABLE_ASYNC=1 .* BPS_GOSSIP_MODE='allreduce'"):
        mode_class(None)
    monkeypatch.setenv("BPS_GOSSIP_MODE", "async")
    runtime.remember(None)
    assert mode_class(None) is AsyncMode


@pytest.fixture
def one_worker():
    """A job of one worker in this process (no servers)."""
    bps.init()
    yield
    bps.shutdown()


def test_async_takes_no_compression_and_no_overlap_backward(one_worker):
    with pytest.raises(ValueError, match="mode='async' .* no compression_params"):
        bps.DistributedTrainer(params(), "sgd", compression_params={"compressor": "onebit"}, mode="async")
    with pytest.raises(ValueError, match="overlap_backward"):
        bps.DistributedTrainer(params(), "sgd", mode="async", overlap_backward=True)


def test_one_worker_without_servers_trains_locally(one_worker):
    net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
    net.initialize(mx.init.Constant(1.0))
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, mode="async")
    assert trainer.mode == "async"
    with mx.autograd.record():
        loss = net(mx.nd.ones((1, 2))).sum()
    loss.backward()
    trainer.step(1)
    trainer.flush()
    assert np.allclose(net.weight.data().asnumpy(), 0.5)


class FakeRuntime:
    """What the async mode asks of a runtime: that it has an engine (servers)."""

    engine = True


def test_the_stored_weights_are_taken_again_after_resume_or_an_elastic_change(monkeypatch, one_worker):
    """The first update inits (takes) the stored weights; later ones only add, until the runtime is a new
    one (suspend() then resume()), the generation changes or reset_world() is called."""
    from bps_gossip.futures import done_future
    from mxnet_plugin.modes import async_mode

    pushes, state = [], {"runtime": FakeRuntime(), "generation": 1}

    def store(array, name, init=False, instance=0, out=None, priority=0):
        pushes.append("init" if init else "add")
        np.copyto(out, 7.0 if init else array)  # the stored weights: 7 after an init
        return done_future(out)

    monkeypatch.setattr(async_mode, "store_push_pull_async", store)
    monkeypatch.setattr(async_mode, "peek", lambda: state["runtime"])
    monkeypatch.setattr(async_mode.core, "generation", lambda: state["generation"])
    net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
    net.initialize(mx.init.Constant(1.0))
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, mode="async")

    def step() -> list[str]:
        del pushes[:]
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 2))).sum()
        loss.backward()
        trainer.step(1)
        return list(pushes)

    assert step() == ["init", "add"]
    assert step() == ["add"]
    state["runtime"] = FakeRuntime()  # resume(): a new runtime
    assert step() == ["init", "add"]
    state["generation"] = 2  # an elastic change
    assert step() == ["init", "add"]
    trainer.reset_world()
    assert step() == ["init", "add"]
    assert step() == ["add"]
