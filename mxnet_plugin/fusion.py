"""Tensor fusion for push_pull inside MXNet's engine: many small gradients, one message.

A network like mobilenet0.25 has ~80 gradients of a few KiB each. One push_pull per
gradient costs a round trip each (and a custom-operator thread each while it waits),
which on such networks takes longer than the whole forward and backward. Here small
gradients are grouped into buckets (Horovod's fusion buffer; BytePS has none): one
custom operator per bucket takes every member as input and output, copies them into
one flat buffer, push_pulls it once under the bucket's name and copies the sums back.

Buckets follow the order backward produces gradients (the trainer's ready order), so a
bucket's operator runs as soon as its last member exists, and they are cut at
``BUCKET_BYTES`` or a change of dtype; a gradient larger than ``SMALL_BYTES`` keeps its
own push_pull (its size already amortizes the round trip). Every rank builds the same
buckets from the same parameters, so the names agree.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Hashable, Iterable, List, Tuple, TypeVar

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.compat import zip_exact

from .layouts import make_default, raw_view
from .overlap import _rounds

OP_TYPE = "bps_gossip_push_pull_fused"
SMALL_BYTES = 256 * 1024  # gradients up to this size are fused
BUCKET_BYTES = 4 * 1024 * 1024  # a bucket is cut once it holds this much
LAYOUT_CHARS = 400  # longer layouts travel as a digest

Bucket = List[Tuple[int, mx.gluon.Parameter]]  # (priority index, parameter) in ready order
T = TypeVar("T")

_buffers: dict[str, np.ndarray] = {}  # bucket name -> its flat buffer, reused every step
_buffers_lock = threading.Lock()


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
    return cut_buckets(((index, param), nbytes_of(param.list_grad()[0]), param.dtype)
                       for index, param in ready if param.grad_req != "null")


def bucket_name(bucket: Bucket) -> str:
    """The bucket's tensor name: the same on every rank for the same parameters."""
    return f"fused_gradient_{bucket[0][1].name}_{len(bucket)}"


def bucket_layout(bucket: Bucket) -> str:
    """What the bucket's flat buffer is made of (see :func:`layout_text`)."""
    return layout_text([(param.name, tuple(param.list_grad()[0].shape)) for _, param in bucket])


class _FusedPushPull(mx.operator.CustomOp):
    """outs = push_pull(concat(ins)), split back: one message for many small arrays."""

    def __init__(self, tensor: str, layout: str, average: bool, priority: int, done: threading.Event | None) -> None:
        super().__init__()
        self.tensor = tensor
        self.layout = layout
        self.average = average
        self.priority = priority
        self.done = done

    def forward(self, is_train: bool, req: list[str], in_data: list, out_data: list, aux: list) -> None:
        """Gather the inputs, sum the flat buffer over workers, scatter into the outputs."""
        try:
            where = f"push_pull({self.tensor!r})"
            sources = [raw_view(array, where).reshape(-1) for array in in_data]
            flat = _buffer(self.tensor, sum(s.size for s in sources), sources[0].dtype)
            offset = 0
            for source in sources:
                flat[offset:offset + source.size] = source
                offset += source.size
            core.push_pull(flat, self.tensor, average=self.average, priority=self.priority, out=flat,
                           layout=self.layout)
            offset = 0
            for array in out_data:
                target = raw_view(array, where).reshape(-1)
                target[:] = flat[offset:offset + target.size]
                offset += target.size
        except BaseException as exc:
            _rounds.fail(self.tensor, exc)
            raise
        finally:
            if self.done is not None:
                self.done.set()

    def backward(self, req: list[str], out_grad: list, in_data: list, out_data: list, in_grad: list,
                 aux: list) -> None:
        """Never differentiated."""
        raise NotImplementedError(f"{OP_TYPE} has no gradient")


def _buffer(name: str, size: int, dtype: np.dtype) -> np.ndarray:
    with _buffers_lock:
        flat = _buffers.get(name)
        if flat is None or flat.size != size or flat.dtype != dtype:
            flat = _buffers[name] = np.empty(size, dtype)
        return flat


@mx.operator.register(OP_TYPE)
class _FusedPushPullProp(mx.operator.CustomOpProp):
    """``count`` inputs and as many outputs, each of its input's shape and dtype."""

    def __init__(self, tensor: str, count: str, layout: str = "", average: str = "0", priority: str = "0",
                 round_id: str = "") -> None:
        super().__init__(need_top_grad=False)
        self.tensor = tensor
        self.layout = layout
        self.count = int(count)
        self.average = average == "1"
        self.priority = int(priority)
        self.round_id = round_id

    def list_arguments(self) -> list[str]:
        return [f"data{i}" for i in range(self.count)]

    def list_outputs(self) -> list[str]:
        return [f"output{i}" for i in range(self.count)]

    def infer_shape(self, in_shape: list) -> tuple[list, list, list]:
        return in_shape, list(in_shape), []

    def infer_type(self, in_type: list) -> tuple[list, list, list]:
        return in_type, list(in_type), []

    def create_operator(self, ctx: mx.Context, in_shapes: list, in_dtypes: list) -> _FusedPushPull:
        return _FusedPushPull(self.tensor, self.layout, self.average, self.priority, _rounds.claim(self.round_id))


def push_pull_bucket_in_engine(bucket: Bucket, average: bool = False) -> None:
    """Sum every gradient of ``bucket`` over workers, in place, with one message (returns at once)."""
    push_pull_fused_in_engine([param.list_grad() for _, param in bucket], bucket_name(bucket),
                              bucket_layout(bucket), priority=-min(index for index, _ in bucket), average=average)


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
    round_id = _rounds.begin(name)
    try:
        mx.nd.Custom(*totals, op_type=OP_TYPE, tensor=name, count=str(len(totals)), layout=layout,
                     average="1" if average else "0", priority=str(int(priority)), round_id=round_id, out=totals)
    except BaseException:
        _rounds.abandon(round_id)
        raise
    for total, copies in zip_exact(totals, members):
        for array in copies:
            if array is not total:
                total.copyto(array)
