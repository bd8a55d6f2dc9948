"""Gluon parameters <-> the core's GossipAverager (or, compressed, ChocoAverager), for
DistributedTrainer's gossip mode (:mod:`mxnet_plugin.modes.gossip`).

Parameters are grouped by dtype into flat host buffers (one message per group and
peer). After the local optimizer update, the displacement of each parameter is
handed to the averager (the numerator takes the step), one gossip round runs, and the
de-biased model z = x / w is written back into every device copy, so forward always
sees z. Non-floating-point parameters are not gossiped (they keep root's value from
the first-step broadcast).

The displacement is measured from the values the last mix wrote (not from the values
at the start of the update), so whatever changed a parameter in between counts as
part of the local step: BatchNorm's running mean and variance (grad_req 'null'),
which forward passes move, are gossiped with the weights like that, and
``average_parameters()`` / ``average_every`` average them exactly with the rest.
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Tuple

import mxnet as mx
import numpy as np

import bps_gossip as core
from bps_gossip import runtime
from bps_gossip.compression import CompressionSpec
from bps_gossip.gossip.averager import GossipAverager
from bps_gossip.gossip.by_host import HostAverager, fits
from bps_gossip.gossip.choco import ChocoAverager
from bps_gossip.gossip.link import default_link
from bps_gossip.protocol.data import MAX_ARRAYS

from ..layouts import IdleViews
from ..overlap import wait_all
from .options import GossipOptions

log = logging.getLogger("bps_gossip.worker")  # the worker's handler and BYTEPS_LOG_LEVEL
# Every gossip of this process that may hold rounds in flight, for shutdown() to flush: module
# state on purpose, since what it tracks lives as long as the process (trainers outlive a job's
# init/shutdown and elastic resets), and a weak set lets a dropped trainer go.
_live: weakref.WeakSet[ParameterGossip] = weakref.WeakSet()

Layout = Dict[str, List[Tuple[mx.gluon.Parameter, int, int]]]  # dtype -> (parameter, offset, size) in its flat buffer
IN_PLACE_ELEMENTS = 1 << 16  # smaller parameters are mixed as flat copies: a view per array costs more


def _flat_layout(params: list[tuple[mx.gluon.Parameter, int]]) -> Layout:
    """(parameter, size) pairs placed one after another in one flat buffer per dtype."""
    layout: Layout = {}
    offsets: dict[str, int] = {}
    for param, size in params:
        key = np.dtype(param.dtype).name
        layout.setdefault(key, []).append((param, offsets.get(key, 0), size))
        offsets[key] = offsets.get(key, 0) + size
    return layout


def flush_all() -> None:
    """Absorb in-flight gossip of every live gossip trainer (called before shutdown)."""
    for gossip in list(_live):
        gossip.flush()


class ParameterGossip:
    """Packs a trainer's parameters into dtype groups and runs SGP on them (CHOCO-Gossip
    when ``compression`` is set: then only ``options.gossip_gamma`` of the options applies)."""

    def __init__(self, params: list[mx.gluon.Parameter], tag: str, options: GossipOptions | None = None,
                 compression: CompressionSpec | None = None) -> None:
        options = options or GossipOptions()
        self.params = params
        self.compression, self.gamma = compression, options.gossip_gamma  # compressed gossip (CHOCO) when set
        self.tag = tag
        averager_args = options.averager_arguments()
        self.graph_spec = averager_args["graph"]  # a name can be rebuilt for another size (elastic)
        averager_args["graph"] = GossipAverager.check_arguments(core.size(), **averager_args)
        self.averager_args = averager_args
        self.groups = self._host_groups()
        self.direct = self._mixes_in_place()
        self.averager: GossipAverager | None = None
        self.layout: Layout = {}  # every gossiped parameter, by dtype
        self.large: list[tuple[str, mx.gluon.Parameter]] = []  # mixed in their own memory (direct)
        self.small_layout: Layout = {}  # mixed as flat copies (direct)
        self.written: dict[str, np.ndarray] | None = None  # what the last unpack() wrote (z)
        self.views = IdleViews()  # of every parameter copy, read and written every step
        self.slow_ranks: dict[int, int] = {}  # what the next averager starts routing around (reset_world)
        self.slow_lateness: dict[int, float] = {}  # and how late each of them was, last measured (seconds)
        _live.add(self)

    def _host_groups(self) -> list[tuple[int, ...]] | None:
        """The hosts gossip goes by (bps_gossip.gossip.by_host: exact within a host, one message
        per host pair), or None: flat gossip (compressed, rounds left open, no host reduce,
        hosts of unequal size)."""
        if self.compression is not None or core.size() == 1:
            return None
        groups = getattr(default_link(), "host_groups", lambda: None)()
        args = self.averager_args
        return groups if fits(groups, self.graph_spec, args["overlap"]) else None

    def _mixes_in_place(self) -> bool:
        """Whether the averager's x can be the parameters' own memory (no copies in or out):
        uncompressed and flat, few enough arrays for one message, and either w always 1 with no
        round left open (x = z) or rounds left open with the averager in the model form (it
        holds z, x = w * z: ``hold_model``)."""
        args = self.averager_args
        return (self.compression is None and self.groups is None and 0 < len(self._gossiped()) <= MAX_ARRAYS
                and (GossipAverager.model_is_x(args["graph"], args["push_sum"], args["overlap"])
                     or GossipAverager.holds_model_for(args["push_sum"], args["overlap"])))

    def _mix_in_place(self) -> None:
        """One round with x = the large parameters' own memory and flat copies of the small ones
        (a view per array costs more than copying a small one), then the copies are written back
        and the other device copies of the large ones follow their first. Once the averager
        routes around a slow link it owns x (z = x / w): the step's displacement goes in, z
        comes back out (:meth:`_write_model`)."""
        if not self.layout:
            self._build_layout()
        x = self._current()
        fresh = self.averager is None
        if fresh:  # after the first-step broadcast: every rank starts equal
            self.averager = self._new_averager(x, start_equal=True)  # its x: copies of x
        if self.averager.owns_x:
            if not fresh:
                self.averager.apply_update(self.written, x)
        else:
            self.averager.use_buffers(x)
        self.averager.step()
        if not self.averager.borrowed:  # routing owns x (or took it, or gave it back, in this step)
            self._write_model(self.averager.model())
            return
        self._copy_in(self.small_layout, x)
        for key, param in self.large:
            copies = param.list_data()
            for index, copy in enumerate(copies[1:], 1):
                np.copyto(self.views.flat((param, index), copy), x[key])

    def _current(self) -> dict[str, np.ndarray]:
        """The parameters as they are now, keyed as the averager's x: the small ones copied (into
        the averager's own buffers where it borrows), the large ones as views of their memory,
        made now: MXNet may have moved or reordered it (oneDNN) since the last step."""
        wait_all()  # the update has landed; nothing in MXNet's engine touches the parameters now
        owned = self.averager is not None and self.averager.owns_x
        x = self._copy_out(self.small_layout, None if owned or self.averager is None else self.averager.x)
        x.update((key, self.views.flat((param, 0), param.list_data()[0])) for key, param in self.large)
        return x

    def _holds_model(self) -> bool:
        """Whether the averager holds z in the parameters' own memory (``hold_model``): before
        it reads or writes z outside a step, it must be handed that memory afresh."""
        return self.direct and self.averager is not None and self.averager.holds_z

    def _write_model(self, z: dict[str, np.ndarray]) -> None:
        """Write z into every device copy of every parameter (whichever layout the averager's
        keys follow) and remember it as what the last mix wrote."""
        if not self.direct:
            self.unpack(z)
            return
        self.written = z
        wait_all()  # nobody reads or writes the parameters in MXNet's engine while we write
        self._copy_in(self.small_layout, z)
        for key, param in self.large:
            for index, copy in enumerate(param.list_data()):
                np.copyto(self.views.flat((param, index), copy), z[key])

    def _gossiped(self) -> list[tuple[mx.gluon.Parameter, int]]:
        """(parameter, size) of every floating-point parameter, in the trainer's order."""
        return [(param, int(np.prod(param.shape))) for param in self.params if np.dtype(param.dtype).kind == "f"]

    def _build_layout(self) -> None:
        floats = self._gossiped()
        self.layout = _flat_layout(floats)
        if self.direct:
            self.large = [(str(index), param) for index, (param, size) in enumerate(floats) if size >= IN_PLACE_ELEMENTS]
            self.small_layout = _flat_layout([(param, size) for param, size in floats if size < IN_PLACE_ELEMENTS])

    def reset_world(self, keep_routing: bool = False) -> None:
        """Elastic: drop the averager (its rounds died with the old generation); the next step
        starts a new one on the synced parameters, with the graph built for the new size.
        ``keep_routing``: the same workers go on (mode='auto'): the new averager routes around
        the ranks this one found slow from its first round."""
        routing = getattr(self.averager, "routing", None)
        if not keep_routing:
            self.slow_ranks, self.slow_lateness = {}, {}
        elif routing is not None:  # (else no round ran since the last restart: what it knew still holds)
            self.slow_ranks, self.slow_lateness = dict(routing.slow), self.slow_links()
        if not isinstance(self.graph_spec, str) and self.graph_spec.world_size != core.size():
            raise ValueError(f"gossip: the explicit graph is for {self.graph_spec.world_size} workers and cannot "
                             f"follow the job to {core.size()}; pass a graph name (e.g. 'npdde')")
        args = {**self.averager_args, "graph": self.graph_spec}
        self.averager_args["graph"] = GossipAverager.check_arguments(core.size(), **args)
        self.groups = self._host_groups()  # the new generation's hosts
        self.direct = self._mixes_in_place()  # the new size's graph may be regular or not
        self.layout = {}  # built again for it
        self.averager = None
        self.written = None

    def values_before_update(self) -> dict[str, np.ndarray] | None:
        """The parameters as the last mix left them (z), or as they are now before the first;
        None when the mix works on the parameters' own memory (nothing to measure from).

        Forward passes since then moved only statistics (BatchNorm's running mean and
        variance): measured from z, their change is part of this step's displacement.
        """
        if self.direct:
            return None
        return self.written if self.written is not None else self.pack()

    def pack(self, into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The parameters' current values (first device copy), as flat buffers by dtype
        (new ones, or ``into``'s): one memory copy each.

        One wait for MXNet's engine, then plain copies from the parameters' memory: a
        per-array wait costs 50-100 us, which on networks of a hundred small tensors
        (mobilenet) would cost more than the gossip itself.
        """
        if not self.layout:
            self._build_layout()
        wait_all()  # the update has landed; nothing in MXNet's engine touches the parameters now
        return self._copy_out(self.layout, into)

    def unpack(self, buffers: dict[str, np.ndarray]) -> None:
        """Write flat buffers back into every device copy of every parameter (one wait for
        MXNet's engine, then plain copies, as in :meth:`pack`)."""
        self.written = buffers
        wait_all()  # nobody reads or writes the parameters in MXNet's engine while we write
        self._copy_in(self.layout, buffers)

    def _copy_out(self, layout: Layout, into: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        buffers = {}
        for key, entries in layout.items():
            if into is not None:
                flat = into[key]
            else:
                flat = np.empty(sum(size for _, _, size in entries), dtype=np.dtype(key))
            for param, offset, size in entries:
                np.copyto(flat[offset:offset + size], self.views.flat((param, 0), param.list_data()[0]))
            buffers[key] = flat
        return buffers

    def _copy_in(self, layout: Layout, buffers: dict[str, np.ndarray]) -> None:
        for key, entries in layout.items():
            flat = buffers[key]
            for param, offset, size in entries:
                value = flat[offset:offset + size]
                for index, copy in enumerate(param.list_data()):
                    np.copyto(self.views.flat((param, index), copy), value)

    def after_update(self, before: dict[str, np.ndarray] | None) -> None:
        """The optimizer moved the parameters from ``before``: gossip, then write z back.

        Where x can be the parameters' own memory (:meth:`_mixes_in_place`), the round
        mixes them in place: x <- the new values costs nothing, and nothing is written back
        (two passes over the model a step: the share sent, the mix). Otherwise, when the
        last mix wrote x itself (w = 1, nothing in flight), ``before`` is x and the update is
        x <- the new values: they are copied straight into x.
        """
        if self.direct:
            self._mix_in_place()
            return
        if self.averager is None:  # after the first-step broadcast: every rank starts equal
            self.averager = self._new_averager(before, start_equal=True)
        if before is self.averager.x:
            self.pack(into=self.averager.x)
        else:
            self.averager.apply_update(before, self.pack())
        self.averager.step()
        self.unpack(self.averager.model())

    def _new_averager(self, buffers: dict[str, np.ndarray], start_equal: bool = False) -> GossipAverager:
        if self.compression is not None:  # each parameter compressed on its own, as allreduce mode does
            config = runtime.current("compressed gossip").config
            parts = {key: [size for _, _, size in entries] for key, entries in self.layout.items()}
            return ChocoAverager(buffers, self.compression, self.gamma, tag=self.tag, start_equal=start_equal,
                                 parts=parts, min_compress_bytes=config.min_compress_bytes,
                                 partition_bytes=config.partition_bytes)
        if self.groups is not None:
            args = {**self.averager_args, "graph": self.graph_spec}  # a name: built for the number of hosts
            log.info("gossip by host: %d hosts of %d workers, exact within a host, one message per host pair "
                     "(BPS_GOSSIP_HOST_REDUCE=off: flat)", len(self.groups), len(self.groups[0]))
            return HostAverager(buffers, self.groups, tag=self.tag, **args)
        hold = self.direct and GossipAverager.holds_model_for(self.averager_args["push_sum"],
                                                              self.averager_args["overlap"])
        averager = GossipAverager(buffers, tag=self.tag, hold_model=hold, **self.averager_args)
        if self.slow_ranks and start_equal:
            averager.route_around(self.slow_ranks)
        return averager

    def slow_links(self) -> dict[int, float]:
        """The ranks gossip routes around now, each with how late its messages were (seconds: the
        routing's score when last measured); what mode='auto' weighs allreduce's step against."""
        routing = getattr(self.averager, "routing", None)
        if routing is None:  # no round since a restart (what was known holds), or routing is off
            return dict(self.slow_lateness) if self.averager is None else {}
        return {rank: routing.lateness.get(rank, self.slow_lateness.get(rank, 0.0)) for rank in routing.slow}

    def flush(self) -> None:
        """Absorb every open gossip round (and deferred messages that arrived) and write z back."""
        if self.averager is not None and (self.averager.open or self.averager.owed):
            if self._holds_model():
                self.averager.use_buffers(self._current())
            self.averager.flush()
            self._write_model(self.averager.model())

    def _packed_averager(self) -> GossipAverager:
        """The averager, or, where it mixes the parameters in place, one on flat copies of them:
        the exact collectives then take one push_pull per dtype, not one per parameter."""
        if self._holds_model():
            self.averager.use_buffers(self._current())
            return self.averager
        if self.direct and not (self.averager is not None and self.averager.owns_x):
            return self._new_averager(self.pack())
        if self.averager is None:
            self.averager = self._new_averager(self.pack())
        return self.averager

    def average_exactly(self, measure: bool = False) -> float | None:
        """Make every rank's parameters the exact average (through the servers); with ``measure``,
        return how far the ranks were from it (RMS over ranks and elements, every rank alike)."""
        averager = self._packed_averager()
        drift = averager.average_exactly(measure)
        if averager is self.averager:
            self._write_model(averager.model())
        else:
            self.unpack(averager.model())
        return drift

    def consensus_distance(self) -> float:
        """RMS distance of this rank's parameters from the average over ranks."""
        averager = self._packed_averager()
        distance = averager.consensus_distance()
        if self._holds_model():  # z took the step since the last round: the copies follow it
            self._write_model(averager.model())
        return distance
