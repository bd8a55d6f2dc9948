"""DistributedTrainer's signature, its modes and GossipOptions, in-process (no job: every
check here fails before anything would reach bps_gossip's runtime). The modes at work
are in test_gossip_trainer.py, test_mxnet_training.py and test_mxnet_overlap.py."""

from __future__ import annotations

import dataclasses
import inspect
import re

import mxnet as mx
import pytest

import mxnet_plugin as bps
from bps_gossip import runtime
from bps_gossip.config import TRAINER_MODES
from bps_gossip.gossip.graphs import Ring
from mxnet_plugin.modes import (
    MODE_CLASSES,
    AllreduceMode,
    AsyncMode,
    AutoMode,
    GossipMode,
    GossipOptions,
    TrainerMode,
    mode_class,
)

# Every keyword DistributedTrainer took before the modes were split out (callers pass them).
KEYWORDS_BEFORE = ("params", "optimizer", "optimizer_params", "root_rank", "compression_params", "mode", "graph",
                   "peers_per_itr", "push_sum", "overlap", "synch_freq", "average_every", "overlap_backward",
                   "gossip_gamma")


def params() -> mx.gluon.ParameterDict:
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    return net.collect_params()


def test_positional_signature_is_byteps():
    names = list(inspect.signature(bps.DistributedTrainer).parameters)
    assert names[:5] == ["params", "optimizer", "optimizer_params", "root_rank", "compression_params"]
    assert names[5] == "mode"  # positional as before


def test_every_keyword_of_before_is_still_a_keyword():
    signature = inspect.signature(bps.DistributedTrainer)
    for name in KEYWORDS_BEFORE:
        assert name in signature.parameters or name in GossipOptions.names(), name
    assert set(GossipOptions.names()) == set(KEYWORDS_BEFORE[6:12]) | {"gossip_gamma", "route_slow_links"}


def test_a_bad_mode_is_named():
    with pytest.raises(ValueError, match=r"mode='bogus' is not one of \('gossip', 'allreduce', 'auto', 'async'\)"):
        bps.DistributedTrainer(params(), "sgd", mode="bogus")
    with pytest.raises(ValueError, match="mode=3"):
        bps.DistributedTrainer(params(), "sgd", None, 0, None, 3)


def test_an_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'graphs'.*gossip options: graph, "):
        bps.DistributedTrainer(params(), "sgd", mode="gossip", graphs="ring")


def test_gossip_options_must_be_gossip_options():
    with pytest.raises(TypeError, match="gossip_options must be a GossipOptions, got dict"):
        bps.DistributedTrainer(params(), "sgd", gossip_options={"graph": "ring"})


def test_the_modes_are_the_configs_modes():
    assert tuple(MODE_CLASSES) == TRAINER_MODES
    assert MODE_CLASSES == {"gossip": GossipMode, "allreduce": AllreduceMode, "auto": AutoMode, "async": AsyncMode}
    for cls in MODE_CLASSES.values():
        assert issubclass(cls, TrainerMode) and not inspect.isabstract(cls)


def test_default_mode_follows_the_job(monkeypatch):
    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    assert mode_class(None) is GossipMode
    monkeypatch.setenv("BPS_GOSSIP_MODE", "allreduce")
    runtime.remember(None)  # the environment is read once per process: read it again
    assert mode_class(None) is AllreduceMode
    assert mode_class("gossip") is GossipMode  # an explicit mode wins


def test_fp16_alone_picks_allreduce_with_a_warning(monkeypatch):
    monkeypatch.delenv("BPS_GOSSIP_MODE", raising=False)
    with pytest.warns(UserWarning, match="mode='allreduce'"):
        assert mode_class(None, None, fp16=True) is AllreduceMode


def test_gossip_options_defaults_and_normalization():
    options = GossipOptions()
    assert (options.graph, options.peers_per_itr, options.push_sum, options.overlap, options.synch_freq,
            options.average_every, options.gossip_gamma) == ("npdde", 1, True, False, 0, 0, None)
    loose = GossipOptions(overlap=1, push_sum=1, gossip_gamma=1)
    assert loose.overlap is True and loose.push_sum is True and isinstance(loose.gossip_gamma, float)
    ring = Ring(4)
    assert GossipOptions(graph=ring).graph is ring
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.graph = "ring"  # type: ignore[misc]


@pytest.mark.parametrize(("keywords", "named"), [
    ({"graph": "nope"}, "graph='nope'"),
    ({"graph": 3}, "graph=3"),
    ({"peers_per_itr": 0}, "peers_per_itr=0"),
    ({"peers_per_itr": 1.5}, "peers_per_itr=1.5"),
    ({"push_sum": "yes"}, "push_sum='yes'"),
    ({"overlap": 2}, "overlap=2"),
    ({"synch_freq": -1}, "synch_freq=-1"),
    ({"average_every": -1}, "average_every=-1"),
    ({"average_every": True}, "average_every=True"),
    ({"gossip_gamma": 0}, "gossip_gamma=0"),
    ({"gossip_gamma": 1.5}, "gossip_gamma=1.5"),
    ({"gossip_gamma": "0.5"}, "gossip_gamma='0.5'"),
    ({"push_sum": False, "overlap": True}, "overlap=True needs push_sum=True"),
])
def test_gossip_options_name_the_bad_one(keywords, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        GossipOptions(**keywords)
    with pytest.raises(ValueError, match=re.escape(named)):
        bps.DistributedTrainer(params(), "sgd", mode="gossip", **keywords)


def test_keywords_override_gossip_options():
    base = GossipOptions(graph="ring", average_every=4)
    merged = GossipOptions.merge(base, {"average_every": 2})
    assert (merged.graph, merged.average_every) == ("ring", 2) and base.average_every == 4
    assert GossipOptions.merge(None, {}) == GossipOptions()
