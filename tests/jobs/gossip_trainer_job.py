"""DistributedTrainer in gossip mode on real processes (tests/clusters/test_gossip_trainer.py):
digits against allreduce, the mean's SGD trajectory, parameters mixed in their own memory on two
device copies, bad arguments, every keyword, and a straggler routed around."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import mxnet as mx
import numpy as np
from job_tools import report, run

import mxnet_plugin as bps


def digits(examples: str) -> None:
    """examples/train_digits.py for 6 epochs in gossip and allreduce modes: accuracy, distance, steps."""
    sys.path.insert(0, examples)
    from train_digits import build_parser, train

    bps.init()
    args = build_parser().parse_args(["--epochs", "6"])
    results = {mode: train(args, mode) for mode in ("gossip", "allreduce")}
    report({mode: [r["accuracy"], r["consensus_distance"], r["steps"]] for mode, r in results.items()})
    bps.shutdown()


def mean_follows_sgd(overlap: str) -> None:
    """5 steps of constant per-rank gradients on a ring (``overlap`` True or False), then an average."""
    bps.init()
    rank = bps.rank()
    net = mx.gluon.nn.Dense(4, in_units=3, use_bias=True)
    net.initialize(mx.init.Constant(0.5))
    # routing off: the mean of the ranks' z is SGD's only while every w is 1
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     graph="ring", overlap=overlap == "True", route_slow_links=False)
    assert trainer.mode == "gossip"
    # constant per-rank gradients: d(sum(W x + b))/dW = x, with x fixed per rank
    x = mx.nd.full((1, 3), rank + 1.0)
    for _ in range(5):
        with mx.autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(1)
    trainer.flush()
    weight = net.weight.data().asnumpy().tolist()
    distance = trainer.consensus_distance()
    trainer.average_parameters()
    averaged = net.weight.data().asnumpy().tolist()
    report([weight, distance, averaged, trainer.consensus_distance()])
    bps.shutdown()


class TwoDevices:
    """A Dense(22000) on two device copies; train_step() does one step and checks that the copies
    stayed equal."""

    def __init__(self) -> None:
        bps.init()
        self.rank = bps.rank()
        self.devices = [mx.cpu(0), mx.cpu(1)]
        self.net = mx.gluon.nn.Dense(22000, in_units=3)
        self.net.initialize(mx.init.Constant(0.5), ctx=self.devices)
        self.x = mx.nd.full((1, 3), self.rank + 1.0)

    def train_step(self, trainer: Any) -> tuple[np.ndarray, np.ndarray]:
        """One step on both devices; the weight and bias of the first copy."""
        net = self.net
        with mx.autograd.record():
            losses = [net(self.x.as_in_context(d)).sum() for d in self.devices]
        mx.autograd.backward(losses)
        trainer.step(1)
        weights = [w.asnumpy() for w in net.weight.list_data()]
        biases = [b.asnumpy() for b in net.bias.list_data()]
        assert all(np.array_equal(w, weights[0]) for w in weights), "device copies differ"
        assert all(np.array_equal(b, biases[0]) for b in biases), "device copies differ"
        return weights[0], biases[0]


def large_in_place() -> None:
    """4 steps on two devices, the large weight mixed in place: a digest of each step's weights."""
    two = TwoDevices()
    from mxnet_plugin.modes.parameter_gossip import IN_PLACE_ELEMENTS

    assert 22000 * 3 >= IN_PLACE_ELEMENTS > 22000
    trainer = bps.DistributedTrainer(two.net.collect_params(), "sgd", {"learning_rate": 0.1})
    digests = []
    for _ in range(4):
        weight, bias = two.train_step(trainer)
        digests.append([weight.tobytes().hex()[:64], float(weight.min()), float(weight.max()), float(bias[0])])
    assert trainer.mode_object.gossip.direct and [k for k, _ in trainer.mode_object.gossip.large] == ["1"]
    report(digests)
    bps.shutdown()


def overlapped_in_place() -> None:
    """6 overlapped steps on two devices, z held in the parameters: each step's weights and bias."""
    two = TwoDevices()
    trainer = bps.DistributedTrainer(two.net.collect_params(), "sgd", {"learning_rate": 0.1}, overlap=True)
    seen = []
    for _ in range(6):
        weight, bias = two.train_step(trainer)
        seen.append([float(weight.min()), float(weight.max()), float(bias[0])])
    gossip = trainer.mode_object.gossip
    assert gossip.direct and gossip.averager.holds_z and [k for k, _ in gossip.large] == ["1"]
    assert gossip.averager.x["1"].base is not None  # a view of the parameter, not a copy
    report(seen)
    bps.shutdown()


