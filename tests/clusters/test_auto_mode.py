"""DistributedTrainer(mode='auto'): the decision rule (pure), and the mode at work on real
processes: every rank decides the same, and switching keeps the models consistent (the workers
run tests/jobs/auto_mode_job.py)."""

from __future__ import annotations

import mxnet as mx
import pytest
from cluster import assert_all_ok

import mxnet_plugin as bps
from mxnet_plugin.modes.auto_policy import AutoPolicy, Window


def feed(policy: AutoPolicy, mode: str, seconds: float):
    return policy.decide(Window(mode, seconds))


def test_each_mode_is_measured_first_then_the_faster_runs():
    policy = AutoPolicy(margin=0.9, reprobe_windows=3, probe_share=1.0)
    assert policy.first() == "gossip"
    assert feed(policy, "gossip", 0.080).mode == "allreduce"  # not measured yet
    decision = feed(policy, "allreduce", 0.100)
    assert decision.mode == "gossip" and decision.why == "gossip 80.0 ms a step < 0.9 x allreduce's 100.0 ms"
    assert [feed(policy, "gossip", 0.080).mode for _ in range(2)] == ["gossip"] * 2
    probe = feed(policy, "gossip", 0.080)  # the third window of gossip since allreduce ran
    assert probe.mode == "allreduce" and "measuring allreduce again" in probe.why
    assert feed(policy, "allreduce", 0.060).mode == "allreduce"  # the network changed: allreduce is faster now


def test_a_window_that_measures_allreduce_is_half_as_long():
    assert [AutoPolicy.probe_steps(w) for w in (1, 2, 3, 4, 10, 11)] == [1, 2, 3, 3, 5, 5]
    assert not AutoPolicy.short(AutoPolicy.first())  # gossip's first window is whole (routing settles)
    policy = AutoPolicy(reprobe_windows=2, probe_share=1.0)
    assert feed(policy, "gossip", 0.03).probe  # allreduce, not measured yet: short
    assert not feed(policy, "allreduce", 0.1).probe
    assert [feed(policy, "gossip", 0.03).probe for _ in range(2)] == [False, True]  # then allreduce again: short
    assert not feed(policy, "allreduce", 0.1).probe


def test_the_other_mode_is_measured_again_for_at_most_a_twentieth_of_the_time():
    policy = AutoPolicy(reprobe_windows=2, window=10)  # allreduce's probe: 5 steps at 0.4 s = 2 s
    feed(policy, "gossip", 0.02)
    feed(policy, "allreduce", 0.4)
    decisions = [feed(policy, "gossip", 0.02) for _ in range(250)]  # a window: 10 x 0.02 s = 0.2 s
    probes = [index for index, decision in enumerate(decisions) if decision.mode == "allreduce"]
    assert probes[0] == 199 and "measuring allreduce again" in decisions[199].why  # 40 s of gossip = 20 x 2 s
    policy = AutoPolicy(reprobe_windows=20, window=10)
    feed(policy, "gossip", 0.05)
    feed(policy, "allreduce", 0.1)
    decisions = [feed(policy, "gossip", 0.05) for _ in range(20)]  # cheap to measure: every 20 windows
    assert [d.mode for d in decisions].index("allreduce") == 19


def test_gossip_must_beat_allreduce_by_the_margin():
    policy = AutoPolicy(margin=0.9)
    feed(policy, "gossip", 0.095)
    decision = feed(policy, "allreduce", 0.100)
    assert decision.mode == "allreduce"  # 5% faster is not enough
    assert decision.why == "gossip 95.0 ms a step >= 0.9 x allreduce's 100.0 ms"
    policy = AutoPolicy(margin=0.9)
    feed(policy, "gossip", 0.089)
    assert feed(policy, "allreduce", 0.100).mode == "gossip"


def test_windows_grow_while_the_decision_stays_and_count_as_that_many():
    policy = AutoPolicy(reprobe_windows=20, window=10)
    policy.decide(Window("gossip", 0.05, average_seconds=10.0))  # no exact average is due to end a window early
    decision = feed(policy, "allreduce", 0.1)
    lengths = []
    for _ in range(5):
        assert decision.mode == "gossip", decision
        lengths.append(decision.windows)
        decision = policy.decide(Window("gossip", 0.05, windows=decision.windows))
    assert lengths == [1, 2, 4, 8, 8]
    assert decision.mode == "allreduce" and decision.probe  # 1 + 2 + 4 + 8 + 8 >= 20 windows of gossip
    assert policy.decide(Window("allreduce", 0.1)).windows == 1  # a switch: one window again
    with pytest.raises(ValueError, match="windows=9"):
        policy.decide(Window("gossip", 0.05, windows=9))


