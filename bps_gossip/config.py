"""Every environment variable bps_gossip reads, parsed in one place into one frozen object.

BytePS / ps-lite names are used where BytePS has the knob; new knobs are BPS_GOSSIP_*.
A bad value raises :class:`ConfigError` naming the variable and the value.

Sizes follow BytePS: DMLC_NUM_WORKER counts worker *machines* (groups) and
BYTEPS_LOCAL_SIZE the worker processes on each, so the job's size is their product
when every machine runs the same number of processes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from . import placement
from .errors import ConfigError
from .host_groups import HOST_REDUCE_MODES
from .transport.addresses import INTERFACE_VAR, default_node_host, interface_address, is_ip
from .transport.security import JobKeys

ROLES = ("worker", "server", "scheduler")
TRAINER_MODES = ("gossip", "allreduce", "auto", "async")  # the first is the default
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def default_server_io_threads() -> int:
    """BPS_GOSSIP_SERVER_IO_THREADS when unset: the usable CPUs, at most 4."""
    return min(4, placement.usable_cpus())


@dataclasses.dataclass(frozen=True)
class Config:
    """The parsed environment of one process (worker, server or scheduler)."""

    role: str = "worker"
    num_worker: int = 1
    num_server: int = 1
    root_uri: str = "127.0.0.1"
    root_port: int | None = None
    worker_id: int | None = None
    node_host: str = "127.0.0.1"
    local_rank: int = 0
    local_size: int = 1
    partition_bytes: int = 4096000
    scheduling_credit: int = 4
    server_engine_threads: int = 2
    # ZeroMQ I/O threads of a server (CURVE encrypts on them): as many as the usable CPUs, up to 4,
    # the same default load_config gives (a fixed 2 made Config() != load_config({}) past 2 CPUs)
    server_io_threads: int = dataclasses.field(default_factory=default_server_io_threads)
    log_level: str = "WARNING"
    force_distributed: bool = False
    min_compress_bytes: int = 65536  # BytePS's default: smaller tensors go uncompressed
    timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    port: int = 0
    shm: bool = True
    host_reduce: str = "auto"  # workers on one host reduce first, one of them pushes (bps_gossip.host_groups)
    elastic: bool = False
    min_workers: int = 1
    max_workers: int = 0  # 0: no limit
    elastic_timeout: float = 60.0
    # Set by bpslaunch --join (BPS_GOSSIP_JOINER=1) once the job's scheduler answered its probe: a
    # scheduler that then does not answer this worker within seconds has exited (the job ended).
    joiner: bool = False
    # Elastic: a worker others have waited on this long in one round is removed (0: never).
    stall_timeout: float = 30.0
    start_timeout: float = 600.0  # the rendezvous must complete within this (every role)
    # ps-lite's DMLC_USE_KUBERNETES (Kubeflow's MXJob set it): the scheduler binds every interface,
    # since DMLC_PS_ROOT_URI names a Service that need not be an address of the scheduler's pod.
    use_kubernetes: bool = False
    trace_on: bool = False  # BytePS's BYTEPS_TRACE_*: write <trace_dir>/<local_rank>/comm.json
    trace_start: int = 10
    trace_end: int = 20
    trace_dir: str = "."
    mode: str = "gossip"  # DistributedTrainer's default: gossip (SGP), allreduce (BytePS), auto or async
    enable_async: bool = False  # BytePS's BYTEPS_ENABLE_ASYNC: mode async, and no other
    mxnet_update_on_kvstore: bool = False  # MXNet's MXNET_UPDATE_ON_KVSTORE set true: the 'bpsgossip' store refuses it
    auto_window: int = 10  # mode='auto': steps between decisions (mxnet_plugin.modes.auto)
    overlap_backward: bool = True  # the plugin's push_pulls run inside MXNet's engine (mxnet_plugin.overlap)
    shm_gradients: bool = True  # the plugin's gradients live in shared memory (mxnet_plugin.shared_gradients)
    max_message_bytes: int = 1 << 30  # the largest gossip array (a peer socket drops larger frames)
    keys: JobKeys | None = dataclasses.field(default=None, repr=False)  # CURVE, from BPS_GOSSIP_SECRET
    no_secret_noted: bool = False  # NO_SECRET_NOTED_VAR: the launcher said it once for the job
    placement: placement.Options = placement.Options()  # BPS_GOSSIP_COMM_CORES, BPS_GOSSIP_AFFINITY

    @property
    def scheduler_address(self) -> str:
        """The ZeroMQ endpoint of the scheduler."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    @property
    def bind_host(self) -> str:
        """Where servers' and workers' sockets bind: the address they advertise (DMLC_NODE_HOST,
        or DMLC_INTERFACE's, as ps-lite binds), or every interface under Kubernetes (they still
        advertise DMLC_NODE_HOST, which may then be a DNS name)."""
        return "0.0.0.0" if self.use_kubernetes else self.node_host

    @property
    def job_id(self) -> str:
        """Names this job's shared-memory segments (the scheduler's port is unique per host)."""
        return str(self.root_port or 0)

    @property
    def distributed(self) -> bool:
        """True when this worker must talk to servers (more than one worker, or forced)."""
        return self.force_distributed or self.elastic or self.num_worker * self.local_size > 1


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None:
        return None
    value = value.strip()
    return value if value != "" else None


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int | None = None) -> int | None:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, positive: bool = True) -> float:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number (seconds)") from None
    if not math.isfinite(value):  # inf would overflow every poll timeout
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds")
    if positive and not value > 0:
        raise ConfigError(f"{name}={raw!r} must be > 0")
    return value


