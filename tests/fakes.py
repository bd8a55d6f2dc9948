"""In-process fakes of what the gossip and elastic cores are given: no sockets, no processes.

FakeNetwork connects N ranks in one process. Each rank gets a FakeLink (the gossip Link):
messages are copied at send (as if on the wire) and either delivered at once or held
until ``deliver()`` (``hold=True``), so an expect() future completes at once or later.
The network counts what is in flight (sent and not yet ``consumed``) to check that
push-sum keeps the mass, and the shared-memory sends that were never acknowledged.
``push_pull`` is a real collective across the ranks' threads (run them with ``run_ranks``).

FakeComm is the elastic Comm of one rank of a FakeWorld: broadcasts between threads,
a reset that moves every rank to a new size, a commit_check answer set by the test.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bps_gossip.errors import JobEndedError

TIMEOUT = 20.0  # a backstop against a hang: the fakes never wait for time otherwise


def run_ranks(size: int, body: Callable[[int], Any], timeout: float = TIMEOUT) -> list[Any]:
    """Run ``body(rank)`` for every rank in its own thread; the results in rank order (the
    first error is raised)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


class _Collective:
    """Sum by name across ranks: the n-th call of a name on every rank forms one round."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.calls: dict[tuple[int, str], int] = {}
        self.parts: dict[tuple[str, int], dict[int, np.ndarray]] = {}
        self.done: dict[tuple[str, int], np.ndarray] = {}

    def sum(self, rank: int, array: np.ndarray, name: str) -> np.ndarray:
        with self.cond:
            count = self.calls.get((rank, name), 0)
            self.calls[rank, name] = count + 1
            key = (name, count)
            parts = self.parts.setdefault(key, {})
            parts[rank] = np.array(array, copy=True)
            first = next(iter(parts.values()))
            if parts[rank].shape != first.shape or parts[rank].dtype != first.dtype:
                raise ValueError(f"collective {name!r}: rank {rank} sent {parts[rank].dtype} {parts[rank].shape}, "
                                 f"another {first.dtype} {first.shape}")
            if len(parts) == self.size:
                self.done[key] = np.sum([parts[r] for r in sorted(parts)], axis=0).astype(first.dtype)
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: key in self.done, TIMEOUT):
                raise TimeoutError(f"collective {name!r}: ranks {sorted(parts)} of {self.size} came")
            return self.done[key].copy()


class FakeNetwork:
    """N in-process ranks; ``local`` groups ranks into hosts of that many (shared memory)."""

    def __init__(self, size: int, local: int = 1, hold: bool = False, slow: dict[int, float] | None = None) -> None:
        self.size = size
        self.local = local
        self.hold = hold
        self.slow = dict(slow or {})  # rank -> seconds every message to or from it takes
        self.timers: list[threading.Timer] = []
        self.lock = threading.Lock()
        self.held: list[tuple[int, int, dict[str, Any], list[np.ndarray]]] = []
        self.mailbox: dict[tuple[int, str, int], dict[int, tuple[dict[str, Any], list[np.ndarray]]]] = {}
        self.waiting: dict[tuple[int, str, int], tuple[list[int], concurrent.futures.Future]] = {}
        self.in_flight: dict[tuple[int, int, str, int], tuple[dict[str, Any], list[np.ndarray]]] = {}
        self.unacked: set[tuple[int, int, str, int]] = set()  # shared-memory sends not consumed
        self.sent = 0
        self.collective = _Collective(size)

    def link(self, rank: int) -> FakeLink:
        """The gossip Link of ``rank``."""
        return FakeLink(self, rank)

    def links(self) -> list[FakeLink]:
        """Every rank's link."""
        return [self.link(rank) for rank in range(self.size)]

    def host(self, rank: int) -> int:
        """The host ``rank`` runs on."""
        return rank // self.local

    # -- messages --------------------------------------------------------------------
    def send(self, src: int, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Copy the message now (the wire), deliver it now or at ``deliver()``."""
        if not 0 <= dst < self.size or dst == src:
            raise ValueError(f"rank {src} sent to rank {dst}")
        copies = [np.array(a, copy=True) for a in arrays]
        header = {**header, "sent": time.time()}  # as the worker's channel sends it (one header a message)
        ident = (src, dst, str(header["tag"]), int(header["round"]))
        with self.lock:
            if ident in self.in_flight:
                raise AssertionError(f"rank {src} sent round {ident[3]} of {ident[2]!r} to rank {dst} twice")
            self.in_flight[ident] = (header, copies)
            self.sent += 1
            if "shm" in header:
                self.unacked.add(ident)
            if self.hold:
                self.held.append((src, dst, header, copies))
                return
            delay = max(self.slow.get(src, 0.0), self.slow.get(dst, 0.0))
            if delay:  # a slow link: the message arrives later, in order (one timer per message)
                timer = threading.Timer(delay, self._deliver, (src, dst, header, copies))
                timer.daemon = True
                self.timers.append(timer)
                timer.start()
                return
        self._deliver(src, dst, header, copies)

    def deliver(self) -> int:
        """Deliver every held message; how many."""
        with self.lock:
            held, self.held = self.held, []
        for message in held:
            self._deliver(*message)
        return len(held)

    def _deliver(self, src: int, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        key = (dst, str(header["tag"]), int(header["round"]))
        header["arrived"] = time.monotonic()  # as the worker's channel stamps it
        header["transit"] = time.time() - header["sent"]
        with self.lock:
            self.mailbox.setdefault(key, {})[src] = (header, arrays)
            complete = self._take(key)
        if complete is not None:
            complete[0].set_result(complete[1])

    def _take(self, key: tuple[int, str, int]) -> tuple[concurrent.futures.Future, dict[int, Any]] | None:
        """(future, result) when everything ``key``'s waiter expects is in (under the lock)."""
        waiter = self.waiting.get(key)
        box = self.mailbox.get(key, {})
        if waiter is None or not set(waiter[0]) <= set(box):
            return None
        del self.waiting[key]
        return waiter[1], {src: box.pop(src) for src in waiter[0]}

    def expect(self, dst: int, tag: str, rnd: int, sources: list[int]) -> concurrent.futures.Future:
        """A future completing with {source: (header, arrays)}."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        key = (dst, tag, rnd)
        with self.lock:
            if key in self.waiting:
                raise AssertionError(f"rank {dst} expects round {rnd} of {tag!r} twice")
            self.waiting[key] = (list(sources), future)
            complete = self._take(key)
        if complete is not None:
            complete[0].set_result(complete[1])
        return future

    def consumed(self, dst: int, received: dict[int, tuple[dict[str, Any], list[np.ndarray]]]) -> None:
        """The receiver read these messages: they are no longer in flight."""
        with self.lock:
            for src, (header, _) in received.items():
                ident = (src, dst, str(header["tag"]), int(header["round"]))
                del self.in_flight[ident]
                self.unacked.discard(ident)

    def in_flight_sum(self, index: int = 0) -> float:
        """The sum of array ``index`` over messages sent and not consumed."""
        with self.lock:
            return float(sum(np.sum(arrays[index], dtype=np.float64) for _, arrays in self.in_flight.values()))

    def in_flight_weight(self) -> float:
        """The push-sum weight carried by messages sent and not consumed."""
        with self.lock:
            return float(sum(header["weight"] or 0.0 for header, _ in self.in_flight.values()))


class FakeLink:
    """One rank's gossip Link over a FakeNetwork."""

    def __init__(self, network: FakeNetwork, rank: int, timeout: float = TIMEOUT) -> None:
        self.network = network
        self.rank = rank
        self.size = network.size
        self._timeout = timeout
        self.scaled_sends = 0

    def send(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Send copies of ``arrays``."""
        self.network.send(self.rank, dst, header, arrays)

    def is_local(self, dst: int) -> bool:
        """Same fake host."""
        return self.network.host(dst) == self.network.host(self.rank)

    def send_scaled(self, dst: int, header: dict[str, Any], arrays: list[np.ndarray], scale: float) -> None:
        """``scale * array`` through 'shared memory' (the receiver must acknowledge it)."""
        assert self.is_local(dst), f"send_scaled from rank {self.rank} to rank {dst} on another host"
        self.scaled_sends += 1
        scaled = [a.reshape(-1) * a.dtype.type(scale) for a in arrays]
        self.network.send(self.rank, dst, {**header, "shm": [self.rank, dst]}, scaled)

    def consumed(self, received: dict[int, tuple[dict[str, Any], list[np.ndarray]]]) -> None:
        """Acknowledge what an expect() result held."""
        self.network.consumed(self.rank, received)

    def expect(self, tag: str, rnd: int, sources: list[int]) -> concurrent.futures.Future:
        """See FakeNetwork.expect."""
        return self.network.expect(self.rank, tag, rnd, sources)

    def push_pull(self, array: np.ndarray, name: str, average: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The sum (or mean) over the ranks (call from every rank's thread)."""
        total = self.network.collective.sum(self.rank, np.asarray(array), name)
        if average:
            total = total / total.dtype.type(self.size) if total.dtype.kind == "f" else total // self.size
        if out is None:
            return total
        np.copyto(out, total)
        return out

    def gather_rows(self, row: np.ndarray, name: str) -> np.ndarray:
        """Every rank's row, as the servers keep it: only what each rank put in its own row."""
        matrix = np.zeros((self.size, np.asarray(row).size), np.asarray(row).dtype)
        matrix[self.rank] = row
        return self.network.collective.sum(self.rank, matrix, name)

    def timeout(self) -> float:
        """The backstop for expect() futures."""
        return self._timeout


class FakeWorld:
    """The job that FakeComms share: its size can change (``change``) as in an elastic job."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.generation = 1
        self.joining = False  # commit_check's answer
        self.commit_error: BaseException | None = None  # commit_check raises it instead
        self.restore = False  # reset's answer
        self.collective = _Collective(size)
        self.ended = False

    def change(self, size: int, restore: bool = False) -> None:
        """The next reset moves every rank into a job of ``size`` workers."""
        self.size = size
        self.restore = restore
        self.collective = _Collective(size)
        self.generation += 1


class FakeComm:
    """One rank's elastic Comm in a FakeWorld (calls are recorded in ``calls``)."""

    def __init__(self, world: FakeWorld, rank: int, initialized: bool = True) -> None:
        self.world = world
        self._rank = rank
        self.initialized = initialized
        self.calls: list[str] = []
        self.next_rank: int | None = None  # the rank after the next reset (default: unchanged)

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self) -> None:
        self.calls.append("init")
        self.initialized = True

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def generation(self) -> int:
        return self.world.generation

    def is_elastic(self) -> bool:
        return True

    def broadcast(self, array: np.ndarray, name: str, root_rank: int = 0) -> np.ndarray:
        self.calls.append(f"broadcast {name}")
        mine = np.asarray(array) if self._rank == root_rank else np.zeros_like(np.asarray(array))
        if mine.dtype.kind == "f":  # sum the raw bits, as the real broadcast does
            return self.world.collective.sum(self._rank, mine.view(f"u{mine.itemsize}"), name).view(mine.dtype)
        return self.world.collective.sum(self._rank, mine, name)

    def commit_check(self) -> bool:
        self.calls.append("commit_check")
        if self.world.commit_error is not None:
            raise self.world.commit_error
        return self.world.joining

    def reset(self) -> bool:
        self.calls.append("reset")
        if self.next_rank is not None:
            self._rank, self.next_rank = self.next_rank, None
        return self.world.restore

    def holds_state(self) -> None:
        self.calls.append("holds_state")

    def training_finished(self) -> None:
        self.calls.append("training_finished")

    def exit_job_over(self, exc: JobEndedError) -> None:
        self.calls.append("exit_job_over")
        raise SystemExit(0)


def comms(world: FakeWorld, ranks: Sequence[int] | None = None) -> list[FakeComm]:
    """A FakeComm for each rank of ``world``."""
    return [FakeComm(world, rank) for rank in (range(world.size) if ranks is None else ranks)]
