"""DistributedTrainer's modes: one class per way of keeping the workers in agreement.

- :class:`~.allreduce.AllreduceMode` (``mode='allreduce'``): BytePS's gradient push_pull.
- :class:`~.gossip.GossipMode` (``mode='gossip'``, the default): SGP on the parameters,
  set by :class:`~.options.GossipOptions`.
- :class:`~.auto.AutoMode` (``mode='auto'``): one of the two at a time, chosen while
  training from what each costs a step (:mod:`.auto_policy`).
- :class:`~.async_mode.AsyncMode` (``mode='async'``, or BYTEPS_ENABLE_ASYNC=1): BytePS's
  asynchronous training, the servers holding the weights.

Both implement :class:`~.base.TrainerMode`. A new mode is one subclass and one entry in
:data:`MODE_CLASSES` (and its name in ``bps_gossip.config.TRAINER_MODES``, which
``BPS_GOSSIP_MODE`` and ``bpslaunch --mode`` accept).
"""

from __future__ import annotations

import warnings

import bps_gossip as core
from bps_gossip.compression import CompressionSpec
from bps_gossip.config import TRAINER_MODES

from .allreduce import AllreduceMode
from .async_mode import AsyncMode
from .auto import AutoMode
from .base import ModeSetup, TrainerMode
from .gossip import GossipMode
from .options import GossipOptions

__all__ = ["MODE_CLASSES", "AllreduceMode", "AsyncMode", "AutoMode", "GossipMode", "GossipOptions", "ModeSetup", "TrainerMode",
           "mode_class"]

MODE_CLASSES: dict[str, type[TrainerMode]] = {cls.name: cls for cls in (GossipMode, AllreduceMode, AutoMode,
                                                                                AsyncMode)}


def mode_class(mode: str | None, compression: CompressionSpec | None = None, fp16: bool = False
               ) -> type[TrainerMode]:
    """The class of ``mode``; ``None``: the job's default (BPS_GOSSIP_MODE, ``bpslaunch --mode``,
    else gossip), except that fp16 without a compressor, which only gradients can use, picks
    allreduce (with a warning). ValueError for a name that is not a mode."""
    config = core.job_config()
    if config.enable_async and mode is not None and mode != "async":
        # A ConfigError (a ValueError): the same at every start, so an elastic launcher does not restart it.
        raise core.ConfigError(f"DistributedTrainer: mode={mode!r} conflicts with BYTEPS_ENABLE_ASYNC=1, which asks "
                               "for mode='async': unset one of them")
    if mode is None:
        mode = config.mode
        if fp16 and compression is None and mode == "gossip":
            warnings.warn("DistributedTrainer: fp16 applies to pushed gradients, which gossip mode does not "
                          "push: averaging gradients (mode='allreduce') instead", stacklevel=3)
            mode = "allreduce"
    cls = MODE_CLASSES.get(mode) if isinstance(mode, str) else None
    if cls is None:
        raise ValueError(f"DistributedTrainer: mode={mode!r} is not one of {TRAINER_MODES}")
    if cls is AutoMode and (compression is not None or fp16):
        raise ValueError("DistributedTrainer: mode='auto' takes no compression_params (the two modes "
                         "compress differently): choose mode='gossip' or mode='allreduce'")
    return cls