def test_a_window_in_which_gossip_routing_changed_is_measured_again_once():
    policy = AutoPolicy()
    again = policy.decide(Window("gossip", 0.3, routing_changed=True))  # the rounds before routing began
    assert again.mode == "gossip" and not again.probe and "measuring gossip again" in again.why
    assert policy.decide(Window("gossip", 0.02, routing_changed=True)).mode == "allreduce"  # once only
    assert policy.cost["gossip"] == 0.02


def test_allreduce_is_not_measured_when_gossip_routes_around_a_rank_that_late():
    """Every allreduce step would wait for the slow rank: measuring it would cost more than the run."""
    policy = AutoPolicy(reprobe_windows=2, window=10)
    policy.decide(Window("gossip", 0.3, routing_changed=True, slow_lateness=0.77))
    decision = policy.decide(Window("gossip", 0.03, slow_lateness=0.77))  # 0.03 < 0.6 x 0.5 x 0.77
    assert decision.mode == "gossip" and decision.why.startswith("allreduce not measured: each of its steps "
                                                                 "would wait about 385 ms"), decision.why
    assert policy.estimated and policy.cost["allreduce"] == pytest.approx(0.385)
    decisions = [policy.decide(Window("gossip", 0.03, slow_lateness=0.77)) for _ in range(200)]
    assert "(estimated)" in decisions[0].why
    first = [d.mode for d in decisions].index("allreduce")  # measured when the estimate says it is cheap enough
    assert first == 128  # 129 windows x 10 steps x 0.03 s x 0.05 >= 5 steps x 0.385 s
    decision = policy.decide(Window("allreduce", 0.2))
    assert decision.mode == "gossip" and not policy.estimated and decision.why.endswith("allreduce's 200.0 ms")


def test_allreduce_is_measured_when_the_slow_rank_is_not_late_enough():
    policy = AutoPolicy()
    decision = policy.decide(Window("gossip", 0.03, slow_lateness=0.09))  # 0.03 >= 0.6 x 0.045
    assert decision.mode == "allreduce" and decision.probe and "not measured yet" in decision.why
    assert not policy.estimated


def test_allreduce_is_not_measured_when_a_lower_bound_from_the_links_decides():
    """Gossip's step under the margin of a lower bound of allreduce's (from the links gossip
    measured): no probe, no switch; where the bound does not decide, allreduce is measured."""
    policy = AutoPolicy()
    decision = policy.decide(Window("gossip", 0.10, allreduce_estimate=0.336))  # 0.10 < 0.6 x 0.336
    assert decision.mode == "gossip" and not decision.probe, decision.why
    assert decision.why.startswith("allreduce not measured: its step takes at least 336.0 ms")
    assert policy.estimated and policy.cost["allreduce"] == pytest.approx(0.336)
    assert "(estimated)" in policy.decide(Window("gossip", 0.10, allreduce_estimate=0.336)).why
    close = AutoPolicy()
    decision = close.decide(Window("gossip", 0.025, allreduce_estimate=0.035))  # 0.025 >= 0.6 x 0.035
    assert decision.mode == "allreduce" and decision.probe and not close.estimated
    with pytest.raises(ValueError, match="allreduce_estimate"):
        AutoPolicy().decide(Window("gossip", 0.1, allreduce_estimate=float("nan")))


def test_the_same_windows_give_the_same_decisions():
    windows = [Window("allreduce", 0.1), Window("gossip", 0.07)] + [Window("gossip", 0.07)] * 12
    runs = []
    for _ in range(2):
        policy = AutoPolicy()
        runs.append([policy.decide(window) for window in windows])
    assert runs[0] == runs[1]


def test_after_a_reset_both_modes_are_measured_again():
    policy = AutoPolicy()
    feed(policy, "allreduce", 0.1)
    feed(policy, "gossip", 0.05)
    policy.reset()
    assert feed(policy, "gossip", 0.05).mode == "allreduce"
    assert not policy.estimated and "allreduce" not in policy.cost


