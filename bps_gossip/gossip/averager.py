"""GossipAverager: the state of Stochastic Gradient Push on one worker.

It owns the numerators x (flat numpy buffers, one per dtype group or any key) and the
push-sum weight w. The trainer applies its local optimizer step to the de-biased model
z = x / w and hands the displacement back (``apply_update``); ``step`` then runs one
gossip round. With ``overlap`` the round is only started (its messages leave, the sent
mass is taken out of x at once) and absorbed at a later step: at most ``synch_freq``
rounds may stay open, so ``synch_freq=0`` means "one step stale", as in SGP.

Messages and the exact collectives go through a :class:`~.link.Link` passed as ``link``
(by default the link of the initialized worker, see :func:`.link.default_link`).

With ``route_slow_links`` (push-sum, three workers or more) the ranks measure how late each
peer's messages come and route around a slow one together (:mod:`.routing`): its edges are
thinned and nobody waits for them; their messages are absorbed when they arrive.

With ``hold_model`` (push-sum with overlap) the averager holds z itself, not x: x = w * z
with w a number, so z can be the model's own memory (:meth:`use_buffers`) while rounds are
open. A share s leaves as s * w * z and the kept share is w <- kept * w (no pass over z); the
caller's step (z moved since the last round) and the received shares go in with one pass.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import TensorMismatchError
from ..gathered import robust_mean, usable_rows
from .gossipers import PendingRound, PushPull, PushSum, mix_model, move_model
from .graphs import Graph, make_graph, symmetric_mixing_is_doubly_stochastic
from .link import Link, default_link
from .routing import MAX_OWED, SlowLinkRouting

log = logging.getLogger("bps_gossip.worker")  # the worker's handler and BYTEPS_LOG_LEVEL


class GossipAverager:
    """Gossip averaging of named flat numpy buffers across all workers (collective: every
    rank creates one with the same keys, shapes and arguments, and steps it in lockstep).
    ``link``: the workers' link (:class:`~.link.Link`); None takes the default link."""

    def __init__(self, buffers: Mapping[str, np.ndarray], graph: str | Graph = "npdde", peers_per_itr: int = 1,
                 push_sum: bool = True, overlap: bool = False, synch_freq: int = 0, tag: str = "gossip",
                 mixing: object = None, link: Link | None = None, route_slow_links: bool = True,
                 hold_model: bool = False) -> None:
        self._start(buffers, link, tag)
        self.graph = self.check_arguments(self.size, graph, peers_per_itr, push_sum, overlap, synch_freq,
                                          route_slow_links)
        self.overlap = overlap
        self.synch_freq = synch_freq
        # The weight must travel unless every round is regular, complete and closed at once.
        track = overlap or not self.graph.is_regular
        self.gossiper = PushSum(self.graph, self.link, tag, mixing, track) if push_sum else PushPull(self.graph, self.link, tag)
        if route_slow_links and push_sum and self.size >= 3:
            self.routing = SlowLinkRouting(self.size, self.rank)
        if hold_model:
            if not self.holds_model_for(push_sum, overlap):
                raise ValueError("gossip: hold_model=True needs push_sum=True and overlap=True")
            self.holds_z = True
            self.last = {key: value.copy() for key, value in self.x.items()}

    def _start(self, buffers: Mapping[str, np.ndarray], link: Link | None, tag: str) -> None:
        """The state every averager starts with: the link, copies of the buffers as x (floating
        point only), w = 1, round 0, no round open."""
        self.link = default_link() if link is None else link
        self.rank, self.size = self.link.rank, self.link.size
        self.x = {key: np.array(value, copy=True).reshape(-1) for key, value in buffers.items()}
        for key, value in self.x.items():
            if value.dtype.kind != "f":
                raise TypeError(f"{type(self).__name__}: buffer {key!r} is {value.dtype}; gossip averages "
                                "floating point only")
        self.weight, self.rnd, self.tag = 1.0, 0, tag
        self.overlap, self.synch_freq = False, 0
        self.open: collections.deque[PendingRound] = collections.deque()
        self.owed: collections.deque[PendingRound] = collections.deque()  # deferred receipts (routing)
        self.routing: SlowLinkRouting | None = None
        self.borrowed = False  # x is the caller's memory (use_buffers)
        self.took_x = False  # routing took x back from the caller's memory (weights travel meanwhile)
        self.holds_z = False  # x holds z, the numerators being weight * z (hold_model)
        self.last: dict[str, np.ndarray] = {}  # with holds_z: z as the last pass left it (steps are from it)
        self.settled = False  # with holds_z: z is last (a pass since the caller could move z)

    @property
    def owns_x(self) -> bool:
        """False while x may be the caller's memory (:meth:`use_buffers`); True while routing
        around a slow rank (z = x / w: the weights travel), until no rank is slow any more."""
        return self.took_x

    @staticmethod
    def model_is_x(graph: Graph, push_sum: bool, overlap: bool) -> bool:
        """Whether z = x at every step for these arguments: w stays 1 (a regular graph, or
        push-pull) and no round stays open. Then x may be the model's own memory
        (:meth:`use_buffers`)."""
        return not overlap and (graph.is_regular or not push_sum)

    @staticmethod
    def holds_model_for(push_sum: bool, overlap: bool) -> bool:
        """Whether ``hold_model`` applies: push-sum with rounds left open (the weights travel)."""
        return push_sum and overlap

    def use_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """From now on x is ``buffers`` themselves, not a copy (the same keys, sizes and dtypes,
        one-dimensional): the model's own memory, mixed in place. Only where
        :meth:`model_is_x` holds, since z = x / w is then x, or with ``hold_model`` (at any
        time: x is z; what the buffers hold now counts as the caller's step since the last round)."""
        if list(buffers) != list(self.x) or (not self.holds_z and (self.weight != 1.0 or self.open or self.owns_x)):
            raise ValueError("gossip: x can be the model's memory only while w is 1 and no round is open, "
                             "with the same keys")
        for key, value in buffers.items():
            held = self.x[key]
            if value.ndim != 1 or value.size != held.size or value.dtype != held.dtype:
                raise ValueError(f"gossip: buffer {key!r} is {value.dtype} {value.shape}, x is {held.dtype} "
                                 f"{held.shape}")
        self.x = dict(buffers)
        self.borrowed = True

    @staticmethod
    def check_arguments(size: int, graph: str | Graph, peers_per_itr: int, push_sum: bool, overlap: bool,
                        synch_freq: int, route_slow_links: bool = True) -> Graph:
        """Validate the arguments (ValueError naming the bad one); return the graph."""
        if not isinstance(route_slow_links, bool):
            raise ValueError(f"gossip: route_slow_links={route_slow_links!r} must be True or False")
        if isinstance(synch_freq, bool) or not isinstance(synch_freq, int) or synch_freq < 0:
            raise ValueError(f"gossip: synch_freq={synch_freq!r} must be an int >= 0")
        if overlap and not push_sum:
            raise ValueError("gossip: overlap=True needs push_sum=True (push-pull cannot keep a round open)")
        built = make_graph(graph, size, peers_per_itr) if isinstance(graph, str) else graph
        if built.world_size != size:
            raise ValueError(f"gossip: the graph is for {built.world_size} workers, the job has {size}")
        if not push_sum and not symmetric_mixing_is_doubly_stochastic(built):
            raise ValueError(f"gossip: push_sum=False needs neighbours of equal degree; {built.name!r} has not")
        return built

    # -- the model ----------------------------------------------------------------
    def debiased(self) -> dict[str, np.ndarray]:
        """z = x / w, as new arrays."""
        if self.holds_z:
            self.settled = False
            self._settle()
        if self.weight == 1.0 or self.holds_z:
            return {key: value.copy() for key, value in self.x.items()}
        return {key: value / value.dtype.type(self.weight) for key, value in self.x.items()}

    def model(self) -> dict[str, np.ndarray]:
        """z = x / w; x itself (no copy) when w is 1 and no round is open, so a caller that
        writes it out and does not change it may hand it back as ``before`` for free. With
        ``hold_model``: x itself, always (the caller's step since the last round taken in)."""
        if self.holds_z:
            self.settled = False
            self._settle()
            return self.x
        if self.weight == 1.0 and not self.open and not self.owed:
            return self.x
        return self.debiased()

    def apply_update(self, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> None:
        """The local optimizer moved z from ``before`` to ``after``: move x by the same amount
        (SGP: x <- x - lr * grad(z); the sum of x over ranks takes every rank's whole step, so the
        exact average is SGD's on the mean gradient), but at w < 1/2 by 2w times it, so that
        z = x / w moves by at most twice the step. A rank whose in-peers' messages are on their
        way holds a small w until they arrive (1/64 at 16 workers routed around slow ranks on
        this 2-core machine): the whole step moved its z by 64 steps, and such ranks diverged.
        Its steps then count less in the average over ranks (SGP's reference code re-biases by
        w after every step: all of them do). Banking the rest for later diverged too: the
        gradient at z keeps pointing the same way while the bank grows.

        With ``hold_model`` the step is z's move since the last round (``before`` is not read):
        ``after`` is copied into z where it is not z's memory, and the next pass over z takes
        the step by the same rule (z moves by min(1, 2w) / w times it)."""
        if self.holds_z:
            self.settled = False
            for key, value in self.x.items():
                new = np.asarray(after[key]).reshape(-1)
                if not np.shares_memory(new, value):
                    np.copyto(value, new)
            return
        scale = min(1.0, 2.0 * self.weight)
        for key, value in self.x.items():
            step = np.asarray(after[key]).reshape(-1) - np.asarray(before[key]).reshape(-1)
            if scale < 1.0:
                step = step * value.dtype.type(scale)
            value += step

    # -- gossip -------------------------------------------------------------------
    def step(self) -> None:
        """Run (or, with overlap, start) one gossip round."""
        self.settled = False  # (hold_model) the caller's step since the last round is in z
        if self.size == 1:
            self.rnd += 1
            return
        rnd = self.rnd
        tracer = getattr(self.link, "tracer", None)  # the worker's (BYTEPS_TRACE_ON), or None
        if tracer is None or not tracer.traced(rnd):
            self._round()
            return
        with self._span(tracer, "total"):
            self._round(tracer)
        tracer.finished(rnd)

    def _span(self, tracer: Any, stage: str) -> Any:
        """A trace event of ``stage`` of this gossip round around a ``with`` block (none untraced)."""
        return contextlib.nullcontext() if tracer is None else tracer.span(f"gossip.{self.tag}", stage)

    def _round(self, tracer: Any = None) -> None:
        """One round (``tracer``: record its stages)."""
        if self.overlap:
            while self.open and (len(self.open) > self.synch_freq or self.open[0].arrived()):
                self._absorb(self.open.popleft(), tracer)
        peers: dict[str, Any] = {}
        if self.routing is not None:
            self._route(tracer)
            sends, waits, deferred = self.routing.split(self.graph.out_peers(self.rank, self.rnd),
                                                        self.graph.in_peers(self.rank, self.rnd), self.rnd)
            peers = {"out_peers": sends, "sources": waits, "heavy": self.routing.heavy(sends)}
        # Absorbed at once (no overlap): the kept share is taken with the additions, one pass
        # over x; an open round must take it now, before x changes.
        with self._span(tracer, "SEND"):
            if self.holds_z:
                self._settle()  # the step, where no absorb took it: z must be whole before it leaves
                peers["holds_model"] = True  # (push-sum only)
            pending, self.weight = self.gossiper.begin(self.rnd, self.x, self.weight,
                                                       defer_scaling=not self.overlap, **peers)
            peers.pop("holds_model", None)
        if peers:
            self.owed.extend(PendingRound(self.rnd, self.link.expect(self.tag, self.rnd, [src]), [src],
                                          started=pending.started) for src in deferred)
        self.rnd += 1
        if self.overlap:
            self.open.append(pending)
        else:
            self._absorb(pending, tracer)

    def _route(self, tracer: Any) -> None:
        """Before a round: absorb the deferred messages that arrived (waiting for a source's
        oldest past MAX_OWED of it); every WINDOW rounds, decide with every rank which ranks
        are slow (collective)."""
        self._absorb_owed(tracer)
        routing = self.routing
        if not routing.due(self.rnd, time.monotonic()):
            return
        try:  # every rank's own measurements: none can speak for another
            rows = self.link.gather_rows(routing.measurements(time.monotonic()), f"{self.tag}.route")
        except TensorMismatchError as exc:  # a rank pushed something else: no decision this window, on any rank
            log.warning("gossip %r at round %d: no routing decision this window: %s", self.tag, self.rnd, exc)
            return
        if routing.decide(np.asarray(rows, dtype=np.float64), self.rnd, time.monotonic()):
            log.info("gossip %r at round %d: %s", self.tag, self.rnd, routing.describe())
            if routing.slow and not self.gossiper.track_weight:
                self._take_x()
            elif not routing.slow and self.took_x:
                self._give_back_x()

    def route_around(self, slow: Mapping[int, int]) -> None:
        """Start routing around ``slow`` (rank -> period) from the first round, as an earlier
        averager of the same job decided (collective: every rank passes the same, before any
        round)."""
        if self.routing is None or self.rnd or self.open:
            raise ValueError("gossip: route_around() needs routing on and no round run yet")
        if slow:
            self.routing.slow = dict(slow)
            self.routing.history.append((0, dict(slow)))
            if not self.holds_z:  # (with it the weights travel and x is z already)
                self._take_x()

    def _take_x(self) -> None:
        """Routing began: push-sum's weights travel from now on (every rank switches at the same
        round, while w is 1 everywhere) and x stops being the caller's memory."""
        if self.borrowed:
            self.x = {key: value.copy() for key, value in self.x.items()}
            self.borrowed = False
        self.gossiper.track_weight = True
        self.took_x = True

    def _give_back_x(self) -> None:
        """No rank is slow any more (every rank at the same round): the exact average makes w 1
        everywhere with nothing in flight, so the weights stop travelling and x may be the
        caller's memory again (one push_pull of the model)."""
        self.average_exactly()
        self.gossiper.track_weight = False
        self.took_x = False

    def _absorb_owed(self, tracer: Any = None, everything: bool = False) -> None:
        """Absorb deferred messages: those that arrived, in order; the oldest of a source that
        owes more than MAX_OWED (or, with ``everything``, all) by waiting. A slow rank waits for
        all but the newest: its edges carry once a period, the time its link takes to carry one
        model, so the message of its last exchange is due by the next, and without it the slow
        rank trained on its own shard alone (at 16 ranks it ended 10 points under the others)."""
        slow_self = self.routing is not None and self.rank in self.routing.slow
        while self.owed:
            owed_by = collections.Counter(pending.sources[0] for pending in self.owed)
            waiting = [pending for pending in self.owed
                       if everything or pending.arrived() or owed_by[pending.sources[0]] > MAX_OWED
                       or (slow_self and len(self.owed) > 1)]
            if not waiting:
                return
            pending = waiting[0]
            self.owed.remove(pending)
            self._absorb(pending, tracer)

    def _settle(self) -> None:
        """With ``hold_model``: take the caller's step since the last pass into z (z moves by
        min(1, 2w) / w times it: x moves by min(1, 2w) times it, as :meth:`apply_update` says);
        at w = 1 only ``last`` follows z (a copy). Nothing once a pass since the caller's
        last chance to move z made ``last`` z."""
        if self.settled:
            return
        factor = min(1.0, 2.0 * self.weight) / self.weight
        for key, value in self.x.items():
            move_model(value, self.last[key], factor)
        self.settled = True

    def _absorb_model(self, pending: PendingRound) -> None:
        """Absorb a round into z (``hold_model``): the caller's step since ``last`` and the
        received shares in one pass (see :func:`.gossipers.mix_model`)."""
        received, addends, got = self.gossiper.collect(pending, self.x, self.link.timeout())
        weight = self.weight
        total = weight + got
        if not np.isfinite(total) or total <= 0.0:
            raise ValueError(f"gossip {self.tag!r} round {pending.rnd}: push-sum weight {total!r} after the round")
        for key, value in self.x.items():
            mix_model(value, self.last[key], None if self.settled else min(1.0, 2.0 * weight), weight,
                      addends[key], total)
        self.weight, self.settled = total, True
        if received:
            self.link.consumed(received)

    def _absorb(self, pending: PendingRound, tracer: Any = None) -> None:
        with self._span(tracer, "MIX"):
            if self.holds_z:
                self._absorb_model(pending)
            else:
                self.weight = self.gossiper.absorb(pending, self.x, self.weight, self.link.timeout())
        if self.routing is not None and pending.rnd > 0:  # round 0 also opens the connections
            for src, delay in pending.delays.items():
                self.routing.record(src, delay, pending.transits.get(src))
            self.routing.waited(pending.waited)

    def flush(self) -> None:
        """Absorb every open round, and the deferred messages that arrived (before evaluating,
        saving or stopping)."""
        self.settled = False
        while self.open:
            self._absorb(self.open.popleft())
        # A slow rank waits for what is on its way to it: nobody waits for it, and its model is
        # about to be evaluated or saved (a transit of its link, once an epoch).
        self._absorb_owed(everything=self.routing is not None and self.rank in self.routing.slow)

    def drain(self) -> None:
        """Absorb everything in flight to this rank, waiting for deferred messages too."""
        self.flush()
        self._absorb_owed(everything=True)

    # -- exact collectives through the servers ------------------------------------
    def average_exactly(self, measure: bool = False) -> float | None:
        """Make every rank hold the exact average (sum of x over sum of w), with w = 1.

        With ``measure``, return how far the ranks were from it: the RMS over elements of
        z - average of the median rank (the same number on every rank, and no one rank's report
        moves it past the others'; one gather_rows of one number each)."""
        self.drain()
        if self.size == 1:
            return 0.0 if measure else None
        before = self.debiased() if measure else {}
        if self.holds_z:
            self._settle()
        total_weight = self.link.push_pull(np.array([self.weight]), f"{self.tag}.average.weight", average=False)[0]
        for key, value in self.x.items():
            if self.holds_z and self.weight != 1.0:  # the numerators
                value *= value.dtype.type(self.weight)
            self.link.push_pull(value, f"{self.tag}.average.{key}", average=False, out=value)
            value /= value.dtype.type(total_weight)
            if self.holds_z:
                np.copyto(self.last[key], value)
        self.weight, self.settled = 1.0, self.holds_z
        if not measure:
            return None
        squares = sum(float(np.sum(np.square(z - self.x[key], dtype=np.float64))) for key, z in before.items())
        count = sum(value.size for value in self.x.values())
        rows = self.link.gather_rows(np.array([squares / max(count, 1)]), f"{self.tag}.average.drift")
        typical = robust_mean(rows, usable_rows(rows, 0.0, np.inf, f"gossip {self.tag!r}'s drift"))[0]
        return float(np.sqrt(max(float(typical), 0.0)))  # the median rank's: one rank's report cannot move it

    def consensus_distance(self) -> float:
        """RMS distance of this rank's z from the average of z over ranks (through the servers)."""
        z = self.debiased()
        if self.size == 1:
            return 0.0
        total, count = 0.0, 0
        for key, value in z.items():
            mean = self.link.push_pull(value.astype(np.float64), f"{self.tag}.consensus.{key}", average=True)
            total += float(np.sum((value - mean) ** 2))
            count += value.size
        return float(np.sqrt(total / max(count, 1)))
