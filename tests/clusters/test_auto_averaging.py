"""mode='auto' makes the models exactly equal while gossip runs, when they drift apart: the rule
(pure), and the averages on real processes (bit-identical ranks, the learning-rate drop; the
workers run tests/jobs/auto_averaging_job.py)."""

from __future__ import annotations

import pytest
from cluster import assert_all_ok

from mxnet_plugin.modes.auto_policy import LR_DROP, MAX_AVERAGE_WINDOWS, AutoPolicy, Window


def gossiping(window: int = 10, price: float = 1e-5) -> AutoPolicy:
    """A policy that has measured both modes and runs gossip (20 ms a step, allreduce 100 ms), and
    an exact average's price (``price`` seconds: cheap, unless a test says)."""
    policy = AutoPolicy(reprobe_windows=10_000, window=window)
    policy.decide(Window("gossip", 0.02, average_seconds=price))
    assert policy.decide(Window("allreduce", 0.1)).mode == "gossip"
    return policy


def test_no_exact_average_before_its_price_is_known_then_at_most_a_twentieth_of_gossips_time():
    policy = AutoPolicy(reprobe_windows=10_000, window=10)
    first = policy.decide(Window("gossip", 0.3, routing_changed=True, slow_lateness=0.6))  # gossip again
    assert first.mode == "gossip" and not first.average and policy.average_interval() > 10 ** 18
    second = policy.decide(Window("gossip", 0.02, slow_lateness=0.6))
    assert second.why.startswith("allreduce not measured") and not second.average
    # its price, before one is measured: an allreduce step (estimated: 0.3 s): 0.3 / (0.05 x 0.02) steps
    assert policy.average_interval() == 300
    decisions = [policy.decide(Window("gossip", 0.02, windows=8)) for _ in range(4)]
    assert [d.average for d in decisions] == [False, False, False, True]  # 20 + 80 x 4 >= 300


def test_the_first_exact_average_comes_at_the_first_gossip_window_that_goes_on():
    policy = gossiping()
    decision = policy.decide(Window("gossip", 0.02, learning_rate=0.1))
    assert decision.mode == "gossip" and decision.average
    assert decision.why.endswith("; exact average: 10 gossip steps since the models were equal")
    why = policy.record_average(1e-4, None)  # nothing to measure the progress against yet
    assert why == "exact average: the ranks were 0.0001 from it (RMS): the next after 20 steps at least (twice as many)"
    assert policy.average_every == 20 and policy.since_average == 0


def test_while_the_drift_is_under_ten_steps_of_progress_the_interval_doubles():
    policy = gossiping()
    steps, averages = 0, []
    for _ in range(40):
        decision = policy.decide(Window("gossip", 0.02, windows=1))
        steps += 10
        if decision.average:
            averages.append(steps)
            policy.record_average(1e-3, 1e-2)  # over 1e-4 a step (10 steps: 1e-3) until 160 steps apart
    assert averages[:5] == [10, 30, 70, 150, 310]  # 10, then 20, 40, 80, 160 steps apart
    assert averages[5:] == [320, 340, 380]  # 6e-5 a step at 310: the next window (its price is 0.2 ms);
    # then 1e-2 in 10 steps is more than the drift again: doubling


def test_the_interval_doubles_to_at_most_64_windows():
    policy = gossiping()
    intervals = []
    for _ in range(9):
        policy.since_average = policy.average_interval() - 10  # due at the end of the next window
        assert policy.decide(Window("gossip", 0.02)).average
        policy.record_average(0.0, None if not intervals else 1.0)
        intervals.append(policy.average_every)
    assert intervals == [20, 40, 80, 160, 320, 640, 640, 640, 640] and MAX_AVERAGE_WINDOWS == 64


