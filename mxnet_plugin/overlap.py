"""push_pull inside MXNet's engine, so that communication overlaps backward.

``push_pull_in_engine(grads, name)`` returns at once. It invokes a custom operator
(op_type ``bps_gossip_push_pull``) on the gradient, in place; MXNet runs it when
backward has written that gradient, on one of its custom-operator threads (the pool
grows on demand, so operators blocked on the network never starve the others), and
every later reader of the gradient (the optimizer update) waits for it through
MXNet's own dependency tracking. So each gradient's push_pull starts as soon as that
gradient exists, whatever order the caller asks in, and the core's priorities
(``-index``: first layers first) order whatever is queued at the same time.

The operator reads and writes the NDArray's memory directly (MXNet has granted the
operator read access to the input and write access to the output while it runs; arrays
that an inference forward left in a oneDNN layout are reordered before they are
queued, see ``mxnet_plugin.layouts``): no
``asnumpy`` and no copy back. The copies left on the hot path are the transport's:
into the shared-memory segment (or the ZeroMQ frame) on the way out, and from it into
the gradient on the way back.

Errors: the operator re-raises the core's exception, so MXNet marks every array that
depends on the failed gradient as failed (nothing trains on a half-summed gradient).
MXNet's own message for that (an ``MXNetError`` "Check failed ... kCustomOpForward" at
the next wait on such an array) does not carry ours, so the exception is also logged at
once and kept: the next call that starts a push_pull of this module (the next
``trainer.step()``, ``kvstore.pushpull``) or :func:`raise_pending_error` raises it,
naming the tensor.

``BPS_GOSSIP_OVERLAP_BACKWARD=0`` (or ``overlap_backward=False`` where offered) turns
this off: the caller then waits for each gradient and copies it through host buffers.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import mxnet as mx

import bps_gossip as core
from bps_gossip.api import wait_timeout

from .layouts import make_default, raw_view

OP_TYPE = "bps_gossip_push_pull"
ENV = "BPS_GOSSIP_OVERLAP_BACKWARD"

log = logging.getLogger("bps_gossip.mxnet_plugin")


def enabled_by_default() -> bool:
    """``BPS_GOSSIP_OVERLAP_BACKWARD`` (1, the default, or 0)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise core.ConfigError(f"{ENV}={value!r}: use 1 or 0")


class _Rounds:
    """Per tensor name, whether the last round started here has run; the first error seen.

    A new round of a name waits for the previous one (it is done long before in
    training: the next backward needs the updated weights), so that an error of round
    N is raised by the call that starts round N+1 at the latest.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self._unclaimed: dict[str, threading.Event] = {}  # round id -> event, until its operator exists
        self._ids = itertools.count()
        self.used = False  # whether any round was ever started (drain() is free otherwise)
        self._error: BaseException | None = None

    def begin(self, name: str) -> str:
        """Wait for ``name``'s previous round (raising a kept error), then open the next;
        return its id for :meth:`claim`."""
        self.raise_error()
        with self._lock:
            previous = self._done.get(name)
        if previous is not None and not previous.wait(wait_timeout()):
            raise core.CommTimeoutError(
                f"push_pull({name!r}): the previous round never ran in MXNet's engine (did an operation "
                "computing this gradient fail?)")
        self.raise_error()
        event = threading.Event()
        with self._lock:
            self.used = True
            self._done[name] = event
            round_id = str(next(self._ids))
            self._unclaimed[round_id] = event
        return round_id

    def claim(self, round_id: str) -> threading.Event | None:
        """The event of round ``round_id``, for the operator that runs it."""
        with self._lock:
            return self._unclaimed.pop(round_id, None)

    def abandon(self, round_id: str) -> None:
        """Mark a round that MXNet refused to queue as done."""
        event = self.claim(round_id)
        if event is not None:
            event.set()

    def fail(self, name: str, error: BaseException) -> None:
        """Keep ``error`` (the first one) for the next caller."""
        with self._lock:
            if self._error is None:
                self._error = error
        log.error("push_pull(%r) failed inside MXNet's engine: %s: %s; arrays computed from this gradient "
                  "raise MXNetError when waited for, and the next push_pull call raises this error",
                  name, type(error).__name__, error)

    def raise_error(self) -> None:
        """Raise the kept error once; forget rounds that will never run after it."""
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                self._done.clear()  # rounds downstream of a failure are skipped by MXNet
        if error is not None:
            raise error


_rounds = _Rounds()


def drain() -> None:
    """Wait until every push_pull queued in MXNet's engine has run (call before shutdown).

    A failed one is not raised here: its error is kept for :func:`raise_pending_error`.
    """
    if not _rounds.used:
        return
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


def raise_pending_error() -> None:
    """Raise the error of a push_pull that failed inside MXNet's engine, if any (once)."""
    _rounds.raise_error()


