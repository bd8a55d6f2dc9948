"""Settings the 'bpsgossip' KVStore would ignore silently are refused (issue 46): BYTEPS_ENABLE_ASYNC=1
(gluon.Trainer and Module trained synchronously under it) and MXNET_UPDATE_ON_KVSTORE=1 (updates on
servers that have no optimizer). In-process: the check runs before the store touches the job."""

from __future__ import annotations

import pytest

from bps_gossip import Config, ConfigError, load_config
from mxnet_plugin.unsupported import refuse_ignored_settings


def test_async_is_refused_naming_distributed_trainers_mode():
    with pytest.raises(ConfigError, match=r"BYTEPS_ENABLE_ASYNC=1: the 'bpsgossip' KVStore .* mode='async'"):
        refuse_ignored_settings(load_config({"BYTEPS_ENABLE_ASYNC": "1"}))


@pytest.mark.parametrize("value", ["1", "true", " ON "])
def test_update_on_kvstore_is_refused(value):
    with pytest.raises(ConfigError, match=r"MXNET_UPDATE_ON_KVSTORE=.*no server-side optimizer.*set it to 0"):
        refuse_ignored_settings(load_config({"MXNET_UPDATE_ON_KVSTORE": value}))


@pytest.mark.parametrize("env", [{}, {"MXNET_UPDATE_ON_KVSTORE": "0"}, {"MXNET_UPDATE_ON_KVSTORE": ""}])
def test_the_defaults_pass(env):
    refuse_ignored_settings(load_config(env))
    refuse_ignored_settings(Config())
