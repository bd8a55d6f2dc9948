"""bps_gossip.config.load_config: defaults, every variable, and every bad value (pure, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from bps_gossip import Config, ConfigError, load_config

DIST = {"DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_PORT": "9000"}  # the minimum of a distributed worker


def test_defaults():
    config = load_config({})
    assert config == Config()
    assert config.role == "worker" and config.num_worker == 1 and config.num_server == 1
    assert config.root_uri == "127.0.0.1" and config.root_port is None and config.worker_id is None
    assert config.node_host == "127.0.0.1" and config.local_rank == 0 and config.local_size == 1
    assert config.partition_bytes == 4096000 and config.scheduling_credit == 4
    assert config.server_engine_threads == 2 and config.log_level == "WARNING"
    assert config.force_distributed is False and config.min_compress_bytes == 65536
    assert config.timeout == 60.0 and config.heartbeat_interval == 1.0 and config.heartbeat_timeout == 10.0
    assert config.port == 0 and config.shm is True
    assert config.distributed is False  # one worker runs alone, without scheduler or servers
    assert config.job_id == "0"


def test_empty_and_blank_values_mean_default():
    env = {name: "" for name in ("DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "BYTEPS_PARTITION_BYTES",
                                 "BPS_GOSSIP_TIMEOUT", "BYTEPS_LOG_LEVEL", "BYTEPS_FORCE_DISTRIBUTED")}
    env["DMLC_NUM_SERVER"] = "   "
    assert load_config(env) == Config()


def test_every_variable_is_parsed():
    config = load_config({
        "DMLC_ROLE": " Server ",
        "DMLC_NUM_WORKER": "3",
        "DMLC_NUM_SERVER": "2",
        "DMLC_PS_ROOT_URI": "10.1.2.3",
        "DMLC_PS_ROOT_PORT": " 1234 ",
        "DMLC_WORKER_ID": "2",
        "DMLC_NODE_HOST": "node7.example",
        "BYTEPS_LOCAL_RANK": "1",
        "BYTEPS_LOCAL_SIZE": "4",
        "BYTEPS_PARTITION_BYTES": "8192",
        "BYTEPS_SCHEDULING_CREDIT": "7",
        "BYTEPS_SERVER_ENGINE_THREAD": "5",
        "BYTEPS_LOG_LEVEL": "debug",
        "BYTEPS_FORCE_DISTRIBUTED": "TRUE",
        "BYTEPS_MIN_COMPRESS_BYTES": "1000",
        "BPS_GOSSIP_TIMEOUT": "2.5",
        "BPS_GOSSIP_HEARTBEAT_INTERVAL": "0.25",
        "BPS_GOSSIP_HEARTBEAT_TIMEOUT": "3",
        "BPS_GOSSIP_PORT": "5555",
        "BPS_GOSSIP_SHM": "off",
        "BPS_GOSSIP_STALL_TIMEOUT": "1",
        "BPS_GOSSIP_SERVER_IO_THREADS": "3",
    })
    assert config == Config(
        role="server", num_worker=3, num_server=2, root_uri="10.1.2.3", root_port=1234, worker_id=2,
        node_host="node7.example", local_rank=1, local_size=4, partition_bytes=8192, scheduling_credit=7,
        server_engine_threads=5, log_level="DEBUG", force_distributed=True, min_compress_bytes=1000,
        timeout=2.5, heartbeat_interval=0.25, heartbeat_timeout=3.0, port=5555, shm=False, stall_timeout=1.0,
        server_io_threads=3,
    )
    assert config.scheduler_address == "tcp://10.1.2.3:1234"
    assert config.job_id == "1234"


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("Yes", True), (" on ", True),
    ("0", False), ("false", False), ("NO", False), ("off", False), ("", False),
])
def test_booleans(value, expected):
    assert load_config({"BYTEPS_FORCE_DISTRIBUTED": value, "DMLC_PS_ROOT_PORT": "9000"}).force_distributed is expected
    assert load_config({"BPS_GOSSIP_SHM": value}).shm is expected


@pytest.mark.parametrize("role", ["worker", "server", "scheduler", "WORKER"])
def test_roles(role):
    env = {"DMLC_ROLE": role, "DMLC_PS_ROOT_PORT": "9000"}
    assert load_config(env).role == role.lower()


@pytest.mark.parametrize("level", ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL", "info"])
def test_log_levels(level):
    assert load_config({"BYTEPS_LOG_LEVEL": level}).log_level == level.upper()


def test_distributed_and_job_size():
    assert load_config(DIST).distributed
    assert load_config({"BYTEPS_LOCAL_SIZE": "2", "DMLC_PS_ROOT_PORT": "9000"}).distributed  # 1 machine x 2
    assert load_config({"BYTEPS_FORCE_DISTRIBUTED": "1", "DMLC_PS_ROOT_PORT": "9000"}).distributed
    assert not load_config({"DMLC_NUM_SERVER": "0"}).distributed  # local mode needs no server


def test_node_host_defaults():
    assert load_config({"DMLC_PS_ROOT_URI": "localhost"}).node_host == "127.0.0.1"
    assert load_config({"DMLC_PS_ROOT_URI": "127.0.0.5"}).node_host == "127.0.0.1"
    assert load_config({"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_NODE_HOST": "10.0.0.2"}).node_host == "10.0.0.2"


def test_boundaries_that_are_allowed():
    assert load_config({**DIST, "DMLC_PS_ROOT_PORT": "65535"}).root_port == 65535
    assert load_config({**DIST, "DMLC_PS_ROOT_PORT": "1"}).root_port == 1
    assert load_config({"BPS_GOSSIP_PORT": "65535"}).port == 65535
    assert load_config({"DMLC_NUM_WORKER": "3", "DMLC_WORKER_ID": "0", "DMLC_PS_ROOT_PORT": "9"}).worker_id == 0
    assert load_config({"BYTEPS_LOCAL_SIZE": "3", "BYTEPS_LOCAL_RANK": "2", "DMLC_PS_ROOT_PORT": "9"}).local_rank == 2
    assert load_config({"BYTEPS_PARTITION_BYTES": "1"}).partition_bytes == 1
    assert load_config({"BYTEPS_MIN_COMPRESS_BYTES": "0"}).min_compress_bytes == 0
    assert load_config({"DMLC_PS_ROOT_URI": "::1"}).root_uri == "::1"


def test_config_is_frozen():
    config = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0  # type: ignore[misc]


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("BYTEPS_PARTITION_BYTES", "12345")
    assert load_config().partition_bytes == 12345
    monkeypatch.setenv("DMLC_NUM_WORKER", "many")
    with pytest.raises(ConfigError, match="DMLC_NUM_WORKER"):
        load_config()


BAD = [
    # variable, value, extra environment
    ("DMLC_ROLE", "boss", {}),
    ("DMLC_NUM_WORKER", "abc", {}),
    ("DMLC_NUM_WORKER", "1.5", {}),
    ("DMLC_NUM_WORKER", "0", {}),
    ("DMLC_NUM_WORKER", "-2", {}),
    ("DMLC_NUM_SERVER", "two", {}),
    ("DMLC_NUM_SERVER", "-1", {}),
    ("DMLC_NUM_SERVER", "0", DIST),
    ("DMLC_PS_ROOT_URI", "tcp://10.0.0.1", {}),
    ("DMLC_PS_ROOT_URI", "host name", {}),
    ("DMLC_PS_ROOT_URI", "host:1234", {}),
    ("DMLC_PS_ROOT_PORT", "http", {}),
    ("DMLC_PS_ROOT_PORT", "0", {}),
    ("DMLC_PS_ROOT_PORT", "65536", {}),
    ("DMLC_PS_ROOT_PORT", "", {"DMLC_NUM_WORKER": "2"}),
    ("DMLC_PS_ROOT_PORT", "", {"DMLC_ROLE": "server"}),
    ("DMLC_PS_ROOT_PORT", "", {"DMLC_ROLE": "scheduler"}),
    ("DMLC_PS_ROOT_PORT", "", {"BYTEPS_FORCE_DISTRIBUTED": "1"}),
    ("DMLC_WORKER_ID", "x", {}),
    ("DMLC_WORKER_ID", "-1", {}),
    ("DMLC_WORKER_ID", "2", {"DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_PORT": "9"}),
    ("DMLC_NODE_HOST", "a/b", {}),
    ("DMLC_NODE_HOST", "a b", {}),
    ("BYTEPS_LOCAL_RANK", "one", {}),
    ("BYTEPS_LOCAL_RANK", "-1", {}),
    ("BYTEPS_LOCAL_RANK", "2", {"BYTEPS_LOCAL_SIZE": "2"}),
    ("BYTEPS_LOCAL_SIZE", "0", {}),
    ("BYTEPS_LOCAL_SIZE", "big", {}),
    ("BYTEPS_PARTITION_BYTES", "0", {}),
    ("BYTEPS_PARTITION_BYTES", "4MB", {}),
    ("BYTEPS_SCHEDULING_CREDIT", "0", {}),
    ("BYTEPS_SCHEDULING_CREDIT", "lots", {}),
    ("BYTEPS_SERVER_ENGINE_THREAD", "0", {}),
    ("BYTEPS_SERVER_ENGINE_THREAD", "2.0", {}),
    ("BYTEPS_LOG_LEVEL", "LOUD", {}),
    ("BYTEPS_FORCE_DISTRIBUTED", "maybe", {}),
    ("BYTEPS_FORCE_DISTRIBUTED", "2", {}),
    ("BYTEPS_MIN_COMPRESS_BYTES", "-1", {}),
    ("BYTEPS_MIN_COMPRESS_BYTES", "1k", {}),
    ("BPS_GOSSIP_TIMEOUT", "soon", {}),
    ("BPS_GOSSIP_TIMEOUT", "0", {}),
    ("BPS_GOSSIP_TIMEOUT", "-5", {}),
    ("BPS_GOSSIP_TIMEOUT", "nan", {}),
    ("BPS_GOSSIP_TIMEOUT", "inf", {}),
    ("BPS_GOSSIP_HEARTBEAT_INTERVAL", "fast", {}),
    ("BPS_GOSSIP_HEARTBEAT_INTERVAL", "0", {}),
    ("BPS_GOSSIP_HEARTBEAT_INTERVAL", "inf", {}),
    ("BPS_GOSSIP_HEARTBEAT_TIMEOUT", "-1", {}),
    ("BPS_GOSSIP_HEARTBEAT_TIMEOUT", "0.5", {}),  # not above the 1 s interval
    ("BPS_GOSSIP_HEARTBEAT_TIMEOUT", "1", {}),
    ("BPS_GOSSIP_PORT", "-1", {}),
    ("BPS_GOSSIP_PORT", "65536", {}),
    ("BPS_GOSSIP_PORT", "any", {}),
    ("BPS_GOSSIP_SHM", "sometimes", {}),
    ("BPS_GOSSIP_STALL_TIMEOUT", "-1", {}),
    ("BPS_GOSSIP_STALL_TIMEOUT", "60", {}),  # not below the 60 s BPS_GOSSIP_TIMEOUT
    ("BPS_GOSSIP_STALL_TIMEOUT", "soon", {}),
    ("BPS_GOSSIP_MODE", "fast", {}),
    ("BPS_GOSSIP_MAX_MESSAGE_BYTES", "1000", {}),
    ("BPS_GOSSIP_SECRET_FILE", "/nonexistent/secret", {}),
    ("BPS_GOSSIP_SERVER_IO_THREADS", "0", {}),
    ("BPS_GOSSIP_SERVER_IO_THREADS", "two", {}),
]


@pytest.mark.parametrize("var,value,extra", BAD, ids=[f"{v}={x!r}" for v, x, _ in BAD])
def test_bad_value_names_the_variable(var, value, extra):
    with pytest.raises(ConfigError) as info:
        load_config({**extra, var: value})
    assert var in str(info.value)
    if value.strip():
        assert value in str(info.value)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({"DMLC_NUM_WORKER": "abc"})


S1, S2 = "0123456789abcdef" * 2, "fedcba9876543210" * 2  # 128 bits each


def test_mode_and_secret():
    assert load_config({}).mode == "gossip" and load_config({"BPS_GOSSIP_MODE": " AllReduce "}).mode == "allreduce"
    assert load_config({}).keys is None
    keys = load_config({"BPS_GOSSIP_SECRET": S1}).keys
    assert keys is not None and keys == load_config({"BPS_GOSSIP_SECRET": S1}).keys
    assert keys != load_config({"BPS_GOSSIP_SECRET": S2}).keys
    assert S1 not in repr(load_config({"BPS_GOSSIP_SECRET": S1}))


def test_secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(S2 + "\nignored\n")
    assert load_config({"BPS_GOSSIP_SECRET_FILE": str(path)}).keys == load_config({"BPS_GOSSIP_SECRET": S2}).keys
    path.write_text("a" * 40 + "\n")
    with pytest.raises(ConfigError, match="BPS_GOSSIP_SECRET_FILE=.* is too weak"):
        load_config({"BPS_GOSSIP_SECRET_FILE": str(path)})


@pytest.mark.parametrize("env,why", [
    ({"BPS_GOSSIP_SECRET": "short"}, "too weak"),
    ({"BPS_GOSSIP_SECRET": "a" * 16}, "too weak"),  # issue 22: was accepted
    ({"BPS_GOSSIP_SECRET": "0123456789abcde"}, "too weak"),  # 15 hex digits: 60 bits
    ({"BPS_GOSSIP_SECRET": "ab" * 64}, "8 different characters"),
    ({"BPS_GOSSIP_SECRET": ""}, "set but blank"),  # issue 22: silently meant plain sockets
    ({"BPS_GOSSIP_SECRET": "   "}, "set but blank"),
    ({"BPS_GOSSIP_SECRET": S1, "BPS_GOSSIP_SECRET_FILE": "/x"}, "not both"),
])
def test_bad_secret_is_named_but_never_shown(env, why):
    with pytest.raises(ConfigError, match=why) as info:
        load_config(env)
    text = str(info.value)
    assert "BPS_GOSSIP_SECRET" in text and "short" not in text and "a" * 16 not in text and "abab" not in text
    if why == "too weak":
        assert "secrets.token_hex(32)" in text  # says how to make one


def test_the_environment_is_read_once_and_then_the_job_config_is_used(monkeypatch):
    """bps_gossip.job_config(): what the plugin reads every setting from. Before init() the
    environment is read once (a change after that is not seen); init() makes its Config the
    process's; mxnet_plugin's switches come from it (no module of the plugin parses a variable)."""
    import bps_gossip
    from bps_gossip import runtime

    monkeypatch.setenv("BPS_GOSSIP_MODE", "allreduce")
    monkeypatch.setenv("BPS_GOSSIP_OVERLAP_BACKWARD", "0")
    runtime.remember(None)
    try:
        assert bps_gossip.job_config().mode == "allreduce" and not bps_gossip.job_config().overlap_backward
        monkeypatch.setenv("BPS_GOSSIP_MODE", "auto")
        assert bps_gossip.job_config().mode == "allreduce"  # read once
        bps_gossip.init(load_config({"BPS_GOSSIP_MODE": "auto", "BPS_GOSSIP_SHM_GRADIENTS": "0"}))  # one worker: alone
        try:
            assert bps_gossip.job_config().mode == "auto" and not bps_gossip.job_config().shm_gradients
        finally:
            bps_gossip.shutdown()
        assert bps_gossip.job_config().mode == "auto"  # the last one init() took
    finally:
        runtime.remember(None)


def test_plugin_switches_are_config_fields():
    config = load_config({"BPS_GOSSIP_OVERLAP_BACKWARD": "0", "BPS_GOSSIP_SHM_GRADIENTS": "off"})
    assert not config.overlap_backward and not config.shm_gradients
    assert load_config({}).overlap_backward and load_config({}).shm_gradients
    with pytest.raises(ConfigError, match="BPS_GOSSIP_SHM_GRADIENTS='maybe'"):
        load_config({"BPS_GOSSIP_SHM_GRADIENTS": "maybe"})


def test_the_testing_hooks_refuse_outside_a_job():
    from bps_gossip import NotInitializedError, testing

    for hook in (testing.engine, testing.address_book, testing.host_link, testing.server_links, testing.segment_pool):
        with pytest.raises(NotInitializedError):
            hook()


@pytest.mark.parametrize("cpus", [1, 4, 16, 64])
def test_the_defaults_are_load_configs_on_any_machine(monkeypatch, cpus):
    """Config() and load_config({}) agree however many CPUs the process may use (the server's I/O
    threads were 2 in one and min(4, CPUs) in the other: 2 tests failed on 4, 16 or 64 CPUs)."""
    from bps_gossip import placement

    monkeypatch.setattr(placement, "usable_cpus", lambda: cpus)
    assert load_config({}) == Config()
    assert Config().server_io_threads == min(4, cpus)
