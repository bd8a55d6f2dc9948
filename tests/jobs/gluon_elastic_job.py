"""The worker program of the Gluon kill-loop trials (tests/clusters/test_elastic_trials.py and
scripts/elastic_trials.py): a Gluon MLP with DistributedTrainer inside ``elastic.run``, a
GluonState with an ElasticSampler, on made data (no download).

Environment: MODE (allreduce or gossip), OPTIMIZER (sgd with momentum, or adam: its update counters
are state that a rollback and a joiner's sync must carry), EPOCHS, SAMPLES, BATCH, COMMIT_EVERY, STEP_SLEEP
(seconds per step), KILL_RANK/KILL_STEP (SIGKILL itself before that step, in generation 1),
STOP_RANK/STOP_STEP (SIGSTOP itself there: a stuck worker), STALL_RANK/STALL_STEP (sleep for
STALL_SECONDS there while its heartbeats go on: stuck but alive), LAST_STEPS_SLEEP (seconds per
step of the last three; rank 0 prints LAST STEPS as they begin), AFTER_TRAINING_SLEEP (seconds
between the end of training and the end of the program; rank 0 prints TRAINED).
Prints RESULT lines: ["commit", [[epoch, index], ...]] for the real samples a commit makes
permanent, ["restored", step_before, step_after], ["final", fingerprint, step, epoch, rank, size, num_update].
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import mxnet as mx
import numpy as np

import mxnet_plugin as bps
from bps_gossip import HostsUpdatedInterrupt
from mxnet_plugin import elastic

MODE = os.environ.get("MODE", "allreduce")
OPTIMIZER = os.environ.get("OPTIMIZER", "sgd")
SETTINGS = {"sgd": {"learning_rate": 0.05, "momentum": 0.9}, "adam": {"learning_rate": 0.01}}
EPOCHS = int(os.environ.get("EPOCHS", "2"))
SAMPLES = int(os.environ.get("SAMPLES", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "3"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
ACTS = {kind: (int(os.environ.get(f"{kind}_RANK", "-1")), int(os.environ.get(f"{kind}_STEP", "-1")))
        for kind in ("KILL", "STOP", "STALL")}
STALL_SECONDS = float(os.environ.get("STALL_SECONDS", "30"))
LAST_STEPS_SLEEP = float(os.environ.get("LAST_STEPS_SLEEP", "0"))  # seconds per step of the last 3
AFTER_TRAINING_SLEEP = float(os.environ.get("AFTER_TRAINING_SLEEP", "0"))  # an evaluation, say

pending: list[list[int]] = []  # [epoch, index] this rank trained on since the last commit


def report(value: object) -> None:
    print("RESULT " + json.dumps(value), flush=True)


class RecordedState(elastic.GluonState):
    """Reports what a commit makes permanent (once every rank passed it); forgets it on a rollback."""

    def commit(self) -> None:
        done = list(pending)
        try:
            super().commit()
        except HostsUpdatedInterrupt:
            self._report(done)  # committed; the interrupt only asks for a reset
            raise
        self._report(done)

    @staticmethod
    def _report(done: list[list[int]]) -> None:
        if done:
            report(["commit", done])
        del pending[:len(done)]

    def restore(self) -> None:
        before = self.step
        super().restore()
        pending.clear()
        report(["restored", before, self.step])


def fingerprint(net: mx.gluon.Block) -> str:
    digest = hashlib.sha1()
    for name, param in sorted(net.collect_params().items()):
        digest.update(name.encode() + param.data().asnumpy().tobytes())
    return digest.hexdigest()


def act(step: int) -> None:
    """The fault this rank was told to show at this step (first generation only)."""
    if bps.generation() != 1:
        return
    if ACTS["KILL"] == (bps.rank(), step):
        os.kill(os.getpid(), signal.SIGKILL)
    if ACTS["STOP"] == (bps.rank(), step):
        os.kill(os.getpid(), signal.SIGSTOP)
    if ACTS["STALL"] == (bps.rank(), step):
        time.sleep(STALL_SECONDS)


def main() -> None:
    bps.init()
    rng = np.random.RandomState(0)
    features = rng.randn(SAMPLES, 8).astype(np.float32)
    labels = (features[:, :4].argmax(axis=1)).astype(np.float32)
    dataset = mx.gluon.data.ArrayDataset(mx.nd.array(features), mx.nd.array(labels))
    sampler = elastic.ElasticSampler(SAMPLES, shuffle=True, seed=5)
    loader = mx.gluon.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler, last_batch="keep")
    mx.random.seed(7 + bps.rank())
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(16, activation="relu"), mx.gluon.nn.Dense(4))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.array(features[:1]))
    trainer = bps.DistributedTrainer(net.collect_params(), OPTIMIZER, SETTINGS[OPTIMIZER], mode=MODE)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    state = RecordedState(net, trainer, sampler=sampler, epoch=0, step=0)

    @elastic.run
    def train(state: RecordedState) -> None:
        while state.epoch < EPOCHS:
            start = sampler.consumed
            for batch_index, (data, label) in enumerate(loader):
                act(state.step)
                with mx.autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                trainer.step(data.shape[0])
                positions = range(start + batch_index * BATCH, min(start + (batch_index + 1) * BATCH,
                                                                   len(sampler.indices)))
                pending.extend([state.epoch, int(sampler.indices[p])] for p in positions if not sampler.is_padding(p))
                sampler.record_batch(batch_index, BATCH)
                state.step += 1
                if STEP_SLEEP:
                    time.sleep(STEP_SLEEP)
                if LAST_STEPS_SLEEP and state.epoch == EPOCHS - 1 and batch_index >= len(loader) - 3:
                    if batch_index == len(loader) - 3 and bps.rank() == 0:
                        print("LAST STEPS", flush=True)
                    time.sleep(LAST_STEPS_SLEEP)
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if AFTER_TRAINING_SLEEP:
        if bps.rank() == 0:
            print("TRAINED", flush=True)
        time.sleep(AFTER_TRAINING_SLEEP)
    if MODE == "gossip":
        trainer.average_parameters()
    report(["final", fingerprint(net), state.step, state.epoch, bps.rank(), bps.size(), trainer.optimizer.num_update])
    bps.shutdown()


if __name__ == "__main__":
    main()
