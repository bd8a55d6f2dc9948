"""Asynchronous training with a straggler: DistributedTrainer(mode='async') against mode='allreduce'
and MXNet's own dist_async (gluon.Trainer with kvstore=mx.kv.create('dist_async')), side by side.

    .venv/bin/python scripts/bench_async.py
    .venv/bin/python scripts/bench_async.py --models mlp --mlp-steps 400 --json async.json

Each system runs its own cluster (1 scheduler, 1 server, 4 workers) on 127.0.0.1, one system after
another. The last worker is the straggler: it sleeps ``--*-sleep`` seconds after every step. The
other (fast) workers take ``--*-steps`` steps each; in the asynchronous systems the straggler stops
once they are done (in allreduce it cannot be left behind). Reported per system: the fast workers'
steps per second (mean over them, from the end of their first step), the straggler's steps when the
fast ones had finished, and the test accuracy of the final model (after a barrier every rank takes
the servers' weights; allreduce's are every rank's). Data: scikit-learn's digits (1,500 training
images split over the workers, 297 test images); the MLP is examples/train_digits.py's, the CNN a
model-zoo network on the digits scaled up to 32x32x3. SGD, learning rate 0.1 (MLP) / 0.02 (CNN) unless given,
momentum 0.9, batch 32 per worker. The table and what it means: docs/async.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    BenchError,
    ClusterShape,
    Job,
    System,
    WorkerGroup,
    format_table,
    install_sigterm_handler,
    machine_info,
    serve,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = [System("ours async", "bps", mode="async"), System("ours allreduce", "bps", mode="allreduce"),
           System("mxnet dist_async", "mxnet", mode="dist_async"),
           # MXNet's servers run one optimizer for every worker's gradients (one momentum): the same
           # learning rate moves its model about N times as far a step; a quarter of it is the same pace
           System("mxnet dist_async quarter lr", "mxnet", mode="dist_async/4")]
ASYNC_MODES = ("async", "dist_async")  # the straggler may stop once the fast workers are done
SHAPE = ClusterShape(4, 1)
BATCH = 32


# -- worker -------------------------------------------------------------------------------

def digits(model: str) -> tuple[Any, Any, Any, Any]:
    """examples/train_digits.py's split; for a CNN the 8x8 images scaled to 32x32, 3 channels."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import load_data

    x_train, y_train, x_test, y_test = load_data()
    if model != "mlp":
        import numpy as np

        def grow(x: Any) -> Any:
            images = x.reshape(-1, 1, 8, 8).repeat(4, axis=2).repeat(4, axis=3)
            return np.ascontiguousarray(np.repeat(images, 3, axis=1))

        x_train, x_test = grow(x_train), grow(x_test)
    return x_train, y_train, x_test, y_test


def build_net(mx: Any, model: str) -> Any:
    """The digits MLP, or a model-zoo CNN with 10 classes."""
    if model == "mlp":
        from train_digits import build_net as mlp

        return mlp()
    return mx.gluon.model_zoo.vision.get_model(model, classes=10)


