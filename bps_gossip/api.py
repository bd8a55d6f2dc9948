"""The public core API: numpy arrays in, numpy arrays out.

``init()`` joins the job described by the environment (see :mod:`bps_gossip.config`);
with one worker and no BYTEPS_FORCE_DISTRIBUTED it runs alone, without servers, as
BytePS does. Every collective names its tensor; the name, not the call order,
identifies it on every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import threading
from typing import Any

import numpy as np

from .compat import zip_exact
from .compression import CompressionSpec, PartitionState, compress_on_worker, rng_for
from .config import Config, load_config
from .errors import ConfigError, JobEndedError, NotInitializedError
from .worker.engine import Engine, Operation
from .worker.handle import Handle
from .worker.tensors import bits_dtype, check_array, check_name, check_out, key_of, partitions
from .worker.trace import now_us


@dataclasses.dataclass
class _Runtime:
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


_runtime: _Runtime | None = None
_lock = threading.Lock()
_atexit_registered = False


def _rt(where: str) -> _Runtime:
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError(f"{where}: bps_gossip is not initialized; call init() first")
    return runtime


def init(config: Config | None = None) -> None:
    """Join the job: register with the scheduler and wait for every worker and server.

    Reads the environment when ``config`` is None. Calling it again is a no-op.
    Raises ConfigError for a bad environment (or a wrong job secret) and CommTimeoutError
    when no scheduler can be reached within BPS_GOSSIP_START_TIMEOUT (it may start later than
    this worker: pods minutes apart), or a reached one falls silent for BPS_GOSSIP_TIMEOUT.
    """
    global _runtime, _atexit_registered
    with _lock:
        if _runtime is not None:
            return
        config = load_config() if config is None else config
        if config.role != "worker":
            raise ConfigError(
                f"DMLC_ROLE={config.role}: init() is for workers; start a {config.role} with "
                f"'DMLC_ROLE={config.role} bpslaunch'"
            )
        if config.distributed:
            engine = Engine(config)
            try:
                book = engine.start()
            except JobEndedError as exc:
                exit_job_over(exc)
            _runtime = _Runtime(config, engine, book.rank, book.size, book.local_rank,
                                book.local_size, book.generation)
        else:
            _runtime = _Runtime(config, None, 0, 1, 0, 1, 0)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True


def shutdown() -> None:
    """Leave the job. Pending operations fail; the scheduler and servers exit once every
    worker has shut down. Safe to call twice."""
    _leave(crashed=False)


def _shutdown_at_exit() -> None:
    # An uncaught exception is a crash, not a graceful leave: an elastic job rolls back.
    _leave(crashed=hasattr(sys, "last_value"))


def _leave(crashed: bool) -> None:
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None and runtime.engine is not None:
        runtime.engine.stop(crashed=crashed)


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _runtime is not None


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
    runtime = _rt("declare()")
    check_name(name, "declare")
    key = runtime.declared.get(name)
    if key is None:
        key = key_of(name)
        other = runtime.keys.get(key)
        if other is not None and other != name:
            raise ConfigError(f"tensor names {other!r} and {name!r} hash to the same key; rename one")
        runtime.declared[name] = key
        runtime.keys[key] = name
    return key


def _local_result(array: np.ndarray, out: np.ndarray | None, what: str) -> Handle:
    result = np.array(array, copy=True) if out is None else out
    if out is not None and out is not array:
        np.copyto(out, array)
    handle = Handle(what)
    handle.set_result(result)
    return handle


def _submit(runtime: _Runtime, name: str, sig_kind: str, array: np.ndarray, send: np.ndarray,
            out: np.ndarray, wire: np.dtype, priority: int, finish: Any, what: str) -> Handle:
    engine = runtime.engine
    assert engine is not None
    handle = Handle(what)
    seq = engine.next_seq(name)
    op = Operation(
        handle=handle, name=name, key=declare(name), seq=seq,
        sig={"dtype": str(array.dtype), "shape": list(array.shape), "kind": sig_kind},
        send=send, out=out.reshape(-1).view(wire), result=out,
        parts=partitions(array.size, wire.itemsize, runtime.config.partition_bytes),
        priority=int(priority), finish=finish,
        traced=engine.tracer is not None and engine.tracer.traced(seq), submitted=now_us(),
    )
    engine.stage(op)
    engine.submit("op", op)
    return handle


def _submit_compressed(runtime: _Runtime, name: str, sig_kind: str, array: np.ndarray, out: np.ndarray,
                       spec: CompressionSpec, priority: int, finish: Any, what: str) -> Handle:
    """Compress every partition here (momentum, error feedback: per-partition state kept by
    the runtime), push the bytes, and decompress the merged bytes into ``out`` at the end."""
    engine = runtime.engine
    seq = engine.next_seq(name)
    submitted = now_us()
    tracer = engine.tracer if engine.tracer is not None and engine.tracer.traced(seq) else None
    flat = np.ascontiguousarray(array).reshape(-1)
    elements = partitions(array.size, array.dtype.itemsize, runtime.config.partition_bytes)
    codecs, chunks, parts, offset = [], [], [], 0
    for index, (start, count) in enumerate(elements):
        codec = spec.codec(count)
        state = runtime.compression_state.setdefault((name, index), PartitionState())
        began = now_us()
        chunks.append(compress_on_worker(spec, codec, flat[start:start + count], state, rng_for(spec.seed, index, seq, 0)))
        if tracer is not None:
            tracer.event(name, "COMPRESS", index, began, now_us())
        codecs.append((codec, spec.header(count)))
        parts.append((offset, codec.nbytes))
        offset += codec.nbytes
    send = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    merged = np.empty_like(send)
    result = out.reshape(-1)

    def decompress() -> None:
        began = now_us()
        for (start, count), (codec, _), (at, nbytes) in zip_exact(elements, codecs, parts):
            result[start:start + count] = codec.decompress(merged[at:at + nbytes])
        if tracer is not None:
            tracer.event(name, "DECOMPRESS", "total", began, now_us())
        if finish is not None:
            finish()

    handle = Handle(what)
    op = Operation(
        handle=handle, name=name, key=declare(name), seq=seq,
        sig={"dtype": str(array.dtype), "shape": list(array.shape), "kind": sig_kind},
        send=send, out=merged, result=out, parts=parts, priority=int(priority), finish=decompress,
        codecs=[header for _, header in codecs], traced=tracer is not None, submitted=submitted,
    )
    engine.submit("op", op)
    return handle


def push_pull_async(array: np.ndarray, name: str, average: bool = True, priority: int = 0,
                    version: int = 0, out: np.ndarray | None = None, layout: str | None = None,
                    compression: CompressionSpec | None = None) -> Handle:
    """Start a push_pull of ``array`` under ``name``; return a handle for ``synchronize``.

    Every worker pushes its array; each gets the sum (or the mean with ``average``; for
    integer dtypes the mean is floor-divided). ``out`` receives the result (``out=array``
    works in place); otherwise a new array is made. Do not change ``array`` before the
    handle completes. ``version`` is accepted for BytePS compatibility and not used:
    rounds are matched by how many times each rank has used the name. ``layout``
    describes what a flat array is made of (fused tensors): ranks must agree on it too,
    and a mismatch error shows it. ``compression`` compresses each partition of a float
    tensor of at least BYTEPS_MIN_COMPRESS_BYTES as BytePS does (see bps_gossip.compression):
    the result is then the decompressed, compressed sum, the same on every rank.
    """
    runtime = _rt("push_pull")
    check_name(name, "push_pull")
    array = check_array(array, name, "push_pull")
    if out is not None:
        check_out(out, array, name, "push_pull")
    what = f"push_pull({name!r})"
    if runtime.engine is None:
        return _local_result(array, out, what)
    if out is None:
        out = np.empty(array.shape, array.dtype)
    send = np.ascontiguousarray(array).reshape(-1)
    finish = None
    if average and runtime.size > 1:
        divide = np.floor_divide if array.dtype.kind in "iu" else np.true_divide
        size = runtime.size

        def finish() -> None:
            divide(out, out.dtype.type(size), out=out)

    kind = "mean" if average else "sum"
    if compression is not None and array.dtype.kind == "f" and array.nbytes >= runtime.config.min_compress_bytes:
        return _submit_compressed(runtime, name, f"{kind} compressed {compression.describe()}", array, out,
                                  compression, priority, finish, what)
    return _submit(runtime, name, kind if layout is None else f"{kind} of {layout}", array, send, out,
                   array.dtype, priority, finish, what)


def push_pull(array: np.ndarray, name: str, average: bool = True, priority: int = 0,
              version: int = 0, out: np.ndarray | None = None, layout: str | None = None,
              compression: CompressionSpec | None = None) -> np.ndarray:
    """Blocking push_pull: the sum (or mean) of ``array`` over all workers. See push_pull_async."""
    return synchronize(push_pull_async(array, name, average, priority, version, out, layout, compression))


def broadcast_async(array: np.ndarray, name: str, root_rank: int = 0,
                    out: np.ndarray | None = None, priority: int = 0) -> Handle:
    """Start a broadcast of root_rank's ``array``: non-root ranks push zeros, all sum.

    The sum runs on the raw bits (as unsigned integers), so the result is bit-exact for
    every dtype, -0.0 and NaN payloads included.
    """
    runtime = _rt("broadcast")
    check_name(name, "broadcast")
    array = check_array(array, name, "broadcast")
    if out is not None:
        check_out(out, array, name, "broadcast")
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) \
            or not 0 <= root_rank < runtime.size:
        raise ValueError(
            f"broadcast({name!r}): root_rank={root_rank!r} is not a rank of this job (size {runtime.size}) "
            f"[on rank {runtime.rank}]"
        )
    what = f"broadcast({name!r}, root_rank={root_rank})"
    if runtime.engine is None:
        return _local_result(array, out, what)
    if out is None:
        out = np.empty(array.shape, array.dtype)
    wire = bits_dtype(array.dtype)
    if runtime.rank == root_rank:
        send = np.ascontiguousarray(array).reshape(-1).view(wire)
    else:
        send = np.zeros(array.size, dtype=wire)
    return _submit(runtime, name, f"broadcast from root {int(root_rank)}", array, send, out, wire,
                   priority, None, what)


def broadcast(array: np.ndarray, name: str, root_rank: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Blocking broadcast: every rank gets root_rank's ``array`` bit for bit."""
    return synchronize(broadcast_async(array, name, root_rank, out))


