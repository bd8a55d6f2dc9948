"""DistributedOptimizer for the Module API: average gradients, then the wrapped update."""

from __future__ import annotations

import numbers
from typing import Any

import mxnet as mx

import bps_gossip as core
from bps_gossip.compat import zip_exact

from .ops import finish_push_pull, push_pull_async


def refuse_in_elastic_job(what: str) -> None:
    """Raise ConfigError in an elastic job (BPS_GOSSIP_ELASTIC=1): ``what`` keeps state that
    no elastic State restores, so a worker change would leave the ranks apart."""
    if core.job_config().elastic:
        raise core.ConfigError(
            f"{what} is not elastic: in an elastic job (BPS_GOSSIP_ELASTIC=1) a change of workers "
            "would leave its state behind on some ranks. Use DistributedTrainer inside elastic.run "
            "with elastic.GluonState (docs/elastic.md), or run the job without BPS_GOSSIP_ELASTIC.")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an MXNet optimizer so that every update first averages the gradient over
    all workers (push_pull, named ``gradient_<index>``, priority ``-index`` as in BytePS).

    Every attribute is read from and written to the wrapped optimizer, so Module's
    updater, learning-rate schedulers and ``set_learning_rate`` work unchanged.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer) -> None:  # noqa: D107 - no super().__init__: state lives in the wrapped optimizer
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mxnet Optimizer, got {type(optimizer).__name__}")
        refuse_in_elastic_job("DistributedOptimizer (the Module API)")
        object.__setattr__(self, "_optimizer", optimizer)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self._optimizer, key, value)

    # Optimizer.__getstate__/__setstate__ would act on our (nearly empty) __dict__ and fail
    # (KeyError 'param_dict'): pickle the wrapped optimizer instead. Updater.get_states(
    # dump_optimizer=True), which gluon's Trainer.save_states uses, pickles the optimizer.
    def __getstate__(self) -> dict[str, Any]:
        return {"_optimizer": self._optimizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_optimizer", state["_optimizer"])

    def _average(self, index: Any, grad: Any) -> None:
        indices = list(index) if isinstance(index, (tuple, list)) else [index]
        grads = list(grad) if isinstance(grad, (tuple, list)) else [grad]
        # Module on several devices updates inside a local KVStore, which passes parameter
        # names, not numbers, as indices: those keep the default priority.
        pending = [(push_pull_async(g, f"gradient_{i}", average=True,
                                    priority=-i if isinstance(i, numbers.Integral) else 0), g)
                   for i, g in zip_exact(indices, grads)]
        for started, g in pending:
            finish_push_pull(started, [g])

    def create_state(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state (multi-precision)."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` over workers, then apply the wrapped update."""
        self._average(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` over workers, then apply the wrapped multi-precision update."""
        self._average(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """Forwarded to the wrapped optimizer."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """Forwarded to the wrapped optimizer."""
        self._optimizer.set_wd_mult(args_wd_mult)