# Set by bpslaunch for the scheduler of a job whose secret file it made: the scheduler removes the
# file when it ends (bpslaunch does too, unless it was killed).
OWNED_SECRET_VAR = "BPS_GOSSIP_SECRET_FILE_OWNED"
MIN_SECRET_BITS = 128
NO_SECRET_WARNING = ("no job secret (BPS_GOSSIP_SECRET and BPS_GOSSIP_SECRET_FILE unset): sockets are plain, and "
                     "anyone who reaches this job's ports can join it, push to it and read its results "
                     "(bpslaunch -np makes a secret per job; see README's Security section)")
MIN_SECRET_DISTINCT = 8  # 'abababab...' has the length but not the bits
MAKE_A_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"
# Set (to 1) by whoever starts a job's processes and has said once, for the whole job, that it
# runs without a secret (bpslaunch under srun or mpirun: task 0; scripts that start many jobs):
# the scheduler, servers and workers then do not say it again, one line each.
NO_SECRET_NOTED_VAR = "BPS_GOSSIP_NO_SECRET_NOTED"


def warn_if_no_secret(config: Config, log: logging.Logger) -> None:
    """Log NO_SECRET_WARNING at a process's start when its job has no secret, unless the
    launcher already said so for the job (NO_SECRET_NOTED_VAR)."""
    if config.keys is None and not config.no_secret_noted:
        log.warning(NO_SECRET_WARNING)


def _job_keys(env: Mapping[str, str]) -> JobKeys | None:
    """The CURVE keys of BPS_GOSSIP_SECRET, or of the first line of BPS_GOSSIP_SECRET_FILE.
    Set but blank, or too weak to resist guessing, is a ConfigError: never silently plain."""
    if "BPS_GOSSIP_SECRET" in env and _get(env, "BPS_GOSSIP_SECRET") is None:
        raise ConfigError("BPS_GOSSIP_SECRET is set but blank: unset it to run without a secret (plain sockets), "
                          f"or give one ({MAKE_A_SECRET})")
    secret, path = _get(env, "BPS_GOSSIP_SECRET"), _get(env, "BPS_GOSSIP_SECRET_FILE")
    if secret is not None and path is not None:
        raise ConfigError("set BPS_GOSSIP_SECRET or BPS_GOSSIP_SECRET_FILE, not both")
    source = "BPS_GOSSIP_SECRET"
    if path is not None:
        source = f"the first line of BPS_GOSSIP_SECRET_FILE={path!r}"
        try:
            with open(path, encoding="utf-8") as file:
                secret = file.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"BPS_GOSSIP_SECRET_FILE={path!r} cannot be read: {exc}") from None
    if secret is None:
        return None
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS or len(set(secret)) < MIN_SECRET_DISTINCT:
        raise ConfigError(f"{source} is too weak to keep others out ({len(secret)} characters, "
                          f"{len(set(secret))} different, about {bits:.0f} bits; at least {MIN_SECRET_BITS} bits "
                          f"and {MIN_SECRET_DISTINCT} different characters): make one with {MAKE_A_SECRET}")
    return JobKeys.from_secret(secret)


