"""push_pull, broadcast and gather_rows: numpy arrays in, numpy arrays out, through the servers.

Every collective names its tensor; the name, not the call order, identifies it on every
rank. Each call builds an :class:`~bps_gossip.worker.operation.Operation` on the caller's
thread (checks, partitions, compression, the shared-memory copy) and hands it to the
engine in one command: the engine thread only sends and receives.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .compat import zip_exact
from .compression import CompressionSpec, PartitionState, compress_on_worker, rng_for
from .futures import Future, done_future, wait
from .protocol.data import partitions
from .runtime import Runtime, current, peek
from .worker import commands as cmd
from .worker.operation import Operation
from .worker.tensors import bits_dtype, check_array, check_name, check_out
from .worker.trace import now_us


def _local_result(array: np.ndarray, out: np.ndarray | None) -> Future:
    result = np.array(array, copy=True) if out is None else out
    if out is not None and out is not array:
        np.copyto(out, array)
    return done_future(result)


_SIGNATURES: dict[tuple[np.dtype, tuple[int, ...], str], dict[str, Any]] = {}
MAX_SIGNATURES = 4096  # (dtype, shape, kind) triples remembered; a job uses one per tensor


def _signature(array: np.ndarray, kind: str) -> dict[str, Any]:
    """What every rank's push of a round must agree on (the server compares it). Shared between
    operations and never changed: ``dtype.name`` alone costs ~3 us, a small push_pull's whole
    Python budget is a few hundred."""
    key = (array.dtype, array.shape, kind)
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= MAX_SIGNATURES:
            _SIGNATURES.clear()
        dtype = array.dtype
        sig = _SIGNATURES[key] = {"dtype": dtype.name if dtype.isnative else str(dtype),
                                  "shape": list(array.shape), "kind": kind}
    return sig


def _submit(runtime: Runtime, name: str, sig_kind: str, array: np.ndarray, send: np.ndarray,
            out: np.ndarray, wire: np.dtype, priority: int, finish: Callable[[], None] | None,
            rows: bool = False, root: int | None = None, **more: Any) -> Future:
    engine = runtime.engine
    seq = engine.next_seq(name)
    op = Operation(
        future=Future(), name=name, key=runtime.declare(name), seq=seq, sig=_signature(array, sig_kind),
        send=send, out=out.reshape(-1).view(wire), result=out,
        parts=partitions(array.size, wire.itemsize, runtime.config.partition_bytes),
        priority=int(priority), finish=finish,
        traced=engine.tracer is not None and engine.tracer.traced(seq), submitted=now_us(), rows=rows, root=root,
        **more,
    )
    engine.servers.stage(op)
    if not engine.push_now(op):  # sent from this thread when it can be (worker.server_links)
        engine.submit(cmd.Submit(op))
    return op.future


def _submit_compressed(runtime: Runtime, name: str, sig_kind: str, array: np.ndarray, out: np.ndarray,
                       spec: CompressionSpec, priority: int, finish: Callable[[], None] | None) -> Future:
    """Compress every partition here (momentum, error feedback: per-partition state kept by
    the runtime), push the bytes, and decompress the merged bytes into ``out`` at the end."""
    engine = runtime.engine
    seq = engine.next_seq(name)
    submitted = now_us()
    tracer = engine.tracer if engine.tracer is not None and engine.tracer.traced(seq) else None
    flat = np.ascontiguousarray(array).reshape(-1)
    elements = partitions(array.size, array.dtype.itemsize, runtime.config.partition_bytes)
    codecs, chunks, parts, out_parts, offset, out_offset = [], [], [], [], 0, 0
    for index, (start, count) in enumerate(elements):
        codec = spec.codec(count)
        state = runtime.compression_state.setdefault((name, index), PartitionState())
        began = now_us()
        chunks.append(compress_on_worker(spec, codec, flat[start:start + count], state, rng_for(spec.seed, index, seq, 0)))
        if tracer is not None:
            tracer.event(name, "COMPRESS", index, began, now_us())
        codecs.append((codec, spec.header(count)))
        parts.append((offset, codec.nbytes))
        out_parts.append((out_offset, codec.result_nbytes))  # MXNet's quantizers pull float32 sums
        offset += codec.nbytes
        out_offset += codec.result_nbytes
    send = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    merged = np.empty(out_offset, np.uint8)
    result = out.reshape(-1)

    def decompress() -> None:
        began = now_us()
        for (start, count), (codec, _), (at, nbytes) in zip_exact(elements, codecs, out_parts):
            result[start:start + count] = codec.decode_result(merged[at:at + nbytes])
        if tracer is not None:
            tracer.event(name, "DECOMPRESS", "total", began, now_us())
        if finish is not None:
            finish()

    op = Operation(
        future=Future(), name=name, key=runtime.declare(name), seq=seq, sig=_signature(array, sig_kind),
        send=send, out=merged, result=out, parts=parts, out_parts=out_parts, priority=int(priority), finish=decompress,
        codecs=[header for _, header in codecs], traced=tracer is not None, submitted=submitted,
    )
    engine.submit(cmd.Submit(op))
    return op.future


def _averaging(out: np.ndarray, size: int) -> Callable[[], None]:
    divide = np.floor_divide if out.dtype.kind in "iu" else np.true_divide

    def finish() -> None:
        divide(out, out.dtype.type(size), out=out)

    return finish


def push_pull_async(array: np.ndarray, name: str, average: bool = True, priority: int = 0,
                    version: int = 0, out: np.ndarray | None = None, layout: str | None = None,
                    compression: CompressionSpec | None = None) -> Future:
    """Start a push_pull of ``array`` under ``name``; return a future for ``synchronize``.

    Every worker pushes its array; each gets the sum (or the mean with ``average``; for
    integer dtypes the mean is floor-divided). ``out`` receives the result (``out=array``
    works in place); otherwise a new array is made. Do not change ``array`` before the
    future completes. ``version`` is accepted for BytePS compatibility and not used:
    rounds are matched by how many times each rank has used the name. ``layout``
    describes what a flat array is made of (fused tensors): ranks must agree on it too,
    and a mismatch error shows it. ``compression`` compresses each partition of a float
    tensor of at least BYTEPS_MIN_COMPRESS_BYTES as BytePS does (see bps_gossip.compression):
    the result is then the decompressed, compressed sum, the same on every rank.
    """
    runtime = current("push_pull")
    check_name(name, "push_pull")
    array = check_array(array, name, "push_pull")
    if out is not None:
        check_out(out, array, name, "push_pull")
    if runtime.engine is None:
        return _local_result(array, out)
    if out is None:
        out = np.empty(array.shape, array.dtype)
    finish = _averaging(out, runtime.size) if average and runtime.size > 1 else None
    kind = "mean" if average else "sum"
    if compression is not None and array.dtype.kind == "f" \
            and compression.compresses(array.nbytes, runtime.config.min_compress_bytes):
        return _submit_compressed(runtime, name, f"{kind} compressed {compression.describe()}", array, out,
                                  compression, priority, finish)
    send = np.ascontiguousarray(array).reshape(-1)
    return _submit(runtime, name, kind if layout is None else f"{kind} of {layout}", array, send, out,
                   array.dtype, priority, finish)


def push_pull(array: np.ndarray, name: str, average: bool = True, priority: int = 0,
              version: int = 0, out: np.ndarray | None = None, layout: str | None = None,
              compression: CompressionSpec | None = None) -> np.ndarray:
    """Blocking push_pull: the sum (or mean) of ``array`` over all workers. See push_pull_async."""
    return synchronize(push_pull_async(array, name, average, priority, version, out, layout, compression))


def broadcast_async(array: np.ndarray, name: str, root_rank: int = 0,
                    out: np.ndarray | None = None, priority: int = 0) -> Future:
    """Start a broadcast of root_rank's ``array``: non-root ranks push zeros, summed as raw bits,
    so the result is bit-exact for every dtype, -0.0 and NaN payloads included. A server takes
    of the pushes it gets only the root's (it knows the sender from its connection), so no rank
    that pushes to it can add into the root's array; reduced by host first, a host's leader
    passes on only its root's (or zeros), so only a lying leader reaches the sum.
    """
    runtime = current("broadcast")
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
    if runtime.engine is None:
        return _local_result(array, out)
    if out is None:
        out = np.empty(array.shape, array.dtype)
    wire = bits_dtype(array.dtype)
    if runtime.rank == root_rank:
        send = np.ascontiguousarray(array).reshape(-1).view(wire)
    else:
        send = np.zeros(array.size, dtype=wire)
    return _submit(runtime, name, f"broadcast from root {int(root_rank)}", array, send, out, wire, priority, None,
                   root=int(root_rank))


def broadcast(array: np.ndarray, name: str, root_rank: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Blocking broadcast: every rank gets root_rank's ``array`` bit for bit."""
    return synchronize(broadcast_async(array, name, root_rank, out))


