"""The supervising loop of an elastic job over hosts (:mod:`.elastic_hosts` plans it): look at
the hosts every few seconds, start workers where there is room, stop those of dropped hosts,
blacklist the host of a worker that failed, and end with the scheduler."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import signal
import time
from typing import Protocol

from ..errors import ConfigError
from .backend import Process
from .diagnosis import error_line, not_worth_a_restart
from .discovery import Blacklist, HostDiscovery
from .elastic import ElasticOptions, scheduler_reason
from .hostfile import Host
from .sessions import describe_exit
from .ssh import SshOptions, probe_host
from .supervisor import SERVICE_EXIT_SECONDS, Child, Supervisor

DISCOVERY_SECONDS = 3.0  # between two looks at the hosts
_POLL_SECONDS = 0.05


class HostsBackend(Protocol):
    """What the loop needs of the backend that planned the job (:class:`.elastic_hosts.ElasticHostsBackend`)."""

    discovery: HostDiscovery
    elastic: ElasticOptions
    blacklist: Blacklist
    probed: set[str]  # hosts whose check passed
    ssh: SshOptions
    python: str
    common: dict[str, str]  # every remote process's environment, before its role's variables

    def usable(self, hosts: list[Host]) -> list[Host]: ...
    def blacklist_host(self, address: str, why: str) -> None: ...
    def joiner(self, host: Host, number: int) -> Process: ...
    def start(self, sup: Supervisor, process: Process, command: list[str]) -> Child: ...


@dataclasses.dataclass
class RemoteWorker:
    """One worker process bpslaunch started on a host (its ssh connection, on this side)."""

    child: Child
    host: str  # the host's address
    stopped: str | None = None  # why bpslaunch stopped it: its exit is then no failure


class HostsRun:
    """The supervising loop of an elastic job over hosts (see the module docstring)."""

    def __init__(self, backend: HostsBackend, sup: Supervisor, workers: list[RemoteWorker],
                 command: list[str]) -> None:
        self.backend = backend
        self.sup = sup
        self.workers = workers
        self.command = command
        self.scheduler = next(c for c in sup.children if c.role == "scheduler")
        self.started = len(workers)  # worker processes started so far (labels count them)
        self.failures = 0  # worker failures handled (against --reset-limit)
        self.finished: str | None = None  # the first worker that exited 0: the job is ending
        self.first_error = 0
        self.next_look = time.monotonic() + DISCOVERY_SECONDS
        self.checking: dict[str, concurrent.futures.Future] = {}  # host -> its check, under way
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="bpslaunch-check")
        self.hosts: list[Host] = []  # the last look's usable hosts
        self.looking: concurrent.futures.Future | None = None  # the discovery, under way
        self.ended_at: float | None = None  # when the scheduler exited 0
        self.seen_generations = 0  # of sup.generations, those already noted
        self.event: tuple[float, str] | None = None  # the last change of hosts: when, and what

    def run(self) -> int:
        """Supervise until the job ends; bpslaunch's exit status."""
        try:
            return self._run()
        finally:
            for future in [self.looking, *self.checking.values()]:
                if future is not None:
                    future.cancel()
            self.pool.shutdown(wait=False)

    def _run(self) -> int:
        sup = self.sup
        while True:
            if sup.signals:
                return self._stopped()
            for child in sup.reap():
                code = self._on_exit(child)
                if code is not None:
                    return code
            if self.looking is None and time.monotonic() >= self.next_look:
                self.looking = self.pool.submit(self.backend.discovery.hosts)  # a script may take seconds
            if self.looking is not None and self.looking.done():
                listed, self.looking = self.looking.result(), None
                self.next_look = time.monotonic() + DISCOVERY_SECONDS
                self._look(listed)
            self._take_checked()
            self._note_generations()
            if self.scheduler.code is not None and not self._running():
                break
            if self.ended_at is not None and time.monotonic() - self.ended_at > SERVICE_EXIT_SECONDS:
                for worker in self._running():
                    self._stop(worker, f"the job ended {SERVICE_EXIT_SECONDS:g} s ago")
            time.sleep(_POLL_SECONDS)
        sup.wait_services()
        if sup.signals:
            return self._stopped()
        return self.first_error

    def _note_generations(self) -> None:
        """Say when the job goes on at a new size, and how long after the change of hosts behind it."""
        formed = self.sup.generations
        for when, generation, size in formed[self.seen_generations:]:
            after = "" if self.event is None else f", {when - self.event[0]:.1f} s after {self.event[1]}"
            self.sup.note(f"generation {generation}: {size} worker(s) training{after}")
        self.seen_generations = len(formed)

    def _changed(self, what: str) -> None:
        self.event = (time.monotonic(), what)

    def _running(self) -> list[RemoteWorker]:
        return [w for w in self.workers if w.child.code is None]

    def _on_exit(self, child: Child) -> int | None:
        """Note one child's exit; an exit status when it ends the job."""
        if child is self.scheduler:
            if child.code != 0:
                return self._fail(f"the scheduler failed the job ({describe_exit(child.code or 1)}): "
                                  f"{scheduler_reason(self.scheduler)}", child.code or 1)
            self.ended_at = time.monotonic()  # the rest are finishing, or joiners nobody admitted
            return None
        worker = next((w for w in self.workers if w.child is child), None)
        if worker is None:
            if child.code != 0:  # a server: the scheduler decides what follows
                self.sup.note(f"{child.label} exited with {describe_exit(child.code or 1)}")
            return None
        if child.code == 0:
            self.finished = self.finished or child.label
            return None
        if worker.stopped is not None or self.scheduler.code is not None:
            return None
        return self._failed(worker)

    def _failed(self, worker: RemoteWorker) -> int | None:
        """A worker failed: its host goes on the blacklist and its other workers stop, unless the
        failure is one no host can fix (then the job ends)."""
        child = worker.child
        for pump in child.pumps:
            pump.join(timeout=1.0)  # the traceback it printed before exiting
        error = error_line(child.tail)
        how = describe_exit(child.code or 1) + (" (its ssh connection broke)" if child.code == 255 else "")
        self.sup.note(f"{child.label} on {worker.host} exited with {how}")
        if not self.sup.generations:  # a first worker: the rendezvous waits for it, no joiner can stand in
            return self._fail(f"{child.label} on {worker.host} failed before the job started: stopping the job"
                              + (f". The error: {error}" if error else ""), child.code or 1)
        if not_worth_a_restart(error, registered=True):
            return self._fail(f"{child.label} failed on a configuration error, the same on every host: "
                              f"stopping the job. The error: {error}", child.code or 1)
        self.failures += 1
        limit = self.backend.elastic.reset_limit
        if limit is not None and self.failures > limit:
            return self._fail(f"{child.label} failed and the reset limit is reached ({self.failures - 1} of "
                              f"--reset-limit {limit} failures handled); stopping the job", child.code or 1)
        self._changed(f"{child.label} on {worker.host} failed")
        if worker.host not in self.backend.blacklist:
            self.backend.blacklist_host(worker.host, f"{child.label} exited with {how}"
                                        + (f": {error}" if error else ""))
        for other in self._running():
            if other.host == worker.host:
                self._stop(other, f"its host {worker.host} is blacklisted")
        return None

    # -- hosts that come and go ---------------------------------------------------------
    def _look(self, listed: list[Host]) -> None:
        """What the discovery ``listed``: stop the workers of hosts it dropped; check new hosts; add
        workers where there is room."""
        addresses = {host.address for host in listed}
        for worker in self._running():
            if worker.host not in addresses and worker.stopped is None:
                self._stop(worker, f"its host {worker.host} is no longer listed by "
                                   f"{self.backend.discovery.describe()}")
        self.hosts = self.backend.usable(listed)
        for host in self.hosts:
            if host.address not in self.backend.probed and host.address not in self.checking:
                self.checking[host.address] = self.pool.submit(
                    probe_host, host, self.backend.ssh, self.backend.python, self.command[0],
                    self.backend.common.get("PATH", ""))
        self._grow()

    def _take_checked(self) -> None:
        """Hosts whose check finished: usable from now, or blacklisted."""
        for address, future in list(self.checking.items()):
            if not future.done():
                continue
            del self.checking[address]
            try:
                future.result()
                self.backend.probed.add(address)
                self._grow()
            except ConfigError as exc:
                self.backend.blacklist_host(address, f"its check failed: {exc}")

    def _grow(self) -> None:
        """Start workers on the usable, checked hosts with free slots, up to --max-np, while the
        job runs (started, nobody finished, the scheduler up)."""
        if self.finished is not None or self.scheduler.code is not None or not self.sup.generations:
            return
        running = self._running()
        room = (self.backend.elastic.max_np or math.inf) - len([w for w in running if w.stopped is None])
        for host in self.hosts:
            if room <= 0:
                return
            if host.address not in self.backend.probed or host.address in self.backend.blacklist:
                continue
            busy = len([w for w in running if w.host == host.address])
            for _ in range(int(min(room, host.slots - busy))):
                self.started += 1
                process = self.backend.joiner(host, self.started - 1)
                self.sup.note(f"starting {process.label} on {host.address}: it joins at the job's next commit")
                self._changed(f"{process.label} started on {host.address}")
                child = self.backend.start(self.sup, process, self.command)
                self.workers.append(RemoteWorker(child, host.address))
                room -= 1

    def _stop(self, worker: RemoteWorker, why: str) -> None:
        """Stop one worker (closing its ssh connection stops it on its host)."""
        if worker.stopped is not None:
            return
        worker.stopped = why
        self.sup.note(f"stopping {worker.child.label} on {worker.host}: {why}")
        self.sup.signal_group(worker.child.proc.pid, signal.SIGTERM)

    # -- the end ----------------------------------------------------------------------
    def _fail(self, message: str, code: int) -> int:
        self.sup.note(message)
        self.sup.stop(signal.SIGTERM)
        return code or 1

    def _stopped(self) -> int:
        sig = self.sup.signals[0]
        self.sup.note(f"got {signal.Signals(sig).name}; stopping every process on every host")
        self.sup.stop(sig)
        return 128 + sig
