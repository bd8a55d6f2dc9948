"""mxnet_plugin's collectives on real processes: BytePS's own tests/test_mxnet.py with
real expected values for every worker count, broadcast_parameters (dicts, ParameterDicts,
deferred initialization) and the errors every rank must see.

Each job runs ONE scenario with many checks (tests/jobs/mxnet_ops_job.py; importing mxnet
costs seconds); a check that fails is recorded rather than raised, so that every rank stays
in step and the test reports all failures at once.
"""

from __future__ import annotations

import pytest
from cluster import assert_all_ok, results_by_rank

pytestmark = pytest.mark.paths  # the newest Python of .ci/pythons runs these too


def _check_ops(done: list, size: int) -> None:
    results = results_by_rank(done)
    assert [r["rank"] for r in results] == list(range(size))
    for r in results:
        assert r["size"] == size
        assert not r["failures"], f"rank {r['rank']}: " + "\n".join(r["failures"])
    for root in results[0]["dict"]:
        root_before = results[int(root)]["dict"][root]["before"]
        assert all(r["dict"][root]["after"] == root_before for r in results), f"dict from root {root}"
        if size > 1:
            assert results[0]["dict"][root]["before"] != results[1]["dict"][root]["before"]  # a real test
    root_before = results[-1]["pdict"]["before"]
    assert all(r["pdict"]["after"] == root_before for r in results)
    for hybridize in ("False", "True"):
        views = [r["deferred"][hybridize] for r in results]
        assert all(v["params"] == v["root_params"] for v in views), f"deferred (hybridize={hybridize})"
        assert all(v["output"] == v["root_output"] for v in views), f"deferred output (hybridize={hybridize})"
    if size > 1:
        assert len({r["pdict"]["before"] for r in results}) == size  # ranks really started apart
        for r in results:
            kind, msg, seconds = r["mismatch"]
            assert kind == "TensorMismatchError", (r["rank"], kind, msg)
            assert all(part in msg for part in ("'mismatch'", "(3,)", "(4,)", "rank 0")), msg
            assert seconds < 8, f"rank {r['rank']} waited {seconds:.1f} s for the mismatch error"


@pytest.mark.timeout(90)
def test_ops_one_worker_local_mode(cluster):
    job = cluster(1, start_servers=False)
    done = job.run_job("mxnet_ops_job", "ops", timeout=80)
    assert_all_ok(done, job)
    _check_ops(done, 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
def test_ops_multi_worker(cluster, workers):
    job = cluster(workers)
    done = job.run_job("mxnet_ops_job", "ops", timeout=110)
    assert_all_ok(done, job)
    _check_ops(done, workers)
    job.wait_servers_exit()