def poll(handle: Future) -> bool:
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Future) -> Any:
    """Wait for ``handle``; return its result or raise its error."""
    return wait(handle, wait_timeout(), "synchronize")


def wait_timeout() -> float:
    """The backstop for waits on futures: the engine itself fails them after BPS_GOSSIP_TIMEOUT."""
    runtime = peek()
    return runtime.wait_timeout() if runtime is not None else 60.0


def gather_rows_async(row: np.ndarray, name: str, priority: int = 0) -> Future:
    """Start gathering every worker's ``row`` (1-d, the same length and dtype on every rank)
    under ``name``; the future's result is a (size, len(row)) array whose row r is rank r's, the
    same on every rank. The whole array must fit one partition (BYTEPS_PARTITION_BYTES)."""
    runtime = current("gather_rows")
    check_name(name, "gather_rows")
    row = check_array(row, name, "gather_rows")
    if row.ndim != 1:
        raise ValueError(f"gather_rows({name!r}): the row must be 1-d, not of shape {row.shape} "
                         f"[on rank {runtime.rank}]")
    if runtime.engine is None:
        return _local_result(row.reshape(1, -1), None)
    matrix = np.zeros((runtime.size, row.size), row.dtype)
    matrix[runtime.rank] = row
    if matrix.nbytes > runtime.config.partition_bytes:
        raise ValueError(f"gather_rows({name!r}): {runtime.size} rows of {row.nbytes} bytes are more than one "
                         f"partition ({runtime.config.partition_bytes} bytes) [on rank {runtime.rank}]")
    out = np.empty_like(matrix)
    return _submit(runtime, name, "rows", matrix, matrix.reshape(-1), out, matrix.dtype, priority, None, rows=True)


