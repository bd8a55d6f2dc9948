"""The 'bpsgossip' KVStore type, for code written against MXNet's KVStore API.

``mx.kv.create('bpsgossip')`` returns it, and so does ``gluon.Trainer(...,
kvstore='bpsgossip')``: MXNet 1.9 creates no KVStore at all for a single-device
trainer unless the name contains 'dist' (mxnet/model.py ``_create_kvstore``), so
importing mxnet_plugin teaches that function our name. Passing an instance
(``kvstore=mx.kv.create('bpsgossip')``) works without that.

Semantics are those of ``dist_sync``: pushpull sums over workers (pass the global
batch size to ``trainer.step``), broadcast sends rank 0's value, and ``Module(...,
kvstore='bpsgossip')`` starts every rank from rank 0's weights and rescales gradients
by the global batch size. Unlike MXNet's dist KVStore, ``pushpull(key, value, out=o)``
leaves ``value`` untouched.

``pushpull`` returns at once and sums inside MXNet's engine (``mxnet_plugin.overlap``):
gluon.Trainer asks for the first layer first, whose gradient backward writes last, and
the other gradients' push_pulls still start as soon as each exists. Readers of ``out``
wait as for any MXNet operation. ``BPS_GOSSIP_OVERLAP_BACKWARD=0`` (or setting
``overlap_backward = False`` on the store) makes it wait and copy through host buffers.

``set_gradient_compression`` (and so gluon.Trainer's and Module's ``compression_params``) takes
MXNet's 2bit and 1bit with MXNet's semantics; a server-side optimizer and sparse arrays are refused
(:mod:`mxnet_plugin.unsupported`). docs/compression.md has both.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip.compat import zip_exact
from bps_gossip.compression import CompressionSpec

from .compression import parse_mxnet_compression
from .kvstore_fusion import Call, StepFusion, teach_trainer_and_module
from .ops import broadcast_async, finish_push_pull, to_host
from .optimizer import refuse_in_elastic_job
from .overlap import enabled_by_default, push_pull_in_engine, raise_pending_error, wait_to_read
from .unsupported import (
    NO_SERVER_OPTIMIZER,
    SPARSE,
    refuse_ignored_settings,
    refuse_sparse,
    refuse_sparse_arrays,
    refuse_update_on_kvstore,
)

NAME = "bpsgossip"
TYPE = "dist_sync_" + NAME


def _as_list(value: Any) -> list[mx.nd.NDArray]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _local_sum(values: list[mx.nd.NDArray]) -> np.ndarray:
    host = to_host(values[0])
    for value in values[1:]:
        host += to_host(value)
    return host


@mx.kvstore.KVStoreBase.register
class BpsGossip(mx.kvstore.KVStoreBase):
    """A KVStore whose pushpull is a bps_gossip push_pull (sum over workers)."""

    def __init__(self) -> None:
        core.init()
        refuse_in_elastic_job("The 'bpsgossip' KVStore")
        refuse_ignored_settings(core.job_config())
        self._pending: dict[Any, tuple[Any, np.ndarray]] = {}
        self.overlap_backward = enabled_by_default()
        self._fusion = StepFusion("kvstore_", self._push_pull_alone)
        self._compression: CompressionSpec | None = None

    @property
    def fusion(self) -> StepFusion:
        """How this store fuses a step's keys (its ``buckets`` and lone keys), for tests and tools."""
        return self._fusion

    @property
    def gradient_compression(self) -> CompressionSpec | None:
        """What :meth:`set_gradient_compression` set (None: uncompressed)."""
        return self._compression

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """MXNet's gradient compression, ``{'type': '2bit', 'threshold': 0.5}`` or ``'1bit'``, with
        MXNet's semantics (docs/compression.md): each worker keeps a residual per key, adds the
        gradient to it, pushes the quantized residual (2 or 1 bits a value) and keeps the rest;
        the servers sum the dequantized pushes and every worker pulls that float32 sum.
        gluon.Trainer and Module call this with their ``compression_params``. Every rank must set
        the same; every float32 gradient is compressed, whatever its size; other dtypes are
        refused, as MXNet refuses them. Compressed sums take the host path (no fusion)."""
        self._compression = parse_mxnet_compression(compression_params, f"{NAME}.set_gradient_compression")

    @property
    def _on_host(self) -> bool:
        return not self.overlap_backward or self._compression is not None

    @property
    def type(self) -> str:
        """'bpsgossip', the name ``mx.kv.create`` takes (as MXNet's own 'horovod' and 'byteps'
        stores return theirs).

        MXNet's Module (and FeedForward) decide gradient scaling by substrings of the type:
        with 'dist' and '_sync' in it they scale by 1 / (batch size x workers), as for
        dist_sync; with 'bpsgossip' alone they would take 1 / batch size and step
        ``num_workers`` times too far. While they set up their optimizer (and nowhere else),
        the type reads 'dist_sync_bpsgossip' (:func:`_teach_gradient_scaling`).
        """
        return TYPE if getattr(_setting_up_scaling, "depth", 0) else NAME

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return core.rank()

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        return core.size()

    @staticmethod
    def is_capable(capability: str) -> bool:
        """No server-side optimizer: Trainer and Module update locally. A static method, as in
        MXNet's KVStoreBase (MXNet calls it on the class too)."""
        return capability.lower() != mx.kvstore.KVStoreBase.OPTIMIZER

    @staticmethod
    def _name(key: Any) -> str:
        return f"kvstore_{key}"

    def _keys_values(self, key: Any, value: Any) -> list[tuple[Any, list[mx.nd.NDArray]]]:
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(key):
                raise ValueError(f"{self.type}: {len(key)} keys need as many values")
            return [(k, _as_list(v)) for k, v in zip_exact(key, value)]
        return [(key, _as_list(value))]

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Write rank 0's ``value`` into ``out`` on every rank."""
        raise_pending_error()
        outs = self._keys_values(key, out)
        values = dict(self._keys_values(key, value))
        # under a name of its own: the key's pushpull name stays unsent until its first step, so
        # that fusion can plan its servers by bytes (mxnet_plugin.fusion.balance_servers)
        pending = [(broadcast_async(values[k][0], f"kvstore.broadcast_{k}", 0, priority), targets)
                   for k, targets in outs]
        for started, targets in pending:
            finish_push_pull(started, targets)

    def init(self, key: Any, value: Any) -> None:
        """Make every rank's ``value`` rank 0's (what ps-lite's init achieves)."""
        self.broadcast(key, value, value)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` (summed over this worker's devices first) over all workers into ``out``
        (into ``value`` when ``out`` is None). Lists of keys summed in place are fused
        (:mod:`mxnet_plugin.kvstore_fusion`)."""
        targets = self._keys_values(key, value if out is None else out)
        values = dict(self._keys_values(key, value))
        for k, arrays in values.items():
            refuse_sparse_arrays(arrays, f"{NAME} key {k!r}")
        if not self._on_host:
            # The caller's arrays may still be being computed, and MXNet allocates such an array's
            # memory when it runs: taking its address from here first would allocate it twice.
            # (gluon.Trainer and Module come through pushpull_step with gradients that exist.)
            for _, arrays in (*targets, *values.items()):
                for array in arrays:
                    wait_to_read(array)
            if out is None and isinstance(key, (list, tuple)):
                self.pushpull_step([(k, values[k], priority) for k, _ in targets])
                return
            for k, dests in targets:
                push_pull_in_engine(values[k], self._name(k), average=False, priority=priority,
                                    outs=None if out is None else dests)
            return
        self._pushpull_on_host([(k, values[k], dests, priority) for k, dests in targets])

    def pushpull_step(self, calls: list[Call], owners: list[mx.gluon.Parameter] | None = None) -> None:
        """Sum each ``(key, arrays, priority)`` over workers in place: a whole step's gradients, as
        gluon.Trainer and Module hand them over, fused into few messages when summing in
        MXNet's engine (``owners``: gluon.Trainer's parameters of the gradients, see StepFusion)."""
        if not self._on_host:
            self._fusion.pushpull(calls, owners)
        else:
            self._pushpull_on_host([(key, arrays, arrays, priority) for key, arrays, priority in calls])

    def _push_pull_alone(self, key: Any, arrays: list[mx.nd.NDArray], priority: int) -> None:
        push_pull_in_engine(arrays, self._name(key), average=False, priority=priority)

    def _pushpull_on_host(self, calls: list[tuple[Any, list[mx.nd.NDArray], list[mx.nd.NDArray], int]]) -> None:
        raise_pending_error()
        pending = []
        for key, sources, dests, priority in calls:
            host = self._host_sum(key, sources)
            pending.append(((core.push_pull_async(host, self._name(key), average=False, priority=priority,
                                                  out=host, compression=self._compression), host), dests))
        for started, dests in pending:
            finish_push_pull(started, dests)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Start summing ``value`` over workers; :meth:`pull` collects the result."""
        raise_pending_error()
        for k, values in self._keys_values(key, value):
            if k in self._pending:
                raise ValueError(f"{self.type}: key {k!r} was pushed twice without a pull")
            host = self._host_sum(k, values)
            self._pending[k] = (core.push_pull_async(host, self._name(k), average=False, priority=priority,
                                                     out=host, compression=self._compression), host)

    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Write the sum started by :meth:`push` into ``out``."""
        for k, dests in self._keys_values(key, out):
            started = self._pending.pop(k, None)
            if started is None:
                raise ValueError(f"{self.type}: pull of key {k!r} without a push before it")
            finish_push_pull(started, dests)

    def _host_sum(self, key: Any, arrays: list[mx.nd.NDArray]) -> np.ndarray:
        """This worker's sum of ``arrays`` on the host, after the checks a compressed push needs."""
        refuse_sparse_arrays(arrays, f"{NAME} key {key!r}")
        if self._compression is not None and arrays[0].dtype != np.float32:
            raise TypeError(f"{NAME} key {key!r}: gradient compression ({self._compression.describe()}) takes "
                            f"float32 arrays only, as in MXNet; this one is {np.dtype(arrays[0].dtype).name}")
        return _local_sum(arrays)

    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None) -> None:
        """Not supported: the servers hold no weights and sum dense arrays only."""
        raise NotImplementedError(f"{NAME}.row_sparse_pull: {NAME} {SPARSE}")

    def set_optimizer(self, optimizer: Any) -> None:
        """Not supported: there is no server-side optimizer (is_capable('optimizer') is False)."""
        # Not SERVER_OPTIMIZER's "use update_on_kvstore=False": the caller of set_optimizer passed no such flag.
        raise NotImplementedError(f"{NAME}.set_optimizer: {NAME} {NO_SERVER_OPTIMIZER}: do not give the optimizer "
                                  "to the store; every rank updates locally, e.g. gluon.Trainer(params, optimizer, "
                                  f"kvstore='{NAME}') or Module.init_optimizer(kvstore='{NAME}', optimizer=...), "
                                  "with the same result")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Not supported (optimizer states live in the trainer)."""
        raise NotImplementedError(f"{self.type} keeps no optimizer states; use Trainer.save_states")

    def load_optimizer_states(self, fname: str) -> None:
        """Not supported (optimizer states live in the trainer)."""
        raise NotImplementedError(f"{self.type} keeps no optimizer states; use Trainer.load_states")


def _teach_create_kvstore() -> None:
    """Make MXNet's ``_create_kvstore`` build our store for kvstore='bpsgossip' on one device."""
    original = mx.model._create_kvstore
    if getattr(original, "_bps_gossip", False):
        return

    def create_kvstore(kvstore: Any, num_device: int, arg_params: Any) -> tuple[Any, bool]:
        if isinstance(kvstore, str) and kvstore.lower() == NAME:
            return mx.kv.create(NAME), False
        return original(kvstore, num_device, arg_params)

    create_kvstore._bps_gossip = True
    for module in (mx.model, mx.gluon.trainer, mx.module.module):
        if getattr(module, "_create_kvstore", None) is original:
            module._create_kvstore = create_kvstore


def _teach_initialize_kvstore() -> None:
    """Make Module's (and FeedForward's) ``_initialize_kvstore`` give every device root's values.

    Without a server-side optimizer (update_on_kvstore=False) MXNet only calls
    ``kvstore.init(name, arg_params[name])``, which leaves the devices' copies as they
    were: dist_sync users get rank 0's weights through the server-side optimizer path,
    so without this, ranks seeded differently would train different models forever.
    """
    original = mx.model._initialize_kvstore
    if getattr(original, "_bps_gossip", False):
        return

    def initialize_kvstore(kvstore: Any, param_arrays: Any, arg_params: Any, param_names: Any,
                           update_on_kvstore: bool) -> None:
        if not isinstance(kvstore, BpsGossip):
            return original(kvstore, param_arrays, arg_params, param_names, update_on_kvstore)
        names = [param_names[index] for index in range(len(param_arrays))]
        kvstore.broadcast(names, [arg_params[name] for name in names],
                          out=[[arg_params[name], *copies] for name, copies in zip_exact(names, param_arrays)])
        return None

    initialize_kvstore._bps_gossip = True
    for module in (mx.model, mx.module.module):
        if getattr(module, "_initialize_kvstore", None) is original:
            module._initialize_kvstore = initialize_kvstore


def _teach_gradient_scaling() -> None:
    """While Module sets up its optimizer (``init_optimizer``) and FeedForward trains (``fit``),
    our store's type reads 'dist_sync_bpsgossip', so that they scale gradients as for dist_sync
    (see :attr:`BpsGossip.type`)."""
    for cls, method in ((mx.module.Module, "init_optimizer"), (mx.model.FeedForward, "fit")):
        original = getattr(cls, method)
        if getattr(original, "_bps_gossip", False):
            continue

        def as_dist_sync(self: Any, *args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            _setting_up_scaling.depth = getattr(_setting_up_scaling, "depth", 0) + 1
            try:
                return __original(self, *args, **kwargs)
            finally:
                _setting_up_scaling.depth -= 1

        functools.update_wrapper(as_dist_sync, original)
        as_dist_sync._bps_gossip = True
        setattr(cls, method, as_dist_sync)


def _teach_trainer_refusals() -> None:
    """Make gluon.Trainer refuse, when it is built for our store, what the store cannot do
    (update_on_kvstore=True, sparse parameters) and compression_params it would refuse. MXNet itself would notice only at the first
    step, the first with a message about another class, the second as 'multi-device training'."""
    original = mx.gluon.Trainer.__init__
    if getattr(original, "_bps_gossip", False):
        return

    def init(self: mx.gluon.Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "_kvstore_params", {})
        store = config.get("kvstore")
        if isinstance(store, BpsGossip) or (isinstance(store, str) and store.lower() == NAME):
            refuse_update_on_kvstore(config.get("update_on_kvstore"), f"gluon.Trainer(kvstore={NAME!r})")
            refuse_sparse(self._params, f"gluon.Trainer(kvstore={NAME!r})")
            if self._compression_params:  # MXNet reads them at the first step; a bad one fails here
                parse_mxnet_compression(self._compression_params, f"gluon.Trainer(kvstore={NAME!r})")

    functools.update_wrapper(init, original)
    init._bps_gossip = True
    mx.gluon.Trainer.__init__ = init


_setting_up_scaling = threading.local()  # depth > 0: Module or FeedForward is deciding its gradient scaling
_teach_create_kvstore()
_teach_initialize_kvstore()
_teach_gradient_scaling()
_teach_trainer_refusals()
teach_trainer_and_module(BpsGossip)