class _PushPull(mx.operator.CustomOp):
    """out = push_pull(in): the core's blocking push_pull on a custom-operator thread."""

    def __init__(self, tensor: str, average: bool, priority: int) -> None:
        super().__init__()
        self.tensor = tensor
        self.average = average
        self.priority = priority
        self.done: threading.Event | None = None

    def forward(self, is_train: bool, req: list[str], in_data: list, out_data: list, aux: list) -> None:
        """Sum over workers from the input's memory straight into the output's."""
        try:
            source = raw_view(in_data[0], f"push_pull({self.tensor!r})")
            target = raw_view(out_data[0], f"push_pull({self.tensor!r})")
            core.push_pull(source, self.tensor, average=self.average, priority=self.priority, out=target)
        except BaseException as exc:
            _rounds.fail(self.tensor, exc)
            raise  # MXNet marks the output failed: nothing downstream runs on it
        finally:
            if self.done is not None:
                self.done.set()

    def backward(self, req: list[str], out_grad: list, in_data: list, out_data: list, in_grad: list,
                 aux: list) -> None:
        """Never differentiated."""
        raise NotImplementedError("bps_gossip_push_pull has no gradient")


@mx.operator.register(OP_TYPE)
class _PushPullProp(mx.operator.CustomOpProp):
    """Shape and dtype of the output are those of the input."""

    def __init__(self, tensor: str, average: str = "0", priority: str = "0", round_id: str = "") -> None:
        super().__init__(need_top_grad=False)
        self.tensor = tensor
        self.average = average == "1"
        self.priority = int(priority)
        self.round_id = round_id

    def list_arguments(self) -> list[str]:
        return ["data"]

    def list_outputs(self) -> list[str]:
        return ["output"]

    def infer_shape(self, in_shape: list) -> tuple[list, list, list]:
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type: list) -> tuple[list, list, list]:
        return in_type, [in_type[0]], []

    def create_operator(self, ctx: mx.Context, in_shapes: list, in_dtypes: list) -> _PushPull:
        op = _PushPull(self.tensor, self.average, self.priority)
        op.done = _rounds.claim(self.round_id)
        return op


def push_pull_in_engine(sources: list[mx.nd.NDArray], name: str, average: bool = False, priority: int = 0,
                        outs: list[mx.nd.NDArray] | None = None) -> None:
    """Sum ``sources`` (one worker's copies on several devices, summed locally first) over
    workers into every array of ``outs`` (default: into ``sources``), inside MXNet's engine.

    Returns at once; readers of ``outs`` wait for the result as for any MXNet operation.
    """
    targets = sources if outs is None else outs
    for array in sources if outs is None else (*sources, *outs):
        make_default(array)  # free unless an inference forward left a oneDNN layout (waits then)
    round_id = _rounds.begin(name)
    if len(sources) == 1:
        total = sources[0]
    else:  # local sum on the first device (MXNet operations, asynchronous like the rest)
        total = mx.nd.add_n(*[s.as_in_context(sources[0].context) for s in sources])
    first = targets[0]
    if first.context == total.context and (outs is not None or len(sources) == 1):
        result = first  # in place when first is the source itself
    else:
        result = total  # total is a temporary here (or lives on another device)
    try:
        mx.nd.Custom(total, op_type=OP_TYPE, tensor=name, average="1" if average else "0",
                     priority=str(int(priority)), round_id=round_id, out=result)
    except BaseException:
        _rounds.abandon(round_id)  # refused before it was queued: no round to wait for
        raise
    for target in targets:
        if target is not result:
            result.copyto(target)
