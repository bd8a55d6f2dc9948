"""The worker program of the elastic tests (numpy only): SGD on per-sample constant
gradients, so that the final parameters tell whether every sample counted exactly once.

Environment: EPOCHS, SAMPLES, BATCH, COMMIT_EVERY, and optionally KILL_RANK/KILL_STEP
(SIGKILL itself there, in the first generation only), RAISE_RANK/RAISE_STEP (an uncaught
exception there), LEAVE_RANK/LEAVE_STEP (leave
gracefully after that step, which must be a commit step), KILL_IN_SYNC_RANK (die inside the first sync of
generation 2), STEP_SLEEP (seconds per step, so that joiners find the job running).
Prints RESULT lines: ["commit", [[epoch, index], ...]] for every committed batch,
["restored", step_before, step_after], ["reset", generation, rank, size], ["final", ...].
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import bps_gossip as bps
from bps_gossip.elastic import ElasticSampler, ObjectState, run


def report(value):
    print("RESULT " + json.dumps(value), flush=True)


EPOCHS = int(os.environ.get("EPOCHS", "3"))
SAMPLES = int(os.environ.get("SAMPLES", "60"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "2"))
KILL_RANK = int(os.environ.get("KILL_RANK", "-1"))
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
LEAVE_RANK = int(os.environ.get("LEAVE_RANK", "-1"))
LEAVE_STEP = int(os.environ.get("LEAVE_STEP", "-1"))
RAISE_RANK = int(os.environ.get("RAISE_RANK", "-1"))
RAISE_STEP = int(os.environ.get("RAISE_STEP", "-1"))
KILL_IN_SYNC_RANK = int(os.environ.get("KILL_IN_SYNC_RANK", "-1"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
LR = 0.5
GRADS = (np.arange(SAMPLES * 4, dtype=np.float64).reshape(SAMPLES, 4) % 7) + 1  # small integers: sums are exact

pending: list[list[int]] = []  # [epoch, index] consumed by this rank since the last commit


class RecordedState(ObjectState):
    """Reports what this rank consumed whenever it is committed, forgets it on a rollback."""

    def save(self):
        super().save()
        if pending:
            report(["commit", list(pending)])
            pending.clear()

    def restore(self):
        before = self.step
        super().restore()
        pending.clear()
        report(["restored", before, self.step])

    def sync(self):
        if KILL_IN_SYNC_RANK == bps.rank() and bps.generation() == 2:
            os.kill(os.getpid(), 9)
        super().sync()


def main():
    bps.init()
    sampler = ElasticSampler(SAMPLES, shuffle=True, seed=3)
    state = RecordedState(x=np.zeros(4), step=0, epoch=0, sampler=sampler)
    state.register_reset_callbacks([lambda: report(["reset", bps.generation(), bps.rank(), bps.size()])])

    @run
    def train(state):
        while state.epoch < EPOCHS:
            order = list(iter(sampler))
            start = sampler.consumed
            for batch_index in range(0, (len(order) + BATCH - 1) // BATCH):
                positions = range(start + batch_index * BATCH, min(start + (batch_index + 1) * BATCH,
                                                                   len(sampler.indices)))
                real = [int(sampler.indices[p]) for p in positions if not sampler.is_padding(p)]
                if bps.rank() == KILL_RANK and bps.generation() == 1 and state.step == KILL_STEP:
                    os.kill(os.getpid(), 9)
                if bps.rank() == RAISE_RANK and bps.generation() == 1 and state.step == RAISE_STEP:
                    raise RuntimeError("a bug in the training code")  # uncaught: a crash, not a leave
                grad = GRADS[real].sum(axis=0) if real else np.zeros(4)
                total = bps.push_pull(grad, "grad", average=False)
                state.x -= LR * total
                sampler.record_batch(batch_index, BATCH)
                pending.extend([state.epoch, i] for i in real)
                state.step += 1
                if STEP_SLEEP:
                    time.sleep(STEP_SLEEP)
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
                if bps.rank() == LEAVE_RANK and bps.generation() == 1 and state.step == LEAVE_STEP:
                    # right after a commit every rank made: nothing of this rank's work is lost
                    report(["left", state.step])
                    bps.shutdown()
                    sys.exit(0)
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        return state

    final = train(state)
    report(["final", final.x.tolist(), final.step, final.epoch, bps.rank(), bps.size(), bps.generation()])
    from bps_gossip import testing
    hosts = testing.host_link()
    report(["host", hosts.hosting, hosts.leader])  # where its push_pulls went (tests/clusters/test_host_reduce.py)
    bps.shutdown()


if __name__ == "__main__":
    main()