def test_drift_over_ten_steps_of_progress_averages_as_often_as_its_price_allows():
    """The plateau: the average hardly moves. Each exact average costs 0.2 s against 20 ms gossip
    steps: one every 0.2 / (0.05 x 0.02) = 200 steps keeps them at a twentieth of gossip's time."""
    policy = gossiping()
    assert policy.decide(Window("gossip", 0.02)).average
    policy.record_average(1e-4, None)  # the next in 20 steps
    assert policy.decide(Window("gossip", 0.02, windows=2, average_seconds=0.004)).average  # cheap: due
    why = policy.record_average(1.1e-3, 2e-3)  # the average moved 1e-4 a step: 10 steps are less than the drift
    assert why.endswith("moved 0.0001 a step in 20: more than 10 steps' progress: the next as soon as its "
                        "price allows")
    assert policy.average_every == 0
    decision = policy.decide(Window("gossip", 0.02, windows=1, average_seconds=0.2))
    assert not decision.average and policy.average_interval() == 200
    lengths = []
    while not decision.average:  # the windows grow as ever, the last one ends when the average is due
        lengths.append(decision.windows)
        decision = policy.decide(Window("gossip", 0.02, windows=decision.windows, average_seconds=0.2))
    assert lengths == [2, 4, 8, 5] and policy.since_average == 200


def test_a_learning_rate_drop_brings_an_exact_average_at_once():
    policy = gossiping()
    assert policy.decide(Window("gossip", 0.02, learning_rate=0.1)).average
    policy.record_average(1e-4, None)  # next in 20 steps
    decision = policy.decide(Window("gossip", 0.02, learning_rate=0.1 * LR_DROP * 0.9))  # 10 steps: not yet due
    assert decision.average and decision.why.endswith("exact average: the learning rate fell from 0.1 to 0.045")
    policy.record_average(1e-3, 1e-3)  # 1e-4 a step: 10 steps are not less than the drift
    assert not policy.decide(Window("gossip", 0.02, learning_rate=0.04)).average  # not under half of 0.045


def test_a_switch_makes_the_models_equal_and_allreduce_makes_no_exact_average():
    policy = gossiping()
    policy.decide(Window("gossip", 0.02, windows=1))
    assert policy.since_average == 10
    policy.cost["allreduce"] = 0.01  # the network changed: allreduce is faster now
    assert policy.decide(Window("gossip", 0.02)).mode == "allreduce" and policy.since_average == 0
    assert not any(policy.decide(Window("allreduce", 0.01, learning_rate=lr)).average for lr in (0.1, 0.001))


@pytest.mark.parametrize("drift,moved", [(float("nan"), None), (-1.0, None), (1e-4, float("inf")), (1e-4, -1.0)])
def test_a_bad_measurement_is_refused(drift, moved):
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        gossiping().record_average(drift, moved)


@pytest.mark.parametrize("field", ["average_seconds", "learning_rate"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1])
def test_a_bad_window_field_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        AutoPolicy().decide(Window("gossip", 0.02, **{field: value}))


@pytest.mark.timeout(300)
def test_exact_averages_leave_every_rank_on_one_model_and_follow_the_learning_rate(cluster):
    """resnet18_v1 hybridized (BatchNorm's running statistics stay each rank's own), 3 workers,
    windows of 3 steps, the first a warm-up, each after decided on at its end (no rank routed
    around): the first exact average at step 6 (on the second window), and one at step 9, on the
    window in which the learning rate fell."""
    job = cluster(3, env={"BPS_GOSSIP_AUTO_WINDOW": "3", "BYTEPS_LOG_LEVEL": "INFO"})
    done = job.run_job("auto_averaging_job", "averages", timeout=280)
    assert_all_ok(done, job)
    histories = [f.result["history"] for f in done]
    assert histories[0] == histories[1] == histories[2], histories  # one push_pull, one rule
    notes = [why for _, _, why in histories[0] if why.startswith("exact average: the ranks were")]
    assert notes and notes[0].endswith("(RMS): the next after 6 steps at least (twice as many)"), histories[0]
    assert float(notes[0].split()[5]) > 0  # the ranks had drifted apart in 3 gossip steps
    drops = [step for step, _, why in histories[0] if "the learning rate fell from 0.01 to 0.001" in why]
    assert drops and drops[0] == 9, histories[0]
    averaged = [f.result["averaged"] for f in done]
    assert averaged[0] == averaged[1] == averaged[2]  # bit-identical right after each exact average
    assert [step for step, _ in averaged[0]][0] == 6 and drops[0] in [step for step, _ in averaged[0]]
    assert len({f.result["end"] for f in done}) == 3  # gossip parted them again
    assert "mode='auto' at step 6: gossip (exact average: the ranks were" in job.dump()
