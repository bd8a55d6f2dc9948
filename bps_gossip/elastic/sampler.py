"""A sampler that splits what is left of an epoch over whoever is in the job.

Every rank holds the same list of the epoch's remaining sample indices and takes
every size()-th one from its rank (padded, as Horovod does, so that all ranks take
the same number of batches). Ranks consume in lockstep, so after ``consumed``
samples per rank the set processed by the whole job follows from (remaining, the
size of the split, consumed) alone: after a reset and a sync from rank 0 each rank
removes it and re-splits the rest over the new size. Nothing is repeated beyond the
padding, nothing is skipped.

Rank and size come from a :class:`~.comm.Comm` given as ``comm=`` (the default comm when
None); (0, 1) before the job is initialized.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .comm import Comm, resolve


def _split(remaining: np.ndarray, size: int, rank: int) -> tuple[np.ndarray, int]:
    """This rank's share and how many entries at its end are padding."""
    per_rank = math.ceil(len(remaining) / size) if len(remaining) else 0
    mine = remaining[rank::size]
    padded = per_rank - len(mine)
    if padded:  # repeat from the start of the list so every rank takes as many batches
        mine = np.concatenate([mine, remaining[:padded]])
    return mine, padded


class ElasticSampler:
    """Indices of this rank's share of the epoch; re-split after every membership change.

    Call ``set_epoch(epoch)`` at the start of every epoch and ``record_batch(batch_index,
    batch_size)`` after each step; keep the sampler in the elastic state
    (``ObjectState(sampler=...)`` or ``GluonState(..., sampler=...)``). ``comm``: the job
    (:class:`~.comm.Comm`); None uses the default comm.
    """

    def __init__(self, dataset_len: int, shuffle: bool = True, seed: int = 0, comm: Comm | None = None) -> None:
        if dataset_len < 0:
            raise ValueError(f"ElasticSampler: dataset_len={dataset_len} must be >= 0")
        self.dataset_len = int(dataset_len)
        self.shuffle = shuffle
        self.seed = seed
        self._comm = comm
        self.epoch = 0
        self.remaining = self._order(0)
        self.split_size = 1
        self.consumed = 0  # samples taken by each rank from the current split
        self.indices = self.remaining
        self.padded = 0  # the last `padded` entries of `indices` repeat samples (for equal lengths)
        self._iter_start = 0
        self.set_epoch(0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.dataset_len, dtype=np.int64)
        return np.random.default_rng((self.seed, epoch)).permutation(self.dataset_len).astype(np.int64)

    def _world(self) -> tuple[int, int]:
        comm = resolve(self._comm)
        return (comm.rank(), comm.size()) if comm.is_initialized() else (0, 1)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: all of its samples remain, split over the current size."""
        self.epoch = int(epoch)
        self.remaining = self._order(self.epoch)
        self.consumed = 0
        self._resplit()

    def _resplit(self) -> None:
        rank, size = self._world()
        self.split_size = size
        self.indices, self.padded = _split(self.remaining, size, rank)

    def processed(self) -> np.ndarray:
        """The indices of this epoch the whole job has processed since the last split (sorted)."""
        done = [_split(self.remaining, self.split_size, r)[0][: self.consumed] for r in range(self.split_size)]
        return np.unique(np.concatenate(done)) if done else np.empty(0, np.int64)

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Mark batches 0..batch_index of the current iteration (``batch_size`` samples each) done."""
        self.consumed = min(len(self.indices), self._iter_start + (batch_index + 1) * batch_size)

    def on_sync(self) -> None:
        """After a sync from rank 0: drop what the job processed, split the rest over size()."""
        if self.consumed:
            self.remaining = self.remaining[~np.isin(self.remaining, self.processed())]  # keeps the order
        self.consumed = 0
        self._resplit()

    def is_padding(self, position: int) -> bool:
        """True when ``indices[position]`` only pads this rank's share (weight it 0 to count samples once)."""
        return position >= len(self.indices) - self.padded

    def state_dict(self) -> dict[str, Any]:
        """What a sync sends and a commit saves."""
        return {"epoch": self.epoch, "remaining": self.remaining.copy(), "split_size": self.split_size,
                "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved or synced state (call ``on_sync`` or iterate afterwards)."""
        self.epoch = int(state["epoch"])
        self.remaining = np.asarray(state["remaining"], dtype=np.int64)
        self.split_size = int(state["split_size"])
        self.consumed = int(state["consumed"])
        rank, _ = self._world()
        self.indices, self.padded = _split(self.remaining, self.split_size, min(rank, self.split_size - 1))

    def __iter__(self) -> Iterator[int]:
        """This rank's indices not consumed yet; record_batch counts from here."""
        self._iter_start = self.consumed
        return iter(self.indices[self.consumed:].tolist())

    def __len__(self) -> int:
        """How many indices an iteration yields now."""
        return len(self.indices) - self.consumed
