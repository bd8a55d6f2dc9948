"""The public core API: joining and leaving a job, this worker's place in it, barriers and
the elastic hooks. The collectives themselves are in :mod:`bps_gossip.collectives`.

``init()`` joins the job described by the environment (see :mod:`bps_gossip.config`);
with one worker and no BYTEPS_FORCE_DISTRIBUTED it runs alone, without servers, as
BytePS does.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any, Iterable

import numpy as np

from . import placement
from . import runtime as _state
from .collectives import (  # noqa: F401 - the API's collectives, importable from here too
    broadcast,
    broadcast_async,
    gather_rows_async,
    poll,
    push_pull,
    push_pull_async,
    synchronize,
    wait_timeout,
)
from .config import Config, load_config
from .errors import ConfigError, JobEndedError
from .futures import Future, wait
from .logs import install_interrupt_summary
from .runtime import Runtime
from .worker import commands as cmd
from .worker import server_choice
from .worker.engine import Engine
from .worker.peer_link import PeerLink

_atexit_registered = False


def _rt(where: str) -> Runtime:
    """The runtime, or NotInitializedError naming ``where`` (tests and tools: bps_gossip.testing)."""
    return _state.current(where)


def init(config: Config | None = None) -> None:
    """Join the job: register with the scheduler and wait for every worker and server.

    Reads the environment when ``config`` is None. Calling it again is a no-op.
    Raises ConfigError for a bad environment (or a wrong job secret) and CommTimeoutError
    when no scheduler can be reached within BPS_GOSSIP_START_TIMEOUT (it may start later than
    this worker: pods minutes apart), or a reached one falls silent for BPS_GOSSIP_TIMEOUT.
    """
    global _atexit_registered
    with _state.lock:
        if _state.peek() is not None:
            return
        config = load_config() if config is None else config
        _state.remember(config)
        if config.role != "worker":
            raise ConfigError(
                f"DMLC_ROLE={config.role}: init() is for workers; start a {config.role} with "
                f"'DMLC_ROLE={config.role} bpslaunch'"
            )
        if config.distributed:
            install_interrupt_summary(_where, config.log_level)  # Ctrl-C: one line per worker
            placement.check_here(config.placement)  # a bad BPS_GOSSIP_COMM_CORES fails before joining
            threads = placement.thread_ids()  # those started from here on communicate
            engine = Engine(config)
            try:
                book = engine.start()
            except JobEndedError as exc:
                exit_job_over(exc)
            engine.log.info(placement.place_worker(config.placement, book.local_size, book.local_rank, threads))
            _state.replace(Runtime(config, engine, book.rank, book.size, book.local_rank,
                                   book.local_size, book.generation))
        else:
            _state.replace(Runtime(config, None, 0, 1, 0, 1, 0))
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True


def job_config() -> Config:
    """This process's configuration: the running job's, else the one init() last read or was
    given, else the environment read once. The plugin takes every setting from here: no other
    module parses the environment (bps_gossip.config does)."""
    return _state.process_config(load_config)


def _where() -> str:
    """'rank N' for this worker's messages (its rank may change in an elastic job)."""
    runtime = _state.peek()
    return "a worker with no rank (not in a job)" if runtime is None else f"rank {runtime.rank}"


def shutdown() -> None:
    """Leave the job. Pending operations fail; the scheduler and servers exit once every
    worker has shut down. Safe to call twice."""
    _leave(crashed=False)


def _shutdown_at_exit() -> None:
    # An uncaught exception is a crash, not a graceful leave: an elastic job rolls back.
    _leave(crashed=hasattr(sys, "last_value"))


def _leave(crashed: bool) -> None:
    with _state.lock:
        runtime = _state.replace(None)
    if runtime is not None and runtime.engine is not None:
        runtime.engine.stop(crashed=crashed)


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _state.peek() is not None


def rank() -> int:
    """This worker's rank in [0, size())."""
    return _rt("rank()").rank


def size() -> int:
    """The number of worker processes in the job."""
    return _rt("size()").size


def local_rank() -> int:
    """This worker's rank among the workers of its machine."""
    return _rt("local_rank()").local_rank


def local_size() -> int:
    """The number of worker processes on this machine."""
    return _rt("local_size()").local_size


def declare(name: str) -> int:
    """Declare a tensor name and return its key. Optional: collectives declare implicitly,
    and the order of declarations does not matter (keys come from the names)."""
    return _rt("declare()").declare(name)