def gather_rows(row: np.ndarray, name: str, priority: int = 0) -> np.ndarray:
    """Blocking :func:`gather_rows_async`: every rank's ``row``, by rank."""
    return synchronize(gather_rows_async(row, name, priority))


def store_push_pull_async(array: np.ndarray, name: str, init: bool = False, instance: int = 0,
                          out: np.ndarray | None = None, priority: int = 0) -> Future:
    """Asynchronous training (BytePS's BYTEPS_ENABLE_ASYNC): add ``array`` (a float tensor: the change
    this worker's optimizer made to weights ``name``) to the servers' stored copy of them, and get
    the stored weights back, without waiting for any other worker. ``init=True`` starts the stored
    weights from ``array`` where no rank has yet (instance ``instance``), or gets them unchanged:
    every rank calls it once, before its first change, with the same weights. A larger
    ``instance`` replaces stored weights of the name (a new model under the same names). The
    tensor is partitioned over the servers as push_pull's is (bps_gossip.server.async_store).
    """
    runtime = current("store_push_pull")
    check_name(name, "store_push_pull")
    array = check_array(array, name, "store_push_pull")
    if array.dtype.kind != "f":
        raise TypeError(f"store_push_pull({name!r}): stored weights are floats, not {array.dtype} "
                        f"[on rank {runtime.rank}]")
    if out is not None:
        check_out(out, array, name, "store_push_pull")
    if runtime.engine is None:  # no servers: an init's weights are all there is; nothing stores a change
        if not init:
            raise ValueError(f"store_push_pull({name!r}): no servers store weights in a job that is not "
                             f"distributed (one worker without BYTEPS_FORCE_DISTRIBUTED)")
        return _local_result(array, out)
    if out is None:
        out = np.empty(array.shape, array.dtype)
    send = np.ascontiguousarray(array).reshape(-1)
    return _submit(runtime, name, "stored weights", array, send, out, array.dtype, priority, None,
                   store="init" if init else "add", instance=int(instance))


def store_push_pull(array: np.ndarray, name: str, init: bool = False, instance: int = 0,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Blocking :func:`store_push_pull_async`: the stored weights after this push."""
    return synchronize(store_push_pull_async(array, name, init, instance, out))
