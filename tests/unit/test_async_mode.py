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