def secret_bits(secret: str) -> float:
    """A generous estimate of a secret's strength: its length times the bits of a character from
    the classes it uses (32 hex digits: 128 bits; 22 letters and digits: 131)."""
    if set(secret.lower()) <= set("0123456789abcdef"):
        pool = 16  # hex: 4 bits a character, whatever the case
    else:
        classes = [(str.islower, 26), (str.isupper, 26), (str.isdigit, 10)]
        pool = sum(size for test, size in classes if any(test(c) for c in secret))
        pool += 33 if any(not (c.islower() or c.isupper() or c.isdigit()) for c in secret) else 0
    return len(secret) * math.log2(max(pool, 2))


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive); the first when unset."""
    raw = _get(env, name)
    if raw is None:
        return choices[0]
    if raw.lower() not in choices:
        raise ConfigError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return raw.lower()


# Everything BPS_GOSSIP_HOST_REDUCE accepts (its error and README's table list them): modes, then booleans.
HOST_REDUCE_VALUES = (*HOST_REDUCE_MODES, *(v for v in (*_TRUE, *_FALSE) if v and v not in HOST_REDUCE_MODES))


def _host_reduce(env: Mapping[str, str]) -> str:
    """BPS_GOSSIP_HOST_REDUCE: auto (default), on or off; a boolean means on or off."""
    raw = _get(env, "BPS_GOSSIP_HOST_REDUCE") or "auto"
    if raw.lower() not in HOST_REDUCE_VALUES:
        raise ConfigError(f"BPS_GOSSIP_HOST_REDUCE={raw!r} must be one of {', '.join(HOST_REDUCE_VALUES)}")
    return raw.lower() if raw.lower() in HOST_REDUCE_MODES else ("on" if raw.lower() in _TRUE else "off")


def _mode(env: Mapping[str, str]) -> dict[str, Any]:
    """BPS_GOSSIP_MODE, and BytePS's BYTEPS_ENABLE_ASYNC=1, which means mode async (a clear error
    beside another mode)."""
    mode = _choice(env, "BPS_GOSSIP_MODE", TRAINER_MODES)
    enable_async = env_flag(env, "BYTEPS_ENABLE_ASYNC", False)
    if enable_async and _get(env, "BPS_GOSSIP_MODE") is not None and mode != "async":
        raise ConfigError(f"BYTEPS_ENABLE_ASYNC=1 asks for mode async, BPS_GOSSIP_MODE={mode!r} (set by bpslaunch "
                          "--mode, or by hand) for another: unset one of them")
    return {"mode": "async" if enable_async else mode, "enable_async": enable_async,
            "mxnet_update_on_kvstore": bool(env.get("MXNET_UPDATE_ON_KVSTORE", "").strip())
            and env_flag(env, "MXNET_UPDATE_ON_KVSTORE", False)}


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The boolean variable ``name`` of ``env`` (1/0, true/false, yes/no, on/off), or ConfigError."""
    raw = env.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def _host(env: Mapping[str, str], name: str, default: str) -> str:
    raw = _get(env, name)
    if raw is None:
        return default
    if any(c.isspace() for c in raw) or "/" in raw or ":" in raw and not is_ip(raw):
        raise ConfigError(f"{name}={raw!r} is not a host name or IP address")
    return raw


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Parse ``env`` (default: ``os.environ``) into a :class:`Config`.

    Raises :class:`ConfigError` naming the first variable with a bad value.
    """
    env = os.environ if env is None else env
    role = (_get(env, "DMLC_ROLE") or "worker").lower()
    if role not in ROLES:
        raise ConfigError(f"DMLC_ROLE={env.get('DMLC_ROLE')!r} must be one of {', '.join(ROLES)}")
    shape = _shape(env)
    log_level = (_get(env, "BYTEPS_LOG_LEVEL") or "WARNING").upper()
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"BYTEPS_LOG_LEVEL={env.get('BYTEPS_LOG_LEVEL')!r} must be one of {', '.join(LOG_LEVELS)}")
    port = _int(env, "BPS_GOSSIP_PORT", 0, minimum=0)
    if port > 65535:
        raise ConfigError(f"BPS_GOSSIP_PORT={port} is not a TCP port (0-65535)")
    config = Config(
        role=role,
        **shape,
        node_host=_node_host(env, shape["root_uri"], shape["root_port"]),
        partition_bytes=_int(env, "BYTEPS_PARTITION_BYTES", 4096000, minimum=1),
        scheduling_credit=_int(env, "BYTEPS_SCHEDULING_CREDIT", 4, minimum=1),
        server_engine_threads=_int(env, "BYTEPS_SERVER_ENGINE_THREAD", 2, minimum=1),
        server_io_threads=_int(env, "BPS_GOSSIP_SERVER_IO_THREADS", default_server_io_threads(), minimum=1),
        log_level=log_level,
        force_distributed=env_flag(env, "BYTEPS_FORCE_DISTRIBUTED", False),
        min_compress_bytes=_int(env, "BYTEPS_MIN_COMPRESS_BYTES", 65536, minimum=0),
        **_timeouts(env),
        port=port,
        shm=env_flag(env, "BPS_GOSSIP_SHM", True),
        host_reduce=_host_reduce(env),
        **_elastic(env, shape["num_worker"] * shape["local_size"]),
        start_timeout=_float(env, "BPS_GOSSIP_START_TIMEOUT", 600.0),
        use_kubernetes=env_flag(env, "DMLC_USE_KUBERNETES", False),
        **_trace(env),
        **_mode(env),
        auto_window=_int(env, "BPS_GOSSIP_AUTO_WINDOW", 10, minimum=1),
        overlap_backward=env_flag(env, "BPS_GOSSIP_OVERLAP_BACKWARD", True),
        shm_gradients=env_flag(env, "BPS_GOSSIP_SHM_GRADIENTS", True),
        max_message_bytes=_int(env, "BPS_GOSSIP_MAX_MESSAGE_BYTES", 1 << 30, minimum=1 << 20),
        keys=_job_keys(env),
        no_secret_noted=env_flag(env, NO_SECRET_NOTED_VAR, False),
        placement=placement.options(env),
    )
    if role != "worker" or config.distributed:
        if config.root_port is None:
            raise ConfigError(
                f"DMLC_PS_ROOT_PORT is not set (needed by the {role} to reach the scheduler "
                f"at DMLC_PS_ROOT_URI={config.root_uri})"
            )
        if config.num_server < 1:
            raise ConfigError(f"DMLC_NUM_SERVER={config.num_server} must be >= 1 for a distributed job")
    return config


def _node_host(env: Mapping[str, str], root_uri: str, root_port: int | None) -> str:
    """What this process advertises, in ps-lite's order: DMLC_NODE_HOST; else the IPv4 address of
    the interface DMLC_INTERFACE names (read only then, as ps-lite does: a bad one is a
    ConfigError listing the interfaces); else this host's default (default_node_host)."""
    explicit = _host(env, "DMLC_NODE_HOST", "")
    if explicit:
        return explicit
    interface = _get(env, INTERFACE_VAR)
    if interface is not None:
        return interface_address(interface)
    return default_node_host(root_uri, root_port)


