"""suspend() and resume() in one process: what resume() refuses, and that it says within
seconds when the job it left is gone. A real job (a worker stepping out and coming back, a job
that is not elastic refusing) is tested on processes in tests/clusters/test_launcher_elastic.py."""

from __future__ import annotations

import time

import pytest

import bps_gossip as core
from bps_gossip import suspension
from bps_gossip.config import load_config
from bps_gossip.errors import ConfigError, PeerLostError
from bps_gossip.launch.local import free_port


@pytest.fixture
def alone(monkeypatch):
    """A worker that trains alone (no DMLC_* variables: no scheduler), left afterwards."""
    for name in ("DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
                 "BPS_GOSSIP_ELASTIC", "BYTEPS_FORCE_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    yield
    core.shutdown()
    suspension._suspended.clear()


def test_resume_without_suspend_is_refused(alone):
    with pytest.raises(ConfigError, match=r"resume\(\): no suspend\(\) to resume from"):
        core.resume()


def test_resume_while_in_the_job_is_refused(alone):
    core.init()
    with pytest.raises(ConfigError, match="in the job already"):
        core.resume()


@pytest.mark.parametrize("args,match", [((0,), "num_workers=0"), ((True,), "num_workers=True"),
                                        ((1.5,), "num_workers=1.5"), ((1, -1), "num_servers=-1"),
                                        ((1, "1"), "num_servers='1'")])
def test_resume_checks_its_counts(alone, args, match):
    core.init()
    core.suspend()
    with pytest.raises(ConfigError, match=match):
        core.resume(*args)
    assert not core.is_initialized()
    core.resume(1, 1)  # the refusal lost nothing: the suspended job is still there to resume
    assert core.is_initialized() and core.size() == 1


def test_counts_are_not_applied(alone):
    """BytePS passes the new cluster's counts; the running job decides who is in it here, so a
    count (say size(), which is processes, not machines) does not change the job."""
    core.init()
    core.suspend()
    core.resume(4, 2)
    assert core.size() == 1 and core.job_config().num_worker == 1


def test_resume_where_the_job_is_gone_says_so_within_seconds(alone):
    """The job ended (its scheduler exited) while this worker was away: before, resume() waited
    BPS_GOSSIP_START_TIMEOUT (600 s) and blamed leftover DMLC_* variables."""
    port = free_port()  # nothing listens there any more
    config = load_config({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                          "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
                          "BPS_GOSSIP_ELASTIC": "1"})
    suspension._suspended[:] = [config]
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=f"no job answers at 127.0.0.1:{port} any more"):
        core.resume()
    assert time.monotonic() - started < 10
    assert not core.is_initialized()


def test_suspend_before_init_is_an_error(alone):
    with pytest.raises(core.NotInitializedError, match=r"suspend\(\)"):
        core.suspend()


def test_a_joiner_whose_job_ended_meanwhile_gives_up_within_seconds(alone, monkeypatch):
    """Issue 46.5: the launcher's --join probes the scheduler, then starts the worker; a job that
    ends in those seconds left the worker waiting BPS_GOSSIP_START_TIMEOUT (600 s) until killed."""
    from bps_gossip.errors import CommTimeoutError
    from bps_gossip.transport import startup
    monkeypatch.setattr(startup, "JOINER_CONNECT_SECONDS", 1.0)
    port = free_port()
    config = load_config({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                          "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
                          "BPS_GOSSIP_ELASTIC": "1", "BPS_GOSSIP_JOINER": "1"})
    assert config.joiner and config.start_timeout == 600
    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match=rf"the elastic job at 127.0.0.1:{port} answered \S+ --join a moment ago"):
        core.init(config)
    assert time.monotonic() - started < 8
    assert not core.is_initialized()
