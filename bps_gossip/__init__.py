"""bps_gossip: a BytePS-style parameter server with gossip averaging (framework-free core).

The core speaks numpy; ``mxnet_plugin`` binds it to MXNet and Gluon.
"""

from .allgather import allgather
from .api import (
    barrier,
    commit_check,
    declare,
    generation,
    init,
    is_elastic,
    is_initialized,
    job_config,
    local_rank,
    local_size,
    plan_servers,
    rank,
    reset,
    server_stats,
    shared_buffer,
    shutdown,
    size,
)
from .collectives import (
    broadcast,
    broadcast_async,
    gather_rows,
    gather_rows_async,
    poll,
    push_pull,
    push_pull_async,
    synchronize,
)
from .config import Config, load_config
from .errors import (
    BpsGossipError,
    CommTimeoutError,
    ConfigError,
    HostsUpdatedInterrupt,
    JobFailedError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    RanksOutOfStepError,
    ResumedInterrupt,
    TensorMismatchError,
    WorkersChangedError,
)
from .futures import Future as Handle  # what asynchronous calls return
from .objects import allgather_object, broadcast_object
from .suspension import resume, suspend
from .worker_comm import register as _register_defaults

_register_defaults()  # gossip and elastic use this worker unless given a link or comm

__version__ = "0.1.0"

__all__ = [
    "BpsGossipError", "CommTimeoutError", "Config", "ConfigError", "Handle", "HostsUpdatedInterrupt",
    "JobFailedError", "NotInitializedError", "PeerLostError", "ProtocolError", "RanksOutOfStepError", "ResumedInterrupt",
    "TensorMismatchError", "WorkersChangedError", "allgather", "allgather_object", "barrier", "broadcast", "broadcast_async", "broadcast_object", "commit_check",
    "declare", "gather_rows", "gather_rows_async", "generation", "init", "is_elastic", "is_initialized", "job_config", "load_config", "local_rank", "local_size",
    "plan_servers", "poll", "push_pull", "push_pull_async", "rank", "reset", "resume", "server_stats", "shared_buffer", "shutdown",
    "size", "suspend", "synchronize",
]