class Worker:
    """One worker process: joins its system's cluster, trains on command."""

    def __init__(self, kind: str, mode: str) -> None:
        import mxnet as mx

        mode, _, divide = mode.partition("/")  # 'dist_async/4': the learning rate divided by 4
        self.mx, self.kind, self.mode, self.lr_divisor = mx, kind, mode, float(divide or 1)
        if kind == "bps":
            import mxnet_plugin as bps

            bps.init()
            self.bps = bps
            self.rank, self.size = bps.rank(), bps.size()
        else:
            self.kv = mx.kv.create(mode)
            self.rank, self.size = self.kv.rank, self.kv.num_workers

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        """Rank and size once the rendezvous is done."""
        return {"rank": self.rank, "size": self.size}

    def barrier(self) -> None:
        """Every rank's last step is in."""
        if self.kind == "bps":
            import bps_gossip

            bps_gossip.barrier()
        else:
            self.kv._barrier()

    def trainer(self, net: Any, lr: float, model: str) -> Any:
        """This system's trainer."""
        optimizer = ("sgd", {"learning_rate": lr / self.lr_divisor, "momentum": 0.9})
        if self.kind == "bps":
            return self.bps.DistributedTrainer(net.collect_params(), *optimizer, mode=self.mode)
        if model == "mlp":
            return self.mx.gluon.Trainer(net.collect_params(), *optimizer, kvstore=self.kv)
        return ServerUpdates(self.mx, net, self.kv, optimizer)

    def final_model(self, trainer: Any) -> None:
        """After the barrier: the servers' weights into every rank's parameters."""
        if self.kind == "bps":
            trainer.flush()
        elif isinstance(trainer, ServerUpdates):
            trainer.pull([index for index, param in enumerate(trainer._params) if param.grad_req != "null"])
        else:  # the servers update in dist_async: pull the weights as gluon.Trainer's step does
            for index, param in enumerate(trainer._params):
                trainer._kvstore.pull(index, param.list_data(), priority=-index)
        self.mx.nd.waitall()

    def train(self, message: dict[str, Any]) -> dict[str, Any]:
        """Train as the module docstring says; report steps, time and accuracy."""
        import numpy as np

        mx, model = self.mx, message["model"]
        x_train, y_train, x_test, y_test = digits(model)
        x_shard, y_shard = x_train[self.rank::self.size], y_train[self.rank::self.size]
        mx.random.seed(1 + self.rank)
        net = build_net(mx, model)
        net.initialize(mx.init.Xavier())
        net(mx.nd.array(x_shard[:2]))  # shapes known before the trainer exists
        trainer = self.trainer(net, message["lr"], model)
        loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        rng = np.random.RandomState(1 + self.rank)
        folder = Path(message["folder"])
        straggler = self.rank == self.size - 1
        done, started, others = 0, 0.0, None
        while done < message["steps"]:
            if straggler and self.mode in ASYNC_MODES and len(list(folder.glob("done*"))) == self.size - 1:
                break
            order = rng.choice(len(x_shard), BATCH, replace=False)
            with mx.autograd.record():
                loss = loss_fn(net(mx.nd.array(x_shard[order])), mx.nd.array(y_shard[order]))
            loss.backward()
            trainer.step(BATCH)
            done += 1
            (folder / f"progress{self.rank}").write_text(str(done))
            if done == 1:
                mx.nd.waitall()
                started = time.monotonic()
            if straggler:
                time.sleep(message["sleep"])
        mx.nd.waitall()
        seconds = time.monotonic() - started
        if not straggler:
            others = int((folder / f"progress{self.size - 1}").read_text() or 0)
            (folder / f"done{self.rank}").write_text("")
        self.barrier()
        self.final_model(trainer)
        predictions = net(mx.nd.array(x_test)).argmax(axis=1).asnumpy()
        return {"rank": self.rank, "steps": done, "seconds": seconds, "straggler_at_finish": others,
                "accuracy": float((predictions == y_test).mean())}


class ServerUpdates:
    """What gluon.Trainer(kvstore=dist_async) does, driven by hand: the servers run the optimizer on
    each pushed gradient, the worker pulls the weights. gluon.Trainer itself dies on CNNs here ("init
    N first" on the server: its first pushes race the keys' initialization); initializing every key
    first and meeting at a barrier works (as scripts/bench_training.py does for dist_sync)."""

    def __init__(self, mx: Any, net: Any, kv: Any, optimizer: tuple[str, dict[str, Any]]) -> None:
        self._params = [p for _, p in sorted(net.collect_params().items())]
        self._kvstore = kv
        name, options = optimizer
        kv.set_optimizer(mx.optimizer.create(name, rescale_grad=1.0 / BATCH, **options))
        keys = list(range(len(self._params)))
        kv.init(keys, [mx.nd.array(p.data().asnumpy()) for p in self._params])  # plain layouts (see pull)
        kv._barrier()
        # pulled into plain arrays, then copied: a pull cannot write into an array that holds a
        # oneDNN layout (conv weights after a forward), a copy reorders
        self.pulled = [mx.nd.zeros(p.shape, dtype=p.dtype) for p in self._params]
        self.pull(keys)

    def pull(self, keys: list[int]) -> None:
        """The servers' weights of ``keys`` into the parameters."""
        for index in keys:
            self._kvstore.pull(index, out=self.pulled[index], priority=-index)
            self.pulled[index].copyto(self._params[index].data())

    def step(self, batch_size: int) -> None:
        """Push every gradient, pull every weight (last layers first, as gluon.Trainer's priority)."""
        learned = [index for index, param in enumerate(self._params) if param.grad_req != "null"]
        for index in learned:
            self._kvstore.push(index, self._params[index].grad(), priority=-index)
        self.pull(learned)