@pytest.mark.parametrize("window", [
    Window("sgd", 0.1), Window("gossip", float("nan")), Window("gossip", -1.0),
    Window("gossip", 0.1, slow_lateness=float("inf")), Window("gossip", 0.1, slow_lateness=-0.5)])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError):
        AutoPolicy().decide(window)


def test_auto_takes_no_compression():
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    with pytest.raises(ValueError, match="mode='auto' takes no compression_params"):
        bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                               compression_params={"compressor": "onebit"}, mode="auto")


@pytest.mark.timeout(240)
def test_every_rank_takes_the_same_decisions_from_the_measured_times(cluster):
    """mobilenet0.25 imperative (the other test hybridizes it)."""
    job = cluster(2, env={"BPS_GOSSIP_AUTO_WINDOW": "6", "BYTEPS_LOG_LEVEL": "INFO"})
    done = job.run_job("auto_mode_job", "train", "measured", "16", "False", timeout=220)  # policy, steps, hybridize
    assert_all_ok(done, job)
    histories = [f.result["history"] for f in done]
    assert histories[0] == histories[1], histories  # the numbers in "why" came from one push_pull
    # the first window warms up; no rank routed around: the second is decided on at its end (the
    # ranks are in step); allreduce from step 12, its probe 3 steps, decided on at once
    assert [(step, mode) for step, mode, _ in histories[0][:2]] == [(0, "gossip"), (12, "allreduce")]
    assert [step for step, _, _ in histories[0]] == [0, 12, 15], histories[0]
    assert "ms a step" in histories[0][2][2]
    assert "mode='auto' at step 12: allreduce (measuring allreduce (not measured yet))" in job.dump()


@pytest.mark.timeout(240)
def test_switching_keeps_every_rank_on_one_model_where_allreduce_runs(cluster):
    """Three workers: gossip leaves the models apart; a switch to allreduce makes the models and
    the optimizer's momentum exactly their average, so that every allreduce step leaves the ranks
    bit-identical (without the momentum's average they part at the first step)."""
    job = cluster(3, env={"BPS_GOSSIP_AUTO_WINDOW": "3"})
    done = job.run_job("auto_mode_job", "train", "alternate", "21", "True", timeout=220)  # policy, steps, hybridize
    assert_all_ok(done, job)
    runs = [f.result["steps"] for f in done]
    modes = [step[0] for step in runs[0]]
    # the first window warms up (not decided on); no rank routed around: every window after is
    # decided on at its end
    assert modes == ["gossip"] * 6 + ["allreduce"] * 3 + ["gossip"] * 3 + ["allreduce"] * 3 + ["gossip"] * 3 \
        + ["allreduce"] * 3
    for step, mode in enumerate(modes):
        digests = {run[step][1] for run in runs}
        if mode == "allreduce":
            assert len(digests) == 1, (step, mode)
        elif step % 3 == 2:  # the last gossip step of a window: apart (3 ranks, one round a step)
            assert len(digests) > 1, (step, mode)
    assert all([step for step, _, _ in f.result["history"]] == [0, 6, 9, 12, 15, 18] for f in done)


def _scripts():
    import sys
    from pathlib import Path
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)


def test_the_time_to_accuracy_table_has_a_row_per_mode():
    _scripts()
    from netns_tta import Curve, rows_for

    curves = {"allreduce": Curve("allreduce", [10.0, 20.0], [0.9, 0.98], 22),
              "gossip": Curve("gossip", [8.0, 16.0, 24.0], [0.9, 0.97, 0.98], 33),
              "auto": Curve("auto", [9.0, 18.0], [0.92, 0.95], 22)}
    rows = rows_for("run1", curves)
    assert [row[1] for row in rows] == ["allreduce", "gossip", "auto"]
    assert [row[-2] for row in rows] == ["20.0", "24.0", "not reached"]
    assert [row[-1] for row in rows] == ["", "1.20", "-"]


@pytest.mark.parametrize("modes,ok", [("allreduce,gossip,auto", True), ("gossip,auto", False),
                                      ("allreduce,sgd", False), ("allreduce,auto,auto", False)])
def test_netns_cluster_checks_its_modes(modes, ok, capsys):
    _scripts()
    from netns_cluster import parse_args

    argv = ["--time-to-accuracy", "--modes", modes]
    if ok:
        assert parse_args(argv).modes == modes.split(",")
    else:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--modes" in capsys.readouterr().err
