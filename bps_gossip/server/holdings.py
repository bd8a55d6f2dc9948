"""What one worker can make a server hold, bounded: the rounds it opened that no other rank
has completed yet, and the tensor names the server remembers.

A member of the job (a process holding the secret) could otherwise open rounds for names no
other rank pushes, each holding a copy of its payload until BPS_GOSSIP_TIMEOUT, or push under
new names without end. A round's cost is charged to the rank that opened it until it leaves
the table (completed, failed or expired), and a push past its rank's bound is refused with a
message saying which bound.
"""

from __future__ import annotations

import collections
from typing import Any

MAX_OPEN_ROUNDS_PER_RANK = 1 << 16  # rounds one rank opened that are still waiting for others
MAX_OPEN_BYTES_PER_RANK = 4 << 30  # what the server holds for them (payload copies, headers)
MAX_TENSOR_NAMES = 1 << 16  # keys whose names are remembered (to refuse two names on one key)
MAX_PARTS_SEEN = 1024  # partitions recorded per key (for Stats)


class AggregationTable(dict):
    """Open rounds by round id, with the count and bytes charged to each opening rank.

    Every removal goes through :meth:`pop`, which gives the charge back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[int] = collections.Counter()
        self.bytes: collections.Counter[int] = collections.Counter()

    def refusal(self, rank: int, nbytes: int) -> str | None:
        """Why ``rank`` may not open a round holding ``nbytes`` now, or None."""
        if self.count[rank] >= MAX_OPEN_ROUNDS_PER_RANK:
            return (f"rank {rank} opened {self.count[rank]} rounds that no other rank has completed yet, "
                    f"the most a server keeps open for one rank")
        if self.bytes[rank] + nbytes > MAX_OPEN_BYTES_PER_RANK:
            return (f"rank {rank}'s open rounds hold {self.bytes[rank]} bytes on this server; {nbytes} more would "
                    f"pass the {MAX_OPEN_BYTES_PER_RANK} a server holds for one rank")
        return None

    def open(self, rid: Any, agg: Any, rank: int, nbytes: int) -> None:
        """Add ``agg``, charged to ``rank``."""
        agg.opened_by, agg.held = rank, nbytes
        self[rid] = agg
        self.count[rank] += 1
        self.bytes[rank] += nbytes

    def pop(self, rid: Any, default: Any = None) -> Any:
        """Remove a round and give its charge back."""
        agg = super().pop(rid, default)
        if agg is not None and agg is not default and agg.opened_by >= 0:
            rank = agg.opened_by
            agg.opened_by = -1  # charged once, given back once
            self.count[rank] -= 1
            self.bytes[rank] -= agg.held
            if not self.count[rank]:
                del self.count[rank], self.bytes[rank]
        return agg


class TensorNames:
    """key -> tensor name for the newest MAX_TENSOR_NAMES keys, and the partitions seen of each.

    Two names on one key are refused among the keys remembered; a job that pushes under ever
    new names (one per step, say) only makes the oldest be forgotten.
    """

    def __init__(self) -> None:
        self._names: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.parts: dict[int, set[int]] = {}

    def name_of(self, key: int, name: str) -> str:
        """The name ``key`` is known by (``name``, if it was not known)."""
        known = self._names.get(key)
        if known is None:
            if len(self._names) >= MAX_TENSOR_NAMES:
                oldest, _ = self._names.popitem(last=False)
                self.parts.pop(oldest, None)
            self._names[key] = known = name
        else:
            self._names.move_to_end(key)
        return known

    def saw_part(self, key: int, part: int) -> None:
        """Record that partition ``part`` of ``key`` was pushed (a bounded number per key)."""
        if key not in self._names:
            return
        parts = self.parts.setdefault(key, set())
        if len(parts) < MAX_PARTS_SEEN:
            parts.add(part)

    def __len__(self) -> int:
        return len(self._names)
