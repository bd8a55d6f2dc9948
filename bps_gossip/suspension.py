"""suspend() and resume(): one worker steps out of an elastic job and comes back.

BytePS pauses a worker with ``suspend()`` and continues it with ``resume(num_workers,
num_servers)``. Here the job goes on while the worker is away: ``suspend()`` leaves it as
``shutdown()`` does (a graceful leave, no rollback for the others) and ``resume()`` joins it
again like ``bpslaunch --join``: admitted at the others' next ``state.commit()``, with a new
rank. Inside ``elastic.run`` resume() raises :class:`~bps_gossip.errors.ResumedInterrupt`, so
that ``run`` gives this worker rank 0's state before its training function goes on.

What cannot work is refused at once, before anything is left: a job that is not elastic fails
the others' rounds without this worker and has no way back in, and the only worker of a job
ends it by leaving.
"""

from __future__ import annotations

from typing import Callable  # typing's: collections.abc.Callable[...] needs 3.9

from . import api
from . import runtime as _state
from .config import Config
from .elastic.run import in_training_function
from .errors import ConfigError, PeerLostError, ResumedInterrupt
from .rendezvous import scheduler_answers

_suspended: list[Config] = []  # the configuration of the job this process left with suspend()


def suspend(leave: Callable[[], None] = api.shutdown) -> None:
    """Leave the elastic job for a while (the others go on); :func:`resume` joins it again.

    Raises ConfigError, leaving nothing, when the job is not elastic or this is its only worker.
    ``leave``: how to leave once allowed (the MXNet plugin first finishes its queued work).
    """
    runtime = _state.current("suspend()")
    config = runtime.config
    if runtime.engine is not None:
        if not config.elastic:
            raise ConfigError(
                f"suspend() on rank {runtime.rank}: this job is not elastic, so the other workers cannot go on "
                "without this one and it could not come back; start the job elastic (bpslaunch --min-np N, or "
                "BPS_GOSSIP_ELASTIC=1 for every role), or end this worker with shutdown()")
        if runtime.size < 2:
            raise ConfigError(f"suspend() on rank {runtime.rank}: this is the job's only worker; leaving would end "
                              "the job, and resume() would find no job to come back to")
    leave()
    _suspended[:] = [config]


def resume(num_workers: int | None = None, num_servers: int | None = None) -> None:
    """Join the job left by :func:`suspend` again, with the same settings.

    ``num_workers`` and ``num_servers`` are BytePS's: worker machines (DMLC_NUM_WORKER, not
    processes) and servers, after the cluster changed. Here the running job decides who is in
    it (the scheduler admits this worker beside whoever is there), so they are checked for type
    and not applied: passing ``size()`` does not make a bigger job.

    Blocks until admitted at the others' next commit. Inside ``elastic.run`` it then raises
    ResumedInterrupt (``run`` syncs this worker from rank 0); elsewhere it returns. Raises
    ConfigError when there was no suspend() or a count is not a positive whole number, and
    PeerLostError within seconds when no job answers any more; when the job finished training
    meanwhile the worker exits with status 0, as a joiner does (nothing left to do).
    """
    if api.is_initialized():
        raise ConfigError("resume(): this worker is in the job already (resume() follows suspend())")
    if not _suspended:
        raise ConfigError("resume(): no suspend() to resume from; call bps.init() to join a job")
    config = _suspended[0]
    _check_count("num_workers", num_workers, "worker machines")
    _check_count("num_servers", num_servers, "servers")
    if config.distributed and not scheduler_answers(config):
        raise PeerLostError(f"resume(): no job answers at {config.root_uri}:{config.root_port} any more (it "
                            "ended while this worker was suspended, or its scheduler was lost)")
    api.init(config)
    _suspended.clear()
    if in_training_function():
        raise ResumedInterrupt(f"rank {api.rank()} of {api.size()} resumed (generation {api.generation()})")


def _check_count(name: str, given: int | None, what: str) -> None:
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise ConfigError(f"resume({name}={given!r}): must be a positive whole number of {what}, or None")
