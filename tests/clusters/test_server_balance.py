"""mxnet_plugin plans a step's fused push_pulls over the servers by bytes
(bps_gossip.worker.server_choice.plan_servers), the same on every rank: DistributedTrainer's
allreduce mode and gluon.Trainer with the 'bpsgossip' KVStore, 2 workers and 3 servers."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok
from test_mxnet_ops import HELPERS

PLAN_HELPERS = """
import bps_gossip
from bps_gossip.worker.server_choice import assign, plan_of

PARTITION, SERVERS = 65536, 3  # BYTEPS_PARTITION_BYTES and servers of the tests' clusters

def expected(tensors):
    # every partition of the planned (name, elements, itemsize) tensors, and its planned server
    plan = assign(plan_of(tensors, PARTITION), SERVERS)
    return {(key, i): server for key, servers in plan.items() for i, server in enumerate(servers)}

def compare(want):
    # (partitions the servers did not sum where planned, partitions a name's hash would place elsewhere)
    got = {}
    for stats in bps_gossip.server_stats():
        for key, parts in stats["parts"].items():
            for part in parts:
                got[(int(key), part)] = stats["rank"]
    return (sorted(str(k) for k, v in want.items() if got.get(k) != v),
            sum(v != (key + i) % SERVERS for (key, i), v in want.items()))
"""

SNIPPET = HELPERS + PLAN_HELPERS + """
import mxnet_plugin as bps
from mxnet import autograd, gluon
from mxnet.gluon import nn

bps.init()
rank = bps.rank()

def build(prefix):
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(256, in_units=512, activation="relu"), nn.Dense(192, in_units=256, activation="relu"),
                nn.Dense(64, in_units=192, activation="relu"), nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier())
    return net

def train(net, trainer, steps=2):
    x = mx.nd.array(np.random.RandomState(rank).standard_normal((8, 512)))
    y = mx.nd.array(np.arange(8) % 10)
    for _ in range(steps):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
        loss.backward()
        trainer.step(8)
    mx.nd.waitall()

def sizes(entries):
    return [(name, sum(int(p.data().size) for p in params), 4) for name, params in entries]

out = {"rank": rank}
net = build("ar_")
trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, mode="allreduce")
train(net, trainer)
mode = trainer._mode
planned = [(b.name, b.params) for b in mode.buckets] + [(f"gradient_{p.name}", [p]) for _, p in mode.alone]
want = expected(sizes(planned))
out["allreduce_mismatch"], out["allreduce_differs_from_hash"] = compare(want)
out["allreduce_partitions"] = len(want)
load = [0, 0, 0]
for (key, i), server in want.items():
    load[server] += 1
out["allreduce_load"] = load

net2 = build("kv_")
trainer2 = gluon.Trainer(net2.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="bpsgossip")
train(net2, trainer2)
fusion = trainer2._kvstore._fusion
entries = []
params2 = trainer2._params  # gluon.Trainer's keys index these (sorted by name)
keys = [key for key, _ in fusion.signature]  # call index -> gluon.Trainer's key (its parameter's index)
for indices, name, _ in fusion.buckets:
    entries.append((name if len(indices) > 1 else f"kvstore_{keys[indices[0]]}", [params2[keys[i]] for i in indices]))
entries += [(f"kvstore_{keys[i]}", [params2[keys[i]]]) for i in fusion.alone]
want2 = expected(sizes(entries))
out["kvstore_checked"] = len(want2)
out["kvstore_mismatch"], out["kvstore_differs_from_hash"] = compare(want2)
out["failures"] = failures
report(out)
bps.shutdown()
"""


def on_three_servers(cluster, snippet: str, timeout: float) -> list[dict]:
    """Each rank's report of ``snippet``, run by 2 workers pushing to 3 servers (host reduce off:
    on one host the lowest rank would sum, and no server would take a push)."""
    job = cluster(2, servers=3, env={"BYTEPS_PARTITION_BYTES": "65536", "BPS_GOSSIP_HOST_REDUCE": "off"})
    done = job.run_workers(snippet, timeout=timeout)
    assert_all_ok(done, job)
    job.wait_servers_exit()
    return sorted((f.result for f in done), key=lambda r: r["rank"])


@pytest.mark.timeout(120)
def test_fused_steps_balance_bytes_over_servers(cluster):
    for r in on_three_servers(cluster, SNIPPET, 110):
        assert not r["failures"], r["failures"]
        # the names' hash alone would put some partitions elsewhere: the plan is what is checked
        assert r["allreduce_differs_from_hash"] and r["kvstore_differs_from_hash"], r
        assert r["allreduce_partitions"] >= 10 and not r["allreduce_mismatch"], r
        assert max(r["allreduce_load"]) - min(r["allreduce_load"]) <= 1, r
        assert r["kvstore_checked"] >= 10 and not r["kvstore_mismatch"], r


CORE_SNIPPET = PLAN_HELPERS + """
import numpy as np

bps_gossip.init()
rank = bps_gossip.rank()
tensors = [(f"layer{i}", np.full(n, rank + 1.0, dtype=np.float32)) for i, n in enumerate((70000, 30000, 50000, 9000))]
bps_gossip.plan_servers(reversed(tensors))  # any order: every rank gets the same plan
sums = [bps_gossip.push_pull(array, name, average=False) for name, array in tensors]
mismatch, differs = compare(expected([(name, array.size, 4) for name, array in tensors]))
try:
    bps_gossip.plan_servers([("layer0", tensors[0][1])])  # planned before: keeps its servers
    bps_gossip.plan_servers([("unplanned", np.zeros(4, np.float32))])
    bps_gossip.push_pull(np.zeros(8, np.float32), "pushed_first")
    bps_gossip.plan_servers([("pushed_first", np.zeros(8, np.float32))])
    late = "none"
except ValueError as exc:
    late = str(exc)
report({"rank": rank, "sums_ok": all(float(s[0]) == 3.0 for s in sums),
        "mismatch": mismatch, "differs_from_hash": differs, "late": late})
bps_gossip.shutdown()
"""


@pytest.mark.timeout(60)
def test_plan_servers_places_a_users_tensors(cluster):
    for r in on_three_servers(cluster, CORE_SNIPPET, 50):
        assert r["sums_ok"] and r["differs_from_hash"] and not r["mismatch"], r
        assert "pushed already" in r["late"], r