def worker_main(kind: str, mode: str) -> int:
    """Entry point of a worker process (started by the driver with --worker-kind)."""
    worker = Worker(kind, mode)
    code = serve({"hello": worker.hello, "train": worker.train})
    if kind == "bps":
        worker.bps.shutdown()
    return code


# -- driver -------------------------------------------------------------------------------

def run_system(job: Job, system: System, model: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One system's cluster, one training run; its row."""
    folder = tmp / f"{model}_{system.mode.replace('/', '_')}"
    folder.mkdir()
    steps, sleep, lr = ((args.mlp_steps, args.mlp_sleep, args.mlp_lr) if model == "mlp"
                        else (args.cnn_steps, args.cnn_sleep, args.cnn_lr))
    group = WorkerGroup(job, system, SHAPE, [sys.executable, __file__])
    try:
        group.command({"cmd": "hello"}, 180)
        replies = group.command({"cmd": "train", "model": model, "steps": steps, "sleep": sleep, "lr": lr,
                                 "folder": str(folder)}, args.timeout)
    finally:
        group.close()
    replies.sort(key=lambda r: r["rank"])
    fast = replies[:-1]
    return {"model": model, "system": system.name, "steps": steps, "straggler_sleep": sleep,
            "fast_steps_per_s": sum((r["steps"] - 1) / r["seconds"] for r in fast) / len(fast),
            "straggler_steps": replies[-1]["steps"],
            "straggler_at_finish": [r["straggler_at_finish"] for r in fast],
            "accuracy": [r["accuracy"] for r in replies]}


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table: one line per model and system."""
    cells = [[r["model"], r["system"], f"{r['fast_steps_per_s']:.1f}", f"{r['steps']}",
              f"{max(r['straggler_at_finish'])}", f"{r['accuracy'][0]:.3f}"] for r in rows]
    return format_table(["model", "system", "fast steps/s", "fast steps", "straggler's steps then",
                         "accuracy"], cells)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,mobilenet0.25", help="mlp and/or model-zoo names (comma-separated)")
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--mlp-sleep", type=float, default=0.05, help="the straggler's sleep per step (MLP)")
    parser.add_argument("--cnn-steps", type=int, default=150)
    parser.add_argument("--cnn-sleep", type=float, default=0.3, help="the straggler's sleep per step (CNN)")
    parser.add_argument("--mlp-lr", type=float, default=0.1)
    parser.add_argument("--cnn-lr", type=float, default=0.02)
    parser.add_argument("--systems", default=",".join(s.name for s in SYSTEMS), help="which rows (comma-separated)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one training run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--logdir", type=Path, help="keep the processes' logs here")
    parser.add_argument("--worker-kind", help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    """Run every model on every system; print the table; write the JSON."""
    args = parse_args()
    if args.worker_kind:
        return worker_main(args.worker_kind, args.worker_mode)
    install_sigterm_handler()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"4 workers, 1 server; the last worker sleeps {args.mlp_sleep} s (MLP) / {args.cnn_sleep} s (CNN) "
          f"after each step; batch {BATCH} per worker\n", flush=True)
    rows, info = [], machine_info()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        logdir = args.logdir or Path(tmp) / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        job = Job(logdir)
        try:
            for model in args.models.split(","):
                for system in [s for s in SYSTEMS if s.name in args.systems.split(",")]:
                    rows.append(run_system(job, system, model, args, Path(tmp)))
                    print(format_rows(rows[-1:]) + "\n", flush=True)
        except BenchError as exc:
            print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            job.close(grace=0.0)
    print("all runs:\n" + format_rows(rows))
    write_json(args.json, {"what": "async training with a straggler", "machine_at_start": info,
                           "machine_at_end": machine_info(), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