def bad_arguments() -> None:
    """DistributedTrainer with each bad keyword: the ValueError's message (or 'no error')."""
    bps.init()
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    errors = []
    for kwargs in ({"mode": "bogus"}, {"graph": "nope"}, {"average_every": -1}, {"root_rank": 3},
                   {"push_sum": False, "overlap": True}):
        try:
            trainer = bps.DistributedTrainer(net.collect_params(), "sgd", **kwargs)
            with mx.autograd.record():
                loss = net(mx.nd.ones((1, 2))).sum()
            loss.backward()
            trainer.step(1)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    report(errors)
    bps.shutdown()


def every_keyword() -> None:
    """Every keyword of before in both modes, and gossip options as an object: 2 steps each."""
    bps.init()
    out = {}
    for mode in ("gossip", "allreduce", "options"):
        net = mx.gluon.nn.Dense(2, in_units=2)
        net.initialize(mx.init.Constant(bps.rank()))
        if mode == "options":
            trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, 0, None,
                                             "gossip", gossip_options=bps.GossipOptions(graph="ring"),
                                             average_every=2)
        else:
            trainer = bps.DistributedTrainer(
                params=net.collect_params(), optimizer="sgd", optimizer_params={"learning_rate": 0.1},
                root_rank=0, compression_params=None, mode=mode, graph="ring", peers_per_itr=1,
                push_sum=True, overlap=False, synch_freq=0, average_every=2, overlap_backward=False,
                gossip_gamma=0.2)
        for _ in range(2):
            with mx.autograd.record():
                loss = net(mx.nd.full((1, 2), bps.rank() + 1.0)).sum()
            loss.backward()
            trainer.step(1)
        out[mode] = [trainer.mode, trainer.num_steps, trainer.average_every, trainer.overlap_backward,
                     trainer.consensus_distance(), net.weight.data().asnumpy().tolist()]
    report(out)
    bps.shutdown()


def dense_model(rank: int) -> tuple[Any, Callable[[], Any]]:
    """A Dense(22000) from 0.5 and its loss on a constant input of rank + 1."""
    net = mx.gluon.nn.Dense(22000, in_units=3)
    net.initialize(mx.init.Constant(0.5))
    x = mx.nd.full((1, 3), rank + 1.0)
    return net, lambda: net(x).sum()


def mobilenet_model(rank: int) -> tuple[Any, Callable[[], Any]]:
    """mobilenet0.25 (hybridized, with BatchNorm) and its loss on a random batch of 2 per rank."""
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(rank)
    net = vision.mobilenet0_25(classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    rs = np.random.RandomState(rank)
    data = mx.nd.array(rs.uniform(-1, 1, (2, 3, 32, 32)))
    label = mx.nd.array(rs.randint(0, 10, 2))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    return net, lambda: loss_fn(net(data), label)


# model: (build, batch, learning rate, what to report: the dense weight's first element or the last loss)
STRAGGLER_MODELS: dict[str, tuple[Callable[[int], tuple[Any, Callable[[], Any]]], int, float,
                                  Callable[[Any, Any], float]]] = {
    "dense": (dense_model, 1, 0.001, lambda net, loss: float(net.weight.data()[0, 0].asscalar())),
    "mobilenet": (mobilenet_model, 2, 0.01, lambda net, loss: float(loss.mean().asscalar())),
}


def straggler(model: str) -> None:
    """The last rank is 150 ms late every step (``model``: dense or mobilenet): routing history,
    whether x was owned, a result, finiteness, the exact average's bits and the distance."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    steps, slow_rank = 80, size - 1
    build, batch, lr, result = STRAGGLER_MODELS[model]
    net, compute_loss = build(rank)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": lr})

    def train(count):
        for _ in range(count):
            if rank == slow_rank:
                time.sleep(0.15)  # a straggler: everybody would wait for it every round
            with mx.autograd.record():
                loss = compute_loss()
            loss.backward()
            trainer.step(batch)
        return loss

    loss = train(steps)
    gossip = trainer.mode_object.gossip
    history = [[rnd, sorted(slow.items())] for rnd, slow in gossip.averager.routing.history]
    owned = gossip.direct and gossip.averager.owns_x
    trainer.flush()
    trainer.average_parameters()
    trainer.mode_object.restart()  # as mode='auto' does at a switch: the next averager knows rank slow_rank is slow
    loss = train(5)
    assert list(gossip.averager.routing.history)[:1] == [(0, dict(history[-1][1]))], history
    trainer.average_parameters()
    values = [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]
    report([history, owned, result(net, loss), all(bool(np.isfinite(v).all()) for v in values),
            [v.tobytes().hex()[:64] for v in values], trainer.consensus_distance()])
    bps.shutdown()


if __name__ == "__main__":
    run({"digits": digits, "mean_follows_sgd": mean_follows_sgd, "large_in_place": large_in_place,
         "overlapped_in_place": overlapped_in_place, "bad_arguments": bad_arguments,
         "every_keyword": every_keyword, "straggler": straggler})
