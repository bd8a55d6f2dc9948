"""Routing push-sum gossip around slow links: one slow worker slows only itself.

Every rank measures, for each message it receives, how long after the start of its own round
the message arrived (an edge's delay). Every ``WINDOW`` rounds all ranks sum these measurements
through the servers (one small push_pull) and take the same decision from the same numbers
(:func:`choose_slow`): a rank whose edges are much slower than the others' becomes *slow*.
Edges that touch a slow rank are then

- *deferred*: the receiver never blocks on them; it absorbs the message at whichever later
  round it has arrived by (push-sum stays exact with delayed messages), and waits for the
  oldest only past ``MAX_OWED`` of one source;
- *thinned*: they carry a message only once every ``period`` rounds (so that the slow link
  carries one model in the time it takes, measured); in the other rounds the sender keeps
  that share: the graph varies in time, the sums stay exact.

Push-sum's weights travel from the decision that finds a slow rank until the one that finds
none (then one exact average makes every weight 1 again). A rank stops being slow when neither
its link nor its compute is slow any more (lower thresholds, so the decision does not flap):
its link by the transit of its fastest pair (sender's and receiver's clocks, summed both ways
so their offset cancels), its compute by its seconds per round not spent waiting. At most
(n - 1) // 2 ranks are slow: when more are, they are the norm.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..gathered import usable_rows

WINDOW = 32  # rounds between two decisions
FIRST_DECISIONS = (4, 8, 16)  # and before that: a slow rank costs every round until the first one
MAX_PERIOD = 32  # a slow rank's edges carry a message at least once every this many rounds
MAX_OWED = 3  # deferred messages of one source not yet absorbed before the receiver waits for the oldest
ENTER_RATIO, LEAVE_RATIO = 1.5, 1.2  # a slow rank's edges are this much slower than the typical rank's
# Seconds a rank must be later than the typical one to be slow (a busy machine's noise; on 100
# Mbit/s links a rank 77 ms late against a typical 51 ms was jitter in 3 messages).
ENTER_FLOOR, LEAVE_FLOOR = 0.05, 0.02
MAX_HISTORY = 1024  # decisions kept (the newest: a network that keeps changing must not fill memory)
# A message on a slow rank's edge carries this many times the uniform share of the sender's mass
# (one peer a round: 3/4, the sender keeps 1/4): it comes once every period rounds, and at the
# uniform half the slow rank's model stayed far from the others' (consensus distance 4-6x theirs
# at 16 workers, its accuracy the worst by 2-5 points).
SLOW_EDGE_WEIGHT = 3.0
MIN_MESSAGES = 3  # measured each way before a rank is judged (a slow rank's are gathered across windows)
MAX_MEASURED = 1e6  # seconds: a rank's summed delays, transits or seconds a round beyond this are no measurement
MAX_COUNT = 1e9  # messages measured on one edge in a window


def rank_scores(delays: np.ndarray, counts: np.ndarray) -> tuple[dict[int, float], dict[int, float]]:
    """Per rank with MIN_MESSAGES measured each way: (its score, the mean delay of its slowest
    edge), in seconds (see :func:`choose_slow`)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, delays / np.maximum(counts, 1), np.nan)
    scores, worst = {}, {}
    for rank in range(len(mean)):
        sides = [side[~np.isnan(side)] for side in (mean[rank, :], mean[:, rank])]
        if min(counts[rank, :].sum(), counts[:, rank].sum()) >= MIN_MESSAGES:
            scores[rank] = max(float(side.min()) for side in sides)
            worst[rank] = max(float(side.max()) for side in sides)
    return scores, worst


