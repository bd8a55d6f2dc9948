"""A push_pull that fails inside MXNet's engine never passes silently (issue 33, item 1).

The user's off-by-one: rank 1 takes one step more than rank 0 and no script calls
``bps.shutdown()``. Rank 1's last push_pull fails when rank 0 leaves. Before, rank 1 went on with
NaN weights and the job exited 0; now the next read of those weights raises the error (MXNet's
engine carries it), a script that reads nothing exits with status 1, and so does bpslaunch.
Real processes under bpslaunch (tests/jobs/engine_failure_job.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from test_launcher import job  # noqa: F401 - the fixture: bpslaunch processes, killed at the end

JOB = Path(__file__).resolve().parents[1] / "jobs" / "engine_failure_job.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry, read", [("allreduce", "1"), ("kvstore", "0")])
def test_uneven_steps_fail_the_job_and_never_show_nan(job, entry, read):  # noqa: F811
    start = time.monotonic()
    proc = job.start(["-np", "2", sys.executable, str(JOB), entry, read])
    code, out, err = job.finish(proc, timeout=90)
    took = time.monotonic() - start
    both = out + err
    assert code != 0, both
    assert "END rank 0" in out, both  # rank 0 trained its steps and finished
    assert "finite=False" not in out, both  # NaN weights are never presented as trained
    assert "PeerLostError" in both and "took different numbers of steps" in both, both
    if read == "1":  # the read of the weights raised the push_pull's error
        assert "MXNetError: PeerLostError" in err and "TRAINED rank 1" not in out, both
    else:  # nothing raised it: the exit hook did, with status 1
        assert "exiting with status 1: this rank's parameters are not trained" in err, both
    assert "worker 1" in err and "exited with code 1" in err, both
    assert took < 60, f"the job took {took:.0f} s to fail"
    job.assert_nothing_left()
