"""Elastic training of the digits MLP: workers may die, leave or join while it trains.

    bpslaunch -np 3 --min-np 2 --max-np 4 python examples/train_digits_elastic.py

The whole state (parameters, optimizer states, epoch, the sampler's position) is
committed every ``--commit-every`` steps. A crashed worker costs the steps since the
last commit; the survivors re-split what is left of the epoch and go on, and a worker
that joins (``bpslaunch --join ...``) is absorbed at the next commit. ``--kill-rank R
--kill-step S`` makes rank R SIGKILL itself at step S (once, in the first generation)
to watch a recovery. ``--suspend-rank R --suspend-step S --suspend-for T`` makes rank R
step out of the job with ``bps.suspend()`` at step S for T seconds (the others go on) and come
back with ``bps.resume()``: it is admitted at the others' next commit and synced from rank 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import mxnet as mx

import bps_gossip as core
import mxnet_plugin as bps
from mxnet_plugin import elastic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import accuracy, build_net, load_data  # noqa: E402


def fingerprint(net: mx.gluon.Block) -> str:
    """A hash of every parameter's bytes: equal on two ranks only if the models are identical."""
    digest = hashlib.sha1()
    for name, param in sorted(net.collect_params().items()):
        digest.update(name.encode())
        digest.update(param.data().asnumpy().tobytes())
    return digest.hexdigest()


def step_out(seconds: float) -> None:
    """Leave the job for ``seconds`` (the others go on without this worker), then join it again.
    resume() raises ResumedInterrupt here, inside elastic.run: run gives this worker rank 0's
    state (the others' by then) and calls the training function again."""
    print(f"rank {bps.rank()}: suspending for {seconds:g} s", flush=True)
    bps.suspend()
    time.sleep(seconds)
    bps.resume()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # bpslaunch --mode sets BPS_GOSSIP_MODE: the example follows it unless told otherwise, and
    # BYTEPS_ENABLE_ASYNC=1, beside which DistributedTrainer refuses any mode but async
    parser.add_argument("--mode", choices=["gossip", "allreduce", "auto", "async"],
                        default=os.environ.get("BPS_GOSSIP_MODE", "").strip().lower()
                        or ("async" if core.job_config().enable_async else "allreduce"),
                        help="default: BPS_GOSSIP_MODE (bpslaunch --mode), async under BYTEPS_ENABLE_ASYNC=1, "
                             "else allreduce")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--commit-every", type=int, default=5, help="steps between commits")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--suspend-rank", type=int, default=-1)
    parser.add_argument("--suspend-step", type=int, default=-1, help="the step after which it steps out")
    parser.add_argument("--suspend-for", type=float, default=2.0, help="seconds out of the job")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep per step (pretend the model is bigger; leaves time to join)")
    parser.add_argument("--report-json", action="store_true", help="print a RESULT line with the outcome")
    args = parser.parse_args(argv)

    bps.init()
    x_train, y_train, x_test, y_test = load_data()
    dataset = mx.gluon.data.ArrayDataset(mx.nd.array(x_train), mx.nd.array(y_train))
    sampler = elastic.ElasticSampler(len(dataset), shuffle=True, seed=args.seed)
    loader = mx.gluon.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    mx.random.seed(args.seed + bps.rank())
    net = build_net()
    net.initialize(mx.init.Xavier())
    net(mx.nd.array(x_train[:1]))  # shapes are deferred: the state needs real parameters
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": args.lr, "momentum": 0.9},
                                     mode=args.mode)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    state = elastic.GluonState(net, trainer, sampler=sampler, epoch=0, step=0)
    state.register_reset_callbacks([lambda: print(
        f"rank {bps.rank()}: now {bps.size()} workers (generation {bps.generation()})", flush=True)])

    suspended: list[int] = []

    @elastic.run
    def train(state: elastic.GluonState) -> None:
        while state.epoch < args.epochs:
            for batch_index, (data, label) in enumerate(loader):
                if bps.rank() == args.kill_rank and state.step == args.kill_step and bps.generation() == 1:
                    os.kill(os.getpid(), 9)
                with mx.autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                trainer.step(data.shape[0])
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                sampler.record_batch(batch_index, args.batch_size)
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
                if bps.rank() == args.suspend_rank and state.step == args.suspend_step and not suspended:
                    suspended.append(state.step)  # once: after resume() the rank (and the step) may repeat
                    step_out(args.suspend_for)
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            print(f"rank {bps.rank()} of {bps.size()}: epoch {state.epoch}/{args.epochs} step {state.step} "
                  f"test accuracy {accuracy(net, x_test, y_test):.4f}", flush=True)

    train(state)
    if args.mode == "async":  # every rank's last change in before anyone takes the weights
        core.barrier()
    trainer.average_parameters()  # gossip: end on one model; async: the servers' (allreduce: already one)
    final = accuracy(net, x_test, y_test)
    print(f"rank {bps.rank()} final test accuracy {final:.4f} after {state.step} steps, "
          f"{bps.size()} workers at the end", flush=True)
    if args.report_json:
        print("RESULT " + json.dumps({"rank": bps.rank(), "size": bps.size(), "step": state.step,
                                      "epoch": state.epoch, "accuracy": final, "generation": bps.generation(),
                                      "fingerprint": fingerprint(net)}), flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
