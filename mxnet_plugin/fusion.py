"""Tensor fusion for push_pull inside MXNet's engine: many small gradients, one message.

A network like mobilenet0.25 has ~80 gradients of a few KiB each. One push_pull per
gradient costs a round trip each, which on such networks takes longer than the whole
forward and backward. Here small gradients are grouped into buckets (Horovod's fusion
buffer; BytePS has none): one operation in MXNet's engine per bucket
(:mod:`mxnet_plugin.engine_ops`) writes every member; it copies them into one flat
buffer, push_pulls it once under the bucket's name and copies the sums back.

Buckets follow the order backward produces gradients (the trainer's ready order), so a
bucket's operation runs as soon as its last member exists, and they are cut at
``BUCKET_BYTES`` or a change of dtype; a gradient larger than ``SMALL_BYTES`` keeps its
own push_pull (its size already amortizes the round trip). Every rank builds the same
buckets from the same parameters, so the names agree.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from typing import Hashable, Iterable, List, Tuple, TypeVar

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip import runtime
from bps_gossip.compat import zip_exact
from bps_gossip.worker.server_choice import plan_servers, routed

from .layouts import address_in_engine, contiguous_span, make_default, raw_view
from .overlap import begin_round, poison, run_push_pull

SMALL_BYTES = 256 * 1024  # gradients up to this size are fused
BUCKET_BYTES = 4 * 1024 * 1024  # a bucket is cut once it holds this much
LAYOUT_CHARS = 400  # longer layouts travel as a digest

Bucket = List[Tuple[int, mx.gluon.Parameter]]  # (priority index, parameter) in ready order
T = TypeVar("T")

_buffers: dict[str, np.ndarray] = {}  # bucket name -> its flat buffer, reused every step
_buffers_lock = threading.Lock()


def balance_servers(tensors: Iterable[tuple[str, Iterable[mx.nd.NDArray]]]) -> None:
    """Spread a step's push_pulls (name, member arrays) over the servers by bytes
    (:func:`bps_gossip.worker.server_choice.plan_servers`): every rank plans the same buckets
    before their first push_pull, so every rank computes the same assignment. With few large
    gradients a name's hash alone left one of 4 servers half of resnet18_v1's bytes. A name
    already sent (a KVStore key's init broadcast) keeps its hashed servers, on every rank alike."""
    current = runtime.peek()
    if current is None:  # not initialized: nothing is pushed (the push_pull itself says so)
        return
    sizes = []
    for name, arrays in tensors:
        arrays = list(arrays)
        if not routed(name):
            sizes.append((name, sum(int(a.size) for a in arrays), np.dtype(arrays[0].dtype).itemsize))
    plan_servers(sizes, current.config.partition_bytes)


def cut_buckets(entries: Iterable[tuple[T, int, Hashable]]) -> tuple[list[list[T]], list[T]]:
    """Split ``(item, nbytes, kind)`` entries, in ready order, into buckets of consecutive small
    items of one kind (dtype, ...), cut at ``BUCKET_BYTES``, and the items sent alone."""
    buckets: list[list[T]] = []
    alone: list[T] = []
    current: list[T] = []
    current_kind: Hashable = None
    current_bytes = 0
    for item, nbytes, kind in entries:
        if nbytes > SMALL_BYTES:  # by size alone: every rank must plan alike, whatever its devices
            alone.append(item)
            continue
        if current and (current_bytes >= BUCKET_BYTES or kind != current_kind):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_kind = kind
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets, alone


def nbytes_of(array: mx.nd.NDArray) -> int:
    """The array's size in bytes."""
    return int(array.size) * np.dtype(array.dtype).itemsize


def plan_buckets(ready: list[tuple[int, mx.gluon.Parameter]]) -> tuple[list[Bucket], Bucket]:
    """Split trained parameters into fused buckets and ones sent alone (the same on every rank)."""
    return cut_buckets(((index, param), nbytes_of(param.list_grad()[0]), np.dtype(param.dtype))
                       for index, param in ready if param.grad_req != "null")


def bucket_name(bucket: Bucket) -> str:
    """The bucket's tensor name: the same on every rank for the same parameters."""
    return f"fused_gradient_{bucket[0][1].name}_{len(bucket)}"


def bucket_layout(bucket: Bucket) -> str:
    """What the bucket's flat buffer is made of (see :func:`layout_text`)."""
    return layout_text([(param.name, tuple(param.list_grad()[0].shape)) for _, param in bucket])


def _member_views(name: str, arrays: list[mx.nd.NDArray], where: str) -> list[np.ndarray]:
    """Flat views of a bucket's members, inside MXNet's engine. Made once and kept while the
    bucket has the same arrays at the same addresses: making one costs a dozen C calls
    (mobilenet0.25: ~1 ms a step on MXNet's engine thread); checking an address costs one (the
    check a view needs anyway: no oneDNN layout). The kept arrays cannot be freed meanwhile,
    so ``is`` cannot mistake a new array at an old address for one of them."""
    addresses = tuple(address_in_engine(array, where) if array.size else 0 for array in arrays)
    kept = _member_cache.get(name)
    if kept is not None and kept[1] == addresses and len(kept[0]) == len(arrays) \
            and all(a is b for a, b in zip(kept[0], arrays)):
        return kept[2]
    views = [raw_view(array, where).reshape(-1) for array in arrays]
    _member_cache[name] = (list(arrays), addresses, views)
    return views


_member_cache: dict[str, tuple[list[mx.nd.NDArray], tuple[int, ...], list[np.ndarray]]] = {}  # bucket name -> its views


def _buffer(name: str, size: int, dtype: np.dtype) -> np.ndarray:
    with _buffers_lock:
        flat = _buffers.get(name)
        if flat is None or flat.size != size or flat.dtype != dtype:
            flat = _buffers[name] = np.empty(size, dtype)
        return flat


def _gather(views: list[np.ndarray], flat: np.ndarray) -> np.ndarray:
    """Copy ``views`` one after another into ``flat``; return it."""
    offset = 0
    for view in views:
        flat[offset:offset + view.size] = view
        offset += view.size
    return flat


def _scatter(flat: np.ndarray, views: list[np.ndarray]) -> None:
    """Copy ``flat``'s consecutive pieces back into ``views``."""
    offset = 0
    for view in views:
        view[:] = flat[offset:offset + view.size]
        offset += view.size


class PlannedBucket:
    """A bucket with what every step needs of it worked out once: name, layout, priority."""

    def __init__(self, bucket: Bucket) -> None:
        self.params = [param for _, param in bucket]
        self.name = bucket_name(bucket)
        self.layout = bucket_layout(bucket)
        self.priority = -min(index for index, _ in bucket)

    def push_pull_in_engine(self, average: bool = False) -> None:
        """Sum every gradient of the bucket over workers, in place, with one message (returns at once)."""
        push_pull_fused_in_engine([param.list_grad() for param in self.params], self.name, self.layout,
                                  priority=self.priority, average=average)


def layout_text(members: list[tuple[str, tuple[int, ...]]]) -> str:
    """What a fused buffer is made of, as ranks must agree on it: each member's name and shape
    (a digest when that text would be long: it travels with every push)."""
    text = ", ".join(f"{name}{shape}" for name, shape in members)
    if len(text) <= LAYOUT_CHARS:
        return f"fused [{text}]"
    return f"fused {len(members)} gradients, layout {hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


def push_pull_fused_in_engine(members: list[list[mx.nd.NDArray]], name: str, layout: str, priority: int = 0,
                              average: bool = False) -> None:
    """Sum every member (one array, or its copies on several devices) over workers, in place,
    as one flat message named ``name`` (returns at once; readers wait in MXNet's engine)."""
    totals = []
    for copies in members:
        for array in copies:
            make_default(array)
        # several devices in this worker: their sum (a temporary) takes part, then goes back to each
        totals.append(copies[0] if len(copies) == 1 else mx.nd.add_n(*[a.as_in_context(copies[0].context)
                                                                        for a in copies]))
    round_id = begin_round(name)
    where = f"push_pull({name!r})"
    views: list[np.ndarray] = []

    in_place: list[bool] = []  # the members lie back to back (shared gradients): their memory is sent

    def start() -> Future:
        # the engine lets us read and write every member now
        views.extend(_member_views(name, totals, where))
        flat = contiguous_span(views)
        in_place.append(flat is not None)
        if flat is None:
            flat = _gather(views, _buffer(name, sum(v.size for v in views), views[0].dtype))
        return core.push_pull_async(flat, name, average=average, priority=priority, out=flat, layout=layout)

    def finish(ok: bool) -> None:
        if not ok:
            for view in views:
                poison(view)
        elif not in_place[0]:
            _scatter(_buffers[name], views)

    run_push_pull(name, round_id, totals, totals, priority, start, finish)
    for total, copies in zip_exact(totals, members):
        for array in copies:
            if array is not total:
                total.copyto(array)