def poll(handle: Handle) -> bool:
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``; return its result or raise its error."""
    return handle.wait(wait_timeout())


def barrier() -> None:
    """Block until every worker has reached the barrier."""
    runtime = _rt("barrier")
    if runtime.engine is None:
        return
    handle = Handle("barrier()")
    runtime.engine.submit("barrier", handle)
    synchronize(handle)


def server_stats() -> list[dict[str, Any]]:
    """Per-server counters (which keys and partitions each server summed); for tests and tuning."""
    runtime = _rt("server_stats")
    if runtime.engine is None:
        return []
    handle = Handle("server_stats()")
    runtime.engine.submit("stats", handle)
    return synchronize(handle)


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
    handle = Handle("reset()")
    runtime.engine.submit("rejoin", handle)
    book = handle.wait(runtime.config.elastic_timeout + runtime.config.timeout + 10)
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
        runtime.engine.submit("finished", None)


def holds_state() -> None:
    """Elastic: this worker now holds the job's state (``elastic.run`` calls it after a sync)."""
    runtime = _rt("holds_state()")
    if runtime.engine is not None:
        runtime.engine.has_state = True


def commit_check() -> bool:
    """Elastic: True when workers wait to join, the same answer on every rank (a barrier).

    Called by ``State.commit()``; a True answer means the caller must reset (no rollback).
    """
    runtime = _rt("commit_check()")
    if runtime.engine is None:
        return False
    handle = Handle("commit_check()")
    runtime.engine.submit("commit", handle)
    return synchronize(handle)


