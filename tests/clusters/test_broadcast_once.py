"""Issue 33, item 11: DistributedTrainer broadcast every parameter with deferred shapes twice at
the start (once when its deferred initialization ran in the first forward, again at the first
step), so BYTEPS_TRACE_START_STEP=2 still traced the start. Counted here from BytePS's trace:
one push_pull per parameter, however its shape was given. Real processes, 2 workers, running
tests/jobs/broadcast_once_job.py.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from cluster import assert_all_ok


def broadcasts(path) -> Counter:
    """Push_pulls per tensor named parameter_* in a BytePS trace file (its 'total' events)."""
    events = json.loads(path.read_text())["traceEvents"]
    return Counter(e["pid"][len("Comm."):] for e in events
                   if e["pid"].startswith("Comm.parameter_") and e["tid"] == "total")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["gossip", "allreduce"])
def test_each_parameter_is_broadcast_once(cluster, tmp_path, mode):
    job = cluster(2, 1, {"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "1", "BYTEPS_TRACE_END_STEP": "10",
                         "TEST_MODE": mode})
    done = job.run_job("broadcast_once_job", "three_steps",
                       per_rank_env={rank: {"BYTEPS_TRACE_DIR": str(tmp_path / f"rank{rank}")} for rank in range(2)},
                       timeout=60)
    assert_all_ok(done, job)
    if mode == "allreduce":  # the same update from the same start: every rank holds the same model
        assert done[0].result == done[1].result, job.dump()
    names = set(done[0].result)
    assert len(names) == 4, names
    for rank in range(2):
        counted = broadcasts(tmp_path / f"rank{rank}" / "0" / "comm.json")
        assert counted == {f"parameter_{name}": 1 for name in names}, (rank, counted)
