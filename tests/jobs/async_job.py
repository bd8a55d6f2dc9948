"""DistributedTrainer(mode='async') on real processes (tests/clusters/test_async_training.py): digits
with a straggler against allreduce, the stored weights' arithmetic, and bad pushes (a shape that
does not match, a push from a connection that is no member of the job)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgpack
import mxnet as mx
import numpy as np
import zmq
from job_tools import report, run

import bps_gossip as core
import mxnet_plugin as bps
from bps_gossip import testing
from bps_gossip.collectives import store_push_pull
from bps_gossip.config import load_config
from bps_gossip.transport.security import make_socket, routing_id
from bps_gossip.worker.tensors import key_of

STRAGGLER_SLEEP = 0.2  # seconds the straggler (the last rank) sleeps every step


def _progress(folder: Path, rank: int, steps: int, done: bool = False) -> None:
    """Write this rank's step count where every rank can read it (atomically)."""
    path = folder / f"rank{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{steps} {int(done)}")
    os.replace(tmp, path)


def _read_progress(folder: Path, rank: int) -> tuple[int, bool]:
    try:
        steps, done = (folder / f"rank{rank}").read_text().split()
    except (FileNotFoundError, ValueError):
        return 0, False
    return int(steps), done == "1"


def _train(examples: str, mode: str, steps: int, folder: Path | None) -> dict:
    """``steps`` steps of examples/train_digits.py's MLP in ``mode``; in async mode the last rank sleeps
    every step and stops once every other rank has finished. Accuracy of the model after a barrier."""
    sys.path.insert(0, examples)
    from train_digits import accuracy, build_net, load_data

    rank, size = bps.rank(), bps.size()
    straggler = folder is not None and rank == size - 1
    x_train, y_train, x_test, y_test = load_data()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    mx.random.seed(1 + rank)
    net = build_net()
    net.initialize(mx.init.Xavier())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, mode=mode)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(1 + rank)
    batch, done, others_at_finish = 32, 0, []
    while done < steps:
        if straggler and all(_read_progress(folder, r)[1] for r in range(size - 1)):
            break
        order = rng.choice(len(x_shard), batch, replace=False)
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x_shard[order])), mx.nd.array(y_shard[order]))
        loss.backward()
        trainer.step(batch)
        done += 1
        if folder is not None:
            _progress(folder, rank, done)
        if straggler:
            time.sleep(STRAGGLER_SLEEP)
    if folder is not None:
        others_at_finish = [_read_progress(folder, r)[0] for r in range(size)]
        _progress(folder, rank, done, done=True)
    core.barrier()  # every rank's last change is in
    trainer.flush()
    return {"mode": trainer.mode, "steps": done, "others_at_finish": others_at_finish,
            "accuracy": accuracy(net, x_test, y_test), "digest": float(net[0].weight.data().sum().asscalar())}


def straggler(examples: str, folder: str, steps: str) -> None:
    """Async with a straggler, then allreduce (no straggler), ``steps`` steps each: what each reached."""
    bps.init()
    results = {"async": _train(examples, "async", int(steps), Path(folder)),
               "allreduce": _train(examples, "allreduce", int(steps), None)}
    report({"rank": bps.rank(), **results})
    bps.shutdown()


def _halves(array: np.ndarray) -> list[list[float]]:
    """[min, max] of each half: partitions answered at different moments may hold different values."""
    return [[float(half.min()), float(half.max())] for half in np.split(array, 2)]


def arithmetic() -> None:
    """Every rank adds rank + 1 to stored weights that start as [10] * 1500 + [20] * 1500 (several
    partitions: BYTEPS_PARTITION_BYTES) twice, then all pull: the sum of every change. The first init
    wins (a later rank's init payload, rank-dependent here, is ignored)."""
    bps.init()
    rank = bps.rank()
    ones = np.ones(3000, np.float32)
    start = store_push_pull(np.concatenate([ones[:1500] * 10, ones[1500:] * 20]) + rank * 0.5, "w", init=True)
    first = store_push_pull(ones * (rank + 1.0), "w")
    store_push_pull(ones * (rank + 1.0), "w")
    core.barrier()
    final = store_push_pull(np.zeros(3000, np.float32), "w", init=True)
    report({"rank": rank, "start": _halves(start), "first": _halves(first), "final": _halves(final)})
    bps.shutdown()


def bad_pushes() -> None:
    """Rank 1 adds a shape that does not match rank 0's stored weights; rank 0 pushes from a
    connection that is no member (with the job's key); the stored weights after both."""
    bps.init()
    rank = bps.rank()
    out = {"rank": rank}
    if rank == 0:
        store_push_pull(np.ones(4, np.float32), "w", init=True)
    core.barrier()
    if rank == 1:
        try:
            store_push_pull(np.ones(3, np.float32), "w")
            out["mismatch"] = "no error"
        except core.TensorMismatchError as exc:
            out["mismatch"] = str(exc)
    else:
        out["stranger"] = _stranger_push()
    core.barrier()
    out["final"] = store_push_pull(np.zeros(4, np.float32), "w", init=True).tolist()
    report(out)
    bps.shutdown()


def _stranger_push() -> list:
    """An add of 1e9 to 'w' from a socket that holds the job's key but is in no address book."""
    book = testing.address_book()
    keys = load_config().keys
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, keys, serve=False)
    sock.setsockopt(zmq.IDENTITY, routing_id("insider", keys))  # its own key's (any other is dropped)
    sock.connect(book.servers[0])
    header = {"op": "push", "req": 5, "key": key_of("w"), "name": "w", "part": 0, "seq": 0, "count": 4,
              "wire": "<f4", "dtype": "float32", "shape": [4], "kind": "stored weights", "gen": book.generation,
              "store": "add", "ack": False}
    sock.send_multipart([msgpack.packb(header), np.full(4, 1e9, np.float32).tobytes()])
    answer = msgpack.unpackb(sock.recv_multipart()[0]) if sock.poll(5000) else {}
    sock.close(linger=0)
    return [answer.get("op"), answer.get("kind"), answer.get("why")]


run({"straggler": straggler, "arithmetic": arithmetic, "bad_pushes": bad_pushes})
