"""Issue 33, item 11: DistributedTrainer broadcast every parameter with deferred shapes twice at
the start (once when its deferred initialization ran in the first forward, again at the first
step), so BYTEPS_TRACE_START_STEP=2 still traced the start. Counted here from BytePS's trace:
one push_pull per parameter, however its shape was given. Real processes, 2 workers.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from cluster import assert_all_ok

JOB = '''
    import os
    import mxnet as mx, numpy as np, mxnet_plugin as bps
    bps.init()
    mx.random.seed(10 + bps.rank())  # different values on every rank: the broadcast makes them agree
    net = mx.gluon.nn.HybridSequential()
    # deferred shapes (the first Dense's weight), given shapes (the second Dense), and both kinds of bias
    net.add(mx.gluon.nn.Dense(8, activation="relu"), mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     mode=os.environ["TEST_MODE"])
    for step in range(3):
        with mx.autograd.record():
            loss = net(mx.nd.ones((4, 5))).sum()
        loss.backward()
        trainer.step(4)
        if step == 0:
            first = {name: p.data().asnumpy().sum().item() for name, p in sorted(net.collect_params().items())}
    bps.shutdown()
    report(first)
'''


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
    done = job.run_workers(JOB, per_rank_env={rank: {"BYTEPS_TRACE_DIR": str(tmp_path / f"rank{rank}")}
                                              for rank in range(2)}, timeout=60)
    assert_all_ok(done, job)
    if mode == "allreduce":  # the same update from the same start: every rank holds the same model
        assert done[0].result == done[1].result, job.dump()
    names = set(done[0].result)
    assert len(names) == 4, names
    for rank in range(2):
        counted = broadcasts(tmp_path / f"rank{rank}" / "0" / "comm.json")
        assert counted == {f"parameter_{name}": 1 for name in names}, (rank, counted)
