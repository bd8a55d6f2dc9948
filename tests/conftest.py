"""Shared fixtures (real clusters on 127.0.0.1, always cleaned up) and the markers by folder.

tests/unit/ runs in this process (no scheduler, server or worker processes): marked ``unit``.
tests/clusters/ starts real processes on 127.0.0.1: marked ``cluster``. tests/jobs/ holds the
scripts those processes run. ``smoke`` and ``paths`` pick the cluster tests the other Pythons
run (.ci/pythons): see pytest.ini.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cluster import Cluster  # noqa: E402


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A SIGTERM to pytest (a CI timeout, a kill) still runs the fixtures' teardown, which kills
# every process the tests started; without this a killed run left schedulers and servers behind.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture
def cluster(tmp_path):
    """A factory: ``cluster(workers, servers=1, env=None)`` starts a scheduler and servers.

    Every process started through it is killed when the test ends, pass or fail.
    """
    made: list[Cluster] = []

    def make(workers: int, servers: int = 1, env: dict | None = None, start_servers: bool = True) -> Cluster:
        folder = tmp_path / f"job{len(made)}"
        folder.mkdir()
        job = Cluster(folder, workers, servers, env, start_servers)
        made.append(job)
        return job

    yield make
    for job in made:
        job.close()


@pytest.fixture(autouse=True)
def environment_read_fresh():
    """bps_gossip reads the environment once per process (bps_gossip.job_config); an in-process
    test that sets variables gets them read again, before it and after it."""
    from bps_gossip import runtime

    runtime.remember(None)
    yield
    runtime.remember(None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by its folder: ``unit`` (tests/unit/) or ``cluster`` (tests/clusters/)."""
    for item in items:
        folder = item.path.parent.name
        if folder == "unit":
            item.add_marker(pytest.mark.unit)
        elif folder == "clusters":
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(autouse=True)
def fake_cpu_count(request, monkeypatch):
    """BPS_GOSSIP_TEST_CPUS=N makes this process see N usable CPUs (unit tests only: users' machines
    have more than this one's 2; issue 46 found defaults that assumed 2). Run e.g.
    ``BPS_GOSSIP_TEST_CPUS=64 python -m pytest -m unit``."""
    import os

    count = os.environ.get("BPS_GOSSIP_TEST_CPUS")
    if count and request.node.get_closest_marker("unit") is not None:
        monkeypatch.setattr(os, "cpu_count", lambda: int(count))
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(int(count))))
    yield