def _shape(env: Mapping[str, str]) -> dict[str, Any]:
    """The job's shape and where the scheduler is: DMLC_* and BYTEPS_LOCAL_*."""
    num_worker = _int(env, "DMLC_NUM_WORKER", 1, minimum=1)
    num_server = _int(env, "DMLC_NUM_SERVER", 1, minimum=0)
    root_uri = _host(env, "DMLC_PS_ROOT_URI", "127.0.0.1")
    root_port = _int(env, "DMLC_PS_ROOT_PORT", None, minimum=1)
    if root_port is not None and root_port > 65535:
        raise ConfigError(f"DMLC_PS_ROOT_PORT={root_port} is not a TCP port (1-65535)")
    local_size = _int(env, "BYTEPS_LOCAL_SIZE", 1, minimum=1)
    local_rank = _int(env, "BYTEPS_LOCAL_RANK", 0, minimum=0)
    if local_rank >= local_size:
        raise ConfigError(
            f"BYTEPS_LOCAL_RANK={local_rank} must be smaller than BYTEPS_LOCAL_SIZE={local_size}"
        )
    worker_id = _int(env, "DMLC_WORKER_ID", None, minimum=0)
    if worker_id is not None and worker_id >= num_worker:
        raise ConfigError(f"DMLC_WORKER_ID={worker_id} must be smaller than DMLC_NUM_WORKER={num_worker}")
    return {"num_worker": num_worker, "num_server": num_server, "root_uri": root_uri, "root_port": root_port, "worker_id": worker_id, "local_rank": local_rank, "local_size": local_size}