def shared_buffer(nbytes: int) -> np.ndarray | None:
    """``nbytes`` of this worker's shared memory (a uint8 array that stays mapped while the process
    lives), or None where the job does not use shared memory (BPS_GOSSIP_SHM=0, no /dev/shm, a
    worker alone).

    An in-place push_pull (``out`` is the tensor) of an array that lies in it goes to servers and
    the host's leader on this host without a copy in or out: they read it there and write the sum
    back there. Like any push_pull's tensor it must not be changed while the push_pull runs. If
    one fails, the buffer stays usable memory but later push_pulls from it copy (a late write from
    a server must not land in memory that is in use again): ask for a new buffer to get that back.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"shared_buffer(): nbytes must be a positive int, not {nbytes!r}")
    runtime = _rt("shared_buffer()")
    pool = runtime.engine.segments if runtime.engine is not None else None
    return pool.lease(nbytes) if pool is not None else None


def _ask(where: str, command: type, empty: Any) -> Any:
    """Send a command whose only argument is its future, and wait for the answer."""
    runtime = _rt(where)
    if runtime.engine is None:
        return empty
    future: Future = Future()
    runtime.engine.submit(command(future))
    return wait(future, runtime.wait_timeout(), where)


def barrier() -> None:
    """Block until every worker has reached the barrier."""
    _ask("barrier()", cmd.Barrier, None)


def plan_servers(tensors: Iterable[tuple[str, Any]]) -> None:
    """Spread the partitions of these (name, array) tensors over the servers by bytes, largest
    first onto the least-loaded server, instead of by a hash of each name (which left one of 4
    servers half of resnet18_v1's bytes). Call it on every rank with the same tensors (in any
    order) before their first push_pull; a tensor already pushed raises ValueError.
    DistributedTrainer and the 'bpsgossip' KVStore plan their own steps."""
    config = _rt("plan_servers()").config
    sizes = [(name, int(array.size), np.dtype(array.dtype).itemsize) for name, array in tensors]
    server_choice.plan_servers(sizes, config.partition_bytes)


def server_stats() -> list[dict[str, Any]]:
    """Per-server counters (which keys and partitions each server summed); for tests and tuning."""
    return _ask("server_stats()", cmd.Stats, [])


def generation() -> int:
    """The membership generation this worker is in (1 at the start; elastic jobs count up)."""
    return _rt("generation()").generation


def is_elastic() -> bool:
    """True when this job changes membership instead of failing (BPS_GOSSIP_ELASTIC=1)."""
    return _rt("is_elastic()").config.elastic


def reset() -> bool:
    """Elastic: join the job's next generation after a WorkersChangedError.

    Blocks until every surviving (and joining) worker has done the same, then updates
    rank(), size() and generation(). Returns True when the job must roll back to its
    last commit (a worker or server crashed), the same answer on every rank. Raises
    JobFailedError when the job cannot go on, and JobEndedError when it finished training
    before this worker got its state.
    """
    runtime = _rt("reset()")
    if not runtime.config.elastic or runtime.engine is None:
        raise ConfigError("reset(): this job is not elastic (set BPS_GOSSIP_ELASTIC=1, or bpslaunch --min-np)")
    future: Future = Future()
    runtime.engine.submit(cmd.Rejoin(future))
    book = wait(future, runtime.config.elastic_timeout + runtime.config.timeout + 10, "reset()")
    runtime.rank, runtime.size, runtime.generation = book.rank, book.size, book.generation
    runtime.local_rank, runtime.local_size = book.local_rank, book.local_size
    return book.restore


def exit_job_over(exc: JobEndedError) -> None:
    """A joiner the finished job no longer needs: say so and exit with status 0 (not a failure:
    the job succeeded without it)."""
    print(f"bps_gossip: {exc}; nothing left to do, exiting with status 0", file=sys.stderr, flush=True)
    raise SystemExit(0) from None


def training_finished() -> None:
    """Elastic: this worker finished training (``elastic.run`` calls it when the training
    function returns). From now on the job admits no more workers, tells joiners that have
    no state yet that it is over, and no longer fails for being below BPS_GOSSIP_MIN_WORKERS."""
    runtime = _rt("training_finished()")
    if runtime.config.elastic and runtime.engine is not None:
        runtime.engine.submit(cmd.Finished())


def holds_state() -> None:
    """Elastic: this worker now holds the job's state (``elastic.run`` calls it after a sync)."""
    runtime = _rt("holds_state()")
    if runtime.engine is not None:
        runtime.engine.submit(cmd.HoldsState())


def commit_check() -> bool:
    """Elastic: True when workers wait to join, the same answer on every rank (a barrier).

    Called by ``State.commit()``; a True answer means the caller must reset (no rollback).
    """
    return _ask("commit_check()", cmd.Commit, False)


def peer_link() -> PeerLink:
    """The peer channel of this worker (internal, for gossip)."""
    runtime = _rt("gossip")
    return PeerLink(runtime.engine, runtime.rank, runtime.size, runtime.config.max_message_bytes,
                    push_pull_async, runtime.wait_timeout(), gather_rows_async)
