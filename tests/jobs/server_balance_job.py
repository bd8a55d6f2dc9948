"""Servers planned by bytes (tests/clusters/test_server_balance.py), 2 workers and 3 servers:
mxnet_plugin's fused steps (DistributedTrainer's allreduce mode and the 'bpsgossip' KVStore) and
a user's bps_gossip.plan_servers(). Each scenario compares where the servers summed every
partition with the plan. Only the mxnet scenario imports mxnet."""

from __future__ import annotations

from typing import Any

import numpy as np
from job_tools import report, run

import bps_gossip
from bps_gossip.worker.server_choice import assign, plan_of

PARTITION, SERVERS = 65536, 3  # BYTEPS_PARTITION_BYTES and servers of the tests' clusters


def expected(tensors: list[tuple[str, int, int]]) -> dict[tuple[int, int], int]:
    """Every partition of the planned (name, elements, itemsize) tensors, and its planned server."""
    plan = assign(plan_of(tensors, PARTITION), SERVERS)
    return {(key, i): server for key, servers in plan.items() for i, server in enumerate(servers)}


def compare(want: dict[tuple[int, int], int]) -> tuple[list[str], int]:
    """(partitions the servers did not sum where planned, partitions a name's hash would place elsewhere)."""
    got = {}
    for stats in bps_gossip.server_stats():
        for key, parts in stats["parts"].items():
            for part in parts:
                got[(int(key), part)] = stats["rank"]
    return (sorted(str(k) for k, v in want.items() if got.get(k) != v),
            sum(v != (key + i) % SERVERS for (key, i), v in want.items()))


def build(prefix: str) -> Any:
    """Four Dense layers named under ``prefix``, Xavier-initialized."""
    import mxnet as mx
    from mxnet.gluon import nn

    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(256, in_units=512, activation="relu"), nn.Dense(192, in_units=256, activation="relu"),
                nn.Dense(64, in_units=192, activation="relu"), nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier())
    return net


def train(net: Any, trainer: Any, rank: int, steps: int = 2) -> None:
    """``steps`` steps on this rank's batch of 8."""
    import mxnet as mx
    from mxnet import autograd, gluon

    x = mx.nd.array(np.random.RandomState(rank).standard_normal((8, 512)))
    y = mx.nd.array(np.arange(8) % 10)
    for _ in range(steps):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
        loss.backward()
        trainer.step(8)
    mx.nd.waitall()


def sizes(entries: list[tuple[str, list[Any]]]) -> list[tuple[str, int, int]]:
    """(name, elements, itemsize 4) of each (name, parameters) entry."""
    return [(name, sum(int(p.data().size) for p in params), 4) for name, params in entries]


def check_allreduce(out: dict[str, Any], rank: int) -> None:
    """DistributedTrainer(mode='allreduce'): its buckets and lone gradients against the plan."""
    import mxnet_plugin as bps

    net = build("ar_")
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, mode="allreduce")
    train(net, trainer, rank)
    mode = trainer.mode_object
    planned = [(b.name, b.params) for b in mode.buckets] + [(f"gradient_{p.name}", [p]) for _, p in mode.alone]
    want = expected(sizes(planned))
    out["allreduce_mismatch"], out["allreduce_differs_from_hash"] = compare(want)
    out["allreduce_partitions"] = len(want)
    load = [0, 0, 0]
    for server in want.values():
        load[server] += 1
    out["allreduce_load"] = load


def check_kvstore(out: dict[str, Any], rank: int) -> None:
    """gluon.Trainer with the 'bpsgossip' KVStore: its fused buckets and lone keys against the plan."""
    from mxnet import gluon

    net2 = build("kv_")
    trainer2 = gluon.Trainer(net2.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="bpsgossip")
    train(net2, trainer2, rank)
    fusion = trainer2._kvstore.fusion
    entries = []
    params2 = trainer2._params  # gluon.Trainer's keys index these (sorted by name)
    keys = [key for key, _ in fusion.planned_calls]  # call index -> gluon.Trainer's key (its parameter's index)
    for indices, name, _ in fusion.buckets:
        entries.append((name if len(indices) > 1 else f"kvstore_{keys[indices[0]]}",
                        [params2[keys[i]] for i in indices]))
    entries += [(f"kvstore_{keys[i]}", [params2[keys[i]]]) for i in fusion.alone]
    want2 = expected(sizes(entries))
    out["kvstore_checked"] = len(want2)
    out["kvstore_mismatch"], out["kvstore_differs_from_hash"] = compare(want2)


def fused_steps() -> None:
    """Two steps of each mxnet_plugin entry: where its partitions were summed, against the plan."""
    import mxnet_plugin as bps

    bps.init()
    rank = bps.rank()
    out: dict[str, Any] = {"rank": rank}
    check_allreduce(out, rank)
    check_kvstore(out, rank)
    out["failures"] = []  # as before: nothing here records a failure
    report(out)
    bps.shutdown()


def plan_servers() -> None:
    """A user's plan_servers() over four tensors, then plans that come too late."""
    bps_gossip.init()
    rank = bps_gossip.rank()
    tensors = [(f"layer{i}", np.full(n, rank + 1.0, dtype=np.float32))
               for i, n in enumerate((70000, 30000, 50000, 9000))]
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


if __name__ == "__main__":
    run({"fused_steps": fused_steps, "plan_servers": plan_servers})