def _timeouts(env: Mapping[str, str]) -> dict[str, float]:
    """Heartbeats, BPS_GOSSIP_TIMEOUT and the stall timeout below it."""
    heartbeat_interval = _float(env, "BPS_GOSSIP_HEARTBEAT_INTERVAL", 1.0)
    heartbeat_timeout = _float(env, "BPS_GOSSIP_HEARTBEAT_TIMEOUT", 10.0)
    if heartbeat_timeout <= heartbeat_interval:
        raise ConfigError(
            f"BPS_GOSSIP_HEARTBEAT_TIMEOUT={heartbeat_timeout} must exceed "
            f"BPS_GOSSIP_HEARTBEAT_INTERVAL={heartbeat_interval}"
        )
    timeout = _float(env, "BPS_GOSSIP_TIMEOUT", 60.0)
    stall_timeout = _float(env, "BPS_GOSSIP_STALL_TIMEOUT", timeout / 2, positive=False)
    if stall_timeout < 0 or stall_timeout >= timeout:
        raise ConfigError(f"BPS_GOSSIP_STALL_TIMEOUT={stall_timeout:g} must be >= 0 (0: off) and below "
                          f"BPS_GOSSIP_TIMEOUT={timeout:g}: waiting workers fail at the timeout")
    return {"heartbeat_interval": heartbeat_interval, "heartbeat_timeout": heartbeat_timeout,
            "timeout": timeout, "stall_timeout": stall_timeout}


def _elastic(env: Mapping[str, str], initial_workers: int) -> dict[str, Any]:
    """BPS_GOSSIP_ELASTIC and its bounds."""
    elastic = env_flag(env, "BPS_GOSSIP_ELASTIC", False)
    min_workers = _int(env, "BPS_GOSSIP_MIN_WORKERS", 1, minimum=1)
    max_workers = _int(env, "BPS_GOSSIP_MAX_WORKERS", 0, minimum=0)
    if max_workers and max_workers < min_workers:
        raise ConfigError(f"BPS_GOSSIP_MAX_WORKERS={max_workers} is below BPS_GOSSIP_MIN_WORKERS={min_workers}")
    if elastic and max_workers and initial_workers > max_workers:
        raise ConfigError(f"DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE = {initial_workers} initial workers "
                          f"exceed BPS_GOSSIP_MAX_WORKERS={max_workers}")
    return {"elastic": elastic, "min_workers": min_workers, "max_workers": max_workers, "elastic_timeout": _float(env, "BPS_GOSSIP_ELASTIC_TIMEOUT", 60.0),
            "joiner": elastic and env_flag(env, "BPS_GOSSIP_JOINER", False)}


def _trace(env: Mapping[str, str]) -> dict[str, Any]:
    """BytePS's BYTEPS_TRACE_*."""
    trace_start = _int(env, "BYTEPS_TRACE_START_STEP", 10, minimum=1)
    trace_end = _int(env, "BYTEPS_TRACE_END_STEP", 20, minimum=1)
    if trace_end <= trace_start:
        raise ConfigError(f"BYTEPS_TRACE_END_STEP={trace_end} must exceed BYTEPS_TRACE_START_STEP={trace_start}")
    return {"trace_on": env_flag(env, "BYTEPS_TRACE_ON", False), "trace_start": trace_start, "trace_end": trace_end, "trace_dir": _get(env, "BYTEPS_TRACE_DIR") or "."}
