"""The state of this process's membership in a job, between ``init()`` and ``shutdown()``.

One object, set by :func:`bps_gossip.api.init`: the configuration, the engine (None when a
one-worker job runs alone), this worker's place in the job and its per-tensor bookkeeping.
The API modules read it through :func:`current`; the gossip and elastic cores never do
(they get a link passed in).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from .compression import PartitionState
from .config import Config
from .errors import ConfigError, NotInitializedError
from .worker.engine import Engine
from .worker.tensors import check_name, key_of


@dataclasses.dataclass
class Runtime:
    """This worker's membership (see the module docstring)."""

    config: Config
    engine: Engine | None
    rank: int
    size: int
    local_rank: int
    local_size: int
    generation: int
    declared: dict[str, int] = dataclasses.field(default_factory=dict)
    keys: dict[int, str] = dataclasses.field(default_factory=dict)
    # compressed push_pulls: each (name, partition)'s momentum and error feedback
    compression_state: dict[tuple[str, int], PartitionState] = dataclasses.field(default_factory=dict)

    def declare(self, name: str) -> int:
        """The key of tensor ``name`` (declared on first use; ConfigError on a hash collision)."""
        check_name(name, "declare")
        key = self.declared.get(name)
        if key is None:
            key = key_of(name)
            other = self.keys.get(key)
            if other is not None and other != name:
                raise ConfigError(f"tensor names {other!r} and {name!r} hash to the same key; rename one")
            self.declared[name] = key
            self.keys[key] = name
        return key

    def wait_timeout(self) -> float:
        """The backstop for waits on futures: the engine itself fails them after BPS_GOSSIP_TIMEOUT."""
        return 3 * self.config.timeout + 10


_current: Runtime | None = None
_read: Config | None = None  # the environment as this process last read it (init() or job_config())
lock = threading.Lock()  # held while init() and shutdown() change the current runtime


def current(where: str) -> Runtime:
    """The runtime, or NotInitializedError naming ``where``."""
    runtime = _current
    if runtime is None:
        raise NotInitializedError(f"{where}: bps_gossip is not initialized; call init() first")
    return runtime


def peek() -> Runtime | None:
    """The runtime, or None before init() and after shutdown()."""
    return _current


def replace(runtime: Runtime | None) -> Runtime | None:
    """Make ``runtime`` current (call with ``lock`` held); return the one it replaces."""
    global _current
    previous, _current = _current, runtime
    return previous


def process_config(read: Callable[[], Config]) -> Config:
    """The running job's Config, else the one this process read last, else ``read()`` once."""
    global _read
    runtime = _current
    if runtime is not None:
        return runtime.config
    if _read is None:
        _read = read()
    return _read


def remember(config: Config | None) -> None:
    """Keep ``config`` as this process's configuration (init() read or was given it); None: read
    the environment again at the next job_config()."""
    global _read
    _read = config