def link_scores(transits: np.ndarray, counts: np.ndarray) -> dict[int, float]:
    """Per rank with a pair measured both ways: the mean transit of its fastest pair, seconds
    (``transits[a, b]``: the summed receive-minus-send stamps of ``counts[a, b]`` messages a -> b;
    a pair's two ways summed cancel the offset of the two clocks)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, transits / np.maximum(counts, 1), np.nan)
    pair = (mean + mean.T) / 2  # nan unless both ways were measured
    scores = {}
    for rank in range(len(pair)):
        measured = pair[rank][~np.isnan(pair[rank])]
        if measured.size:
            scores[rank] = max(float(measured.min()), 0.0)
    return scores


def _above(value: float, typical: Sequence[float], ratio: float, floor: float) -> bool:
    """Whether ``value`` is ``ratio`` times the median of ``typical`` and ``floor`` seconds more."""
    median = float(np.median(typical))
    return value > ratio * median and value - median > floor


def choose_slow(delays: np.ndarray, counts: np.ndarray, round_seconds: np.ndarray,
                slow: Mapping[int, int], transits: np.ndarray | None = None,
                busy_seconds: np.ndarray | None = None) -> dict[int, int]:
    """The slow ranks and their periods (rounds between messages on their edges) for the next
    window: a pure function of the summed measurements, so every rank decides the same.

    ``delays[a, b]`` / ``counts[a, b]``: the summed delays (seconds) and the number of messages
    measured on edge a -> b (by b); ``round_seconds[r]``: rank r's seconds per round in the
    window; ``slow``: the current decision; ``transits[a, b]``: the summed transits (plus the
    clocks' offset) of those messages, ``busy_seconds[r]``: rank r's seconds per round not spent
    waiting for messages (without them, a slow rank leaves when its lateness is normal again).

    A rank's score is the delay of its fastest out-edge or of its fastest in-edge, whichever is
    larger (each edge's mean over the window), once MIN_MESSAGES were measured each way (a
    slow rank not judged stays as it is); it becomes slow when its score is ENTER_RATIO times
    the median score and ENTER_FLOOR seconds more: a slow worker is late for everyone it sends
    to, a slow link is late both ways, while a rank the slow one holds up is late only in the rounds
    it waited for it, so one of its edges each way stays fast. It stays slow while its link or
    its compute is LEAVE_RATIO times the median and LEAVE_FLOOR seconds more. While a slow
    rank holds the others up, they are late for each other too, so at most one rank becomes
    slow per window (the worst): once nobody waits for it, the next window shows whether
    another one is slow.
    """
    n = len(round_seconds)
    scores, worst = rank_scores(delays, counts)
    if len(scores) < 3:  # nothing to compare with: keep the decision
        return dict(slow)
    typical = float(np.median(list(scores.values())))
    per_round = max(float(np.median(round_seconds)), 1e-6)

    def is_slow(rank: int, ratio: float, floor: float) -> bool:  # the floor applies to what it adds
        return scores[rank] > ratio * typical and scores[rank] - typical > floor

    if transits is not None and busy_seconds is not None:
        links = link_scores(transits, counts)
        fast = [other for other in range(n) if other not in slow]  # a pair through a slow rank is not typical
        typical_links = list(link_scores(transits[np.ix_(fast, fast)], counts[np.ix_(fast, fast)]).values())

    def stays(rank: int) -> bool:
        if transits is None or busy_seconds is None:
            return rank not in scores or is_slow(rank, LEAVE_RATIO, LEAVE_FLOOR)
        return (rank not in links or not typical_links
                or _above(links[rank], typical_links, LEAVE_RATIO, LEAVE_FLOOR)
                or _above(float(busy_seconds[rank]), list(busy_seconds), LEAVE_RATIO, LEAVE_FLOOR))

    chosen = {rank: period for rank, period in slow.items() if stays(rank)}
    # (A rank that leaves is judged again on lateness measured while the others wait for it.)
    newcomers = sorted((rank for rank in scores if rank not in slow and is_slow(rank, ENTER_RATIO, ENTER_FLOOR)),
                       key=lambda rank: (-scores[rank], rank))
    if newcomers and len(chosen) < (n - 1) // 2:
        chosen[newcomers[0]] = 0
    for rank in chosen:
        if rank in worst:  # one model in the time its link takes to carry one, measured
            chosen[rank] = min(max(math.ceil(worst[rank] / per_round) + 1, 2), MAX_PERIOD)
    return chosen


class SlowLinkRouting:
    """One rank's view of which edges are deferred and thinned (see the module docstring)."""

    def __init__(self, size: int, rank: int, window: int = WINDOW) -> None:
        self.size, self.rank, self.window = size, rank, window
        self.slow: dict[int, int] = {}  # slow rank -> period
        self.history: collections.deque[tuple[int, dict[int, int]]] = collections.deque(maxlen=MAX_HISTORY)
        self.scores: dict[int, float] = {}  # the last window's, by rank (seconds)
        self.lateness: dict[int, float] = {}  # each slow rank's score when last measured (seconds)
        self.links: dict[int, float] = {}  # the last window's link (fastest pair's transit) by rank, seconds
        self.busy: dict[int, float] = {}  # and seconds a round not waiting
        self._delays = np.zeros((size, size))
        self._counts = np.zeros((size, size))
        self._transits = np.zeros((size, size))
        self._waited = 0.0  # seconds this rank blocked for messages in this window
        self._window_started: float | None = None
        self._rounds = 0  # rounds begun in this window

    def messages(self, src: int, dst: int) -> int:
        """Messages measured on edge src -> dst in this window (those carried from the last included)."""
        return int(self._counts[src, dst])

    def period(self, src: int, dst: int) -> int:
        """Rounds between messages on edge src -> dst: 0 for an edge between two fast ranks."""
        return max(self.slow.get(src, 0), self.slow.get(dst, 0))

    def carries(self, src: int, dst: int, rnd: int) -> bool:
        """Whether edge src -> dst carries a message at round ``rnd``: always between fast ranks,
        once in each block of ``period`` rounds otherwise, at a place that moves from block to
        block (so a slow rank meets every peer of a periodic graph in turn)."""
        period = self.period(src, dst)
        return period == 0 or rnd % period == (rnd // period) % period

    def split(self, out_peers: Sequence[int], in_peers: Sequence[int], rnd: int
              ) -> tuple[list[int], list[int], list[int]]:
        """This rank's round: (the out-peers it sends to, the in-peers it waits for, the in-peers
        whose messages it absorbs when they arrive)."""
        self._rounds += 1
        me = self.rank
        sends = [peer for peer in out_peers if self.carries(me, peer, rnd)]
        waits = [src for src in in_peers if self.period(src, me) == 0]
        deferred = [src for src in in_peers if self.period(src, me) and self.carries(src, me, rnd)]
        return sends, waits, deferred

    def heavy(self, sends: Sequence[int]) -> dict[int, float]:
        """The out-peers of this round whose edge touches a slow rank, with SLOW_EDGE_WEIGHT: a
        slow rank hands most of its mass to a fast peer and gets most of a fast peer's, so that
        the rare exchange pulls its model most of the way to the others'."""
        return {peer: SLOW_EDGE_WEIGHT for peer in sends if self.period(self.rank, peer)}

    def record(self, src: int, delay: float, transit: float | None = None) -> None:
        """A message from ``src`` arrived ``delay`` seconds after this rank started its round,
        ``transit`` seconds after it was sent by its sender's clock (None: not stamped, taken as
        ``delay``)."""
        self._delays[src, self.rank] += max(delay, 0.0)
        self._counts[src, self.rank] += 1
        self._transits[src, self.rank] += delay if transit is None else transit

    def waited(self, seconds: float) -> None:
        """This rank blocked ``seconds`` for messages (what its compute is not)."""
        self._waited += max(seconds, 0.0)

    def due(self, rnd: int, now: float) -> bool:
        """Whether round ``rnd`` starts with a decision: at rounds 4, 8 and 16, then every ``window``."""
        if self._window_started is None:
            self._window_started = now
        return rnd in FIRST_DECISIONS or (rnd > 0 and rnd % self.window == 0)

    def length(self) -> int:
        """This rank's row of the window's measurements: its in-edges' delays, counts and
        transits (what it measured itself, n each), its seconds per round and busy seconds per round."""
        return 3 * self.size + 2

    def measurements(self, now: float) -> np.ndarray:
        """This rank's row (:meth:`length`), for ``gather_rows``: it speaks only for itself."""
        n, me = self.size, self.rank
        row = np.zeros(self.length())
        row[:n], row[n:2 * n], row[2 * n:3 * n] = self._delays[:, me], self._counts[:, me], self._transits[:, me]
        per_round = (now - (self._window_started or now)) / max(self._rounds, 1)
        row[3 * n] = per_round
        row[3 * n + 1] = max(per_round - self._waited / max(self._rounds, 1), 0.0)
        return row

    def combine(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's row (``gather_rows``) as (delays, counts, transits, seconds per round,
        busy seconds per round). A row that is not finite or out of range counts as no
        measurement (its seconds: the median rank's), with a warning naming its rank."""
        n = self.size
        if rows.shape != (n, self.length()):
            raise ValueError(f"gossip routing: the gathered measurements have shape {rows.shape}, not "
                             f"{(n, self.length())}")
        low = np.concatenate([np.zeros(2 * n), np.full(n, -MAX_MEASURED), [0.0, 0.0]])
        high = np.concatenate([np.full(n, MAX_MEASURED), np.full(n, MAX_COUNT), np.full(n, MAX_MEASURED),
                               [MAX_MEASURED, MAX_MEASURED]])
        usable = usable_rows(rows, low, high, "gossip routing's measurements")
        rows = np.where(usable[:, None], rows, 0.0)
        seconds = rows[:, 3 * n:]
        if usable.any():
            seconds[~usable] = np.median(seconds[usable], axis=0)
        # column b of each matrix is what rank b measured on its in-edges a -> b
        delays, counts, transits = (rows[:, part * n:(part + 1) * n].T.copy() for part in range(3))
        return delays, counts, transits, seconds[:, 0].copy(), seconds[:, 1].copy()

    def decide(self, rows: np.ndarray, rnd: int, now: float) -> bool:
        """Take the decision from every rank's row (:meth:`combine`); start a new window.
        True when the slow ranks or their periods changed."""
        n = self.size
        delays, counts, transits, round_seconds, busy = self.combine(rows)
        chosen = choose_slow(delays, counts, round_seconds, self.slow, transits, busy)
        self.scores = rank_scores(delays, counts)[0]
        self.lateness = {rank: self.scores.get(rank, self.lateness.get(rank, 0.0)) for rank in chosen}
        # A slow rank not judged (too few of its thinned edges' messages): its measurements go on.
        links = link_scores(transits, counts)
        self.links, self.busy = links, dict(enumerate(float(value) for value in busy))
        carried = [rank for rank in chosen if rank not in self.scores or rank not in links]
        keep = np.zeros((n, n), dtype=bool)
        keep[carried, :] = keep[:, carried] = True
        for matrix in (self._delays, self._counts, self._transits):
            matrix[~keep] = 0
        self._window_started = now
        self._rounds, self._waited = 0, 0.0
        if chosen == self.slow:
            return False
        self.slow = chosen
        self.history.append((rnd, dict(chosen)))
        return True

    def describe(self) -> str:
        """The decision in words, for the log."""
        def by_rank(values: Mapping[int, float]) -> str:
            return ", ".join(f"{rank}: {value * 1000:.1f}" for rank, value in sorted(values.items()))

        measured = f"ms late by rank: {by_rank(self.scores)}; link: {by_rank(self.links)}; " \
                   f"computing a round: {by_rank(self.busy)}"
        if not self.slow:
            return f"no rank is slow, every edge carries every round ({measured})"
        parts = ", ".join(f"rank {rank}'s every {period} rounds" for rank, period in sorted(self.slow.items()))
        return f"routing around slow ranks: nobody waits for their edges, which carry {parts} ({measured})"
