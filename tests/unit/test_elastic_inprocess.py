"""The elastic core in one process with a fake Comm (tests/fakes.py): State's commit, restore and
sync, broadcast_object, run's reset loop, and ElasticSampler re-splitting when the size changes."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeComm, FakeWorld, comms, run_ranks

from bps_gossip.elastic import ElasticSampler, ObjectState, broadcast_object, run
from bps_gossip.elastic import comm as elastic_comm
from bps_gossip.errors import (
    HostsUpdatedInterrupt,
    JobEndedError,
    NotInitializedError,
    ResumedInterrupt,
    WorkersChangedError,
)


# -- State ------------------------------------------------------------------------------
def test_commit_then_restore_goes_back_to_the_commit():
    comm = FakeComm(FakeWorld(1), 0)
    state = ObjectState(epoch=0, batches=[1, 2], comm=comm)
    assert state._names == ["epoch", "batches"]  # comm is the job, not a value
    state.epoch, state.batches = 3, [7]
    state.commit()
    state.epoch = 5
    state.batches.append(9)
    state.restore()
    assert (state.epoch, state.batches) == (3, [7])
    assert comm.calls == ["commit_check"]


def test_commit_with_workers_waiting_raises_and_keeps_the_new_commit_point():
    world = FakeWorld(1)
    state = ObjectState(step=0, comm=FakeComm(world, 0))
    state.step = 10
    world.joining = True
    with pytest.raises(HostsUpdatedInterrupt, match="rank 0"):
        state.commit()
    state.step = 11
    state.restore()
    assert state.step == 10


def test_commit_interrupted_by_a_change_keeps_the_previous_commit_point():
    world = FakeWorld(1)
    state = ObjectState(step=0, comm=FakeComm(world, 0))
    state.step = 4
    state.commit()
    state.step = 8
    world.commit_error = WorkersChangedError("a worker died")
    with pytest.raises(WorkersChangedError):
        state.commit()
    state.restore()
    assert state.step == 4


def test_no_commit_check_before_the_job_is_joined():
    comm = FakeComm(FakeWorld(2), 0, initialized=False)
    state = ObjectState(step=0, comm=comm)
    state.commit()
    state.sync()
    assert comm.calls == []


def test_sync_makes_every_rank_hold_rank_0s_values_as_its_commit_point():
    world = FakeWorld(3)
    ranks = comms(world)
    states = [ObjectState(epoch=r, table={"w": np.full(3, float(r)), "t": (r, "x")}, comm=ranks[r]) for r in range(3)]

    def body(rank):
        states[rank].sync()
        states[rank].epoch += 100  # after the sync: restore goes back to the synced values
        states[rank].restore()
        return states[rank]

    for state in run_ranks(3, body):
        assert state.epoch == 0 and state.table["t"] == (0, "x")
        np.testing.assert_array_equal(state.table["w"], np.zeros(3))
    assert all(c.calls == ["broadcast elastic.object_state.length", "broadcast elastic.object_state.bytes"]
               for c in ranks)


def test_one_worker_syncs_without_broadcasting():
    comm = FakeComm(FakeWorld(1), 0)
    ObjectState(step=1, comm=comm).sync()
    assert comm.calls == []


def test_broadcast_object_sends_rank_0s_value():
    world = FakeWorld(4)
    ranks = comms(world)
    values = run_ranks(4, lambda r: broadcast_object({"r": r, "a": np.arange(r + 2)}, "obj", comm=ranks[r]))
    for value in values:
        assert value["r"] == 0
        np.testing.assert_array_equal(value["a"], np.arange(2))


def test_default_comm_comes_from_the_registered_provider():
    fake = FakeComm(FakeWorld(3), 2)
    saved = elastic_comm._provider
    try:
        elastic_comm.set_default_comm_provider(lambda: fake)
        sampler = ElasticSampler(9, shuffle=False)
        assert sampler.indices.tolist() == [2, 5, 8]
        elastic_comm.set_default_comm_provider(None)
        with pytest.raises(NotInitializedError, match="comm"):
            ElasticSampler(9)
    finally:
        elastic_comm.set_default_comm_provider(saved)


# -- run --------------------------------------------------------------------------------
def test_run_resets_rolls_back_and_calls_again():
    world = FakeWorld(1)
    comm = FakeComm(world, 0, initialized=False)
    state = ObjectState(step=0, comm=comm)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.step)])
    attempts = []

    def train(state, stop):
        attempts.append(state.step)
        if len(attempts) == 1:
            state.step = 5
            state.commit()
            state.step = 7
            world.restore = True  # a crash: roll back to step 5
            raise WorkersChangedError("a worker died")
        if len(attempts) == 2:
            state.step = 9
            world.restore = False  # a join: go on from step 9
            raise HostsUpdatedInterrupt("workers are joining")
        return state.step + stop

    assert run(train, comm=comm)(state, 100) == 109
    assert attempts == [0, 5, 9] and resets == [5, 9]
    assert comm.calls == ["init", "holds_state", "commit_check", "reset", "holds_state", "reset", "holds_state",
                          "training_finished"]


def test_run_syncs_a_resumed_worker_without_a_reset_and_calls_again():
    """resume() inside the training function raises ResumedInterrupt: the worker is in the new
    generation already, so run must not reset (that would wait for one more change), only sync."""
    comm = FakeComm(FakeWorld(1), 0)
    state = ObjectState(step=0, comm=comm)
    resets, attempts = [], []
    state.register_reset_callbacks([lambda: resets.append(state.step)])

    def train(state):
        attempts.append(state.step)
        if len(attempts) == 1:
            state.step = 3
            raise ResumedInterrupt("rank 0 of 1 resumed")
        return state.step

    assert run(train, comm=comm)(state) == 3
    assert attempts == [0, 3] and resets == [3]
    assert comm.calls.count("reset") == 0 and comm.calls.count("holds_state") == 2


def test_resume_knows_whether_it_is_inside_a_training_function():
    from bps_gossip.elastic.run import in_training_function
    comm = FakeComm(FakeWorld(1), 0)
    seen = []
    run(lambda state: seen.append(in_training_function()), comm=comm)(ObjectState(comm=comm))
    assert seen == [True] and not in_training_function()


def test_run_exits_when_the_job_ended_without_this_joiner():
    comm = FakeComm(FakeWorld(1), 0)

    def train(state):
        raise JobEndedError("the job finished")

    with pytest.raises(SystemExit) as exited:
        run(train, comm=comm)(ObjectState(comm=comm))
    assert exited.value.code == 0 and comm.calls[-1] == "exit_job_over"


def test_run_lets_other_errors_through():
    comm = FakeComm(FakeWorld(1), 0)

    def train(state):
        raise KeyError("mine")

    with pytest.raises(KeyError):
        run(train, comm=comm)(ObjectState(comm=comm))
    assert "reset" not in comm.calls


# -- ElasticSampler -----------------------------------------------------------------------
def take(sampler, batches, batch_size):
    """Iterate ``batches`` batches as a DataLoader would; the real (not padding) samples taken."""
    start = sampler.consumed
    items = list(iter(sampler))
    real = []
    for batch in range(batches):
        chunk = items[batch * batch_size:(batch + 1) * batch_size]
        if not chunk:
            break
        real += [i for p, i in enumerate(chunk, start + batch * batch_size) if not sampler.is_padding(p)]
        sampler.record_batch(batch, batch_size)
    return real


def sync_all(states):
    run_ranks(len(states), lambda r: states[r].sync())


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("before,leaves,joins", [(4, [1], 0), (2, [], 1), (3, [0, 2], 2), (4, [3], 0)])
def test_sampler_loses_and_repeats_nothing_when_the_size_changes(shuffle, before, leaves, joins):
    n, batch = 103, 4
    world = FakeWorld(before)
    ranks = comms(world)
    samplers = [ElasticSampler(n, shuffle=shuffle, seed=3, comm=c) for c in ranks]
    states = [ObjectState(sampler=s, epoch=0, comm=c) for s, c in zip(samplers, ranks)]
    sync_all(states)
    assert sorted(np.concatenate([s.indices[:len(s.indices) - s.padded] for s in samplers]).tolist()) == list(range(n))
    seen = [i for s in samplers for i in take(s, 3, batch)]  # every rank takes 3 batches in lockstep

    # the change: survivors are renumbered by seniority, joiners come last with fresh samplers
    survivors = [r for r in range(before) if r not in leaves]
    world.change(len(survivors) + joins)
    for new, old in enumerate(survivors):
        ranks[old].next_rank = new
        ranks[old].reset()
    new_comms = [ranks[old] for old in survivors] + [FakeComm(world, len(survivors) + j) for j in range(joins)]
    new_samplers = [samplers[old] for old in survivors] + [ElasticSampler(n, comm=c) for c in new_comms[len(survivors):]]
    new_states = [states[old] for old in survivors] + [ObjectState(sampler=s, epoch=0, comm=c) for s, c in
                                                       zip(new_samplers[len(survivors):], new_comms[len(survivors):])]
    if 0 in leaves:  # rank 0 is gone: the new rank 0 holds the same (lockstep) sampler state anyway
        assert all(s.consumed == 3 * batch for s in new_samplers[:len(survivors)])
    sync_all(new_states)
    assert {s.split_size for s in new_samplers} == {world.size}
    lengths = {len(s) for s in new_samplers}
    assert len(lengths) == 1  # padded: every rank takes as many batches
    seen += [i for s in new_samplers for i in take(s, 1000, batch)]
    assert sorted(seen) == list(range(n))


def test_sampler_rollback_goes_back_to_the_committed_position():
    world = FakeWorld(2)
    ranks = comms(world)
    samplers = [ElasticSampler(40, shuffle=False, comm=c) for c in ranks]
    states = [ObjectState(sampler=s, comm=c) for s, c in zip(samplers, ranks)]
    for s in samplers:
        take(s, 2, 5)
    for state in states:
        state.save()
    for s in samplers:
        take(s, 1, 5)
    for state in states:
        state.restore()
    assert [s.consumed for s in samplers] == [10, 10]
    assert list(iter(samplers[1]))[:2] == [21, 23]


def test_sampler_before_init_is_the_whole_dataset():
    sampler = ElasticSampler(5, shuffle=False, comm=FakeComm(FakeWorld(3), 1, initialized=False))
    assert list(sampler) == [0, 1, 2, 3, 4] and sampler.padded == 0
    with pytest.raises(ValueError, match="dataset_len"):
        ElasticSampler(-1, comm=FakeComm(FakeWorld(1), 0))