def wait_timeout() -> float:
    """The backstop for waits on handles: the engine itself fails them after BPS_GOSSIP_TIMEOUT."""
    runtime = _runtime
    return 3 * runtime.config.timeout + 10 if runtime is not None else 60.0


class PeerLink:
    """Worker-to-worker messages for gossip (used by bps_gossip.gossip; not a user API)."""

    def __init__(self, runtime: _Runtime) -> None:
        self._engine = runtime.engine
        self.rank = runtime.rank
        self.size = runtime.size
        self.max_bytes = runtime.config.max_message_bytes

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Send ``arrays`` to worker ``dst``; do not modify them afterwards."""
        assert self._engine is not None, "no peers in a one-worker job"
        for index, array in enumerate(arrays):  # a peer's socket drops larger frames
            if array.nbytes > self.max_bytes:
                raise ValueError(f"gossip {header.get('tag')!r}: array {index} has {array.nbytes} bytes, more than "
                                 f"BPS_GOSSIP_MAX_MESSAGE_BYTES={self.max_bytes} that peers accept")
        self._engine.submit("peer_send", (dst, header, arrays, None))

    def is_local(self, dst: int) -> bool:
        """Whether worker ``dst`` shares this host's memory (send_scaled then copies once)."""
        channel = self._engine.channel if self._engine is not None else None
        return channel is not None and channel.is_local(dst)

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        """Send ``scale * array`` for each array to worker ``dst``, which must be local
        (:meth:`is_local`): written straight into a shared-memory segment, one pass each."""
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += -(-array.nbytes // 64) * 64
        key = f"peer.{header.get('tag')}.{dst}"
        segment = self._engine.segments.acquire(key, total)
        views = []
        for array, offset in zip_exact(arrays, offsets):
            view = segment.view(array.dtype, array.size, offset)
            np.multiply(array.reshape(-1), array.dtype.type(scale), out=view)
            views.append(view)
        self._engine.submit("peer_send", (dst, header, views, (key, segment, offsets)))

    def consumed(self, received: dict[int, tuple[dict[str, Any], list[np.ndarray]]]) -> None:
        """The arrays of ``received`` (an expect() result) were read: let senders reuse their memory."""
        for src, (header, _) in received.items():
            if "shm" in header:
                self._engine.submit("peer_ack", (src, header["shm"]))

    def expect(self, tag: str, rnd: int, sources: list[int]) -> Handle:
        """A handle that completes with {source: (header, arrays)} once every source sent (tag, rnd)."""
        assert self._engine is not None, "no peers in a one-worker job"
        handle = Handle(f"gossip {tag!r} round {rnd}")
        self._engine.submit("peer_expect", (tag, rnd, list(sources), handle))
        return handle

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The exact sum (or mean) over all workers through the servers (the module's push_pull)."""
        return push_pull(array, name, average=average, out=out)

    def timeout(self) -> float:
        """The backstop for waits on expect()'s handles (the module's wait_timeout)."""
        return wait_timeout()


def peer_link() -> PeerLink:
    """The peer channel of this worker (internal, for gossip)."""
    return PeerLink(_rt("gossip"))
