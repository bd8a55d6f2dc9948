"""Ranks that wait for each other in different places, on real processes (2 workers, gossip mode):
one rank took a step more before average_parameters() (both fail at once, saying who waits
where, instead of at BPS_GOSSIP_TIMEOUT), one rank evaluates alone (the timeout says so), one
rank stopped early (the loss says after which round); and the evaluation patterns that
docs/gossip.md gives work, in a job whose ranks are slow by turns without being out of step. The
workers run tests/jobs/uneven_steps_job.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import assert_all_ok

from bps_gossip.worker import wait_notices


def outcomes(done):
    """Each rank's [error class, message, seconds] (its first report)."""
    return {f.rank_hint: f.results[0] for f in done}


@pytest.mark.timeout(90)
def test_a_step_more_before_average_parameters_fails_at_once_on_both_ranks(cluster):
    """Rank 1 takes 4 steps, rank 0 takes 3 and calls average_parameters(): rank 1 waits in
    gossip round 3 for rank 0, rank 0 in the average for rank 1. Both would wait out the 30 s
    BPS_GOSSIP_TIMEOUT; each fails within seconds saying where the other waits."""
    job = cluster(2, env={"BPS_GOSSIP_TIMEOUT": "30"})
    # timeout 25, before BPS_GOSSIP_TIMEOUT: the test fails where the ranks would wait it out
    done = job.run_job("uneven_steps_job", "step_more", timeout=25)
    result = outcomes(done)
    waiter, averager = result[1], result[0]
    assert waiter[0] == averager[0] == "RanksOutOfStepError", result
    assert waiter[2] < 15 and averager[2] < 15, result
    for message in (waiter[1], averager[1]):
        assert "the ranks took different numbers of steps" in message, message
        assert "gossip round (one a step) more" in message, message
        assert "'trainer.average.weight' (average_parameters() or average_every)" in message, message
        assert "docs/gossip.md#ranks-out-of-step" in message, message
    assert waiter[1].startswith("gossip 'trainer' round 3 on rank 1:"), waiter
    assert "Rank 0 sent its last 'trainer' round, 2," in waiter[1], waiter
    assert averager[1].startswith("push_pull 'trainer.average.weight'"), averager
    assert "Rank 1 waits in gossip 'trainer' round 3" in averager[1], averager


@pytest.mark.timeout(60)
def test_a_rank_evaluating_alone_is_named_in_the_timeout(cluster):
    """Rank 0 evaluates alone for longer than BPS_GOSSIP_TIMEOUT while rank 1 waits in the next
    round: rank 1's timeout says that rank 0 waits nowhere in bps_gossip and points to the
    pattern for evaluating on one rank."""
    job = cluster(2, env={"BPS_GOSSIP_TIMEOUT": "2"})
    done = job.run_job("uneven_steps_job", "evaluate_alone", timeout=40)
    waiter = outcomes(done)[1]
    assert waiter[0] == "CommTimeoutError", waiter
    assert waiter[1].startswith("gossip 'trainer' round 2 on rank 1: ranks [0] sent nothing within 2.0 s"), waiter
    assert "Rank 0 sent its last 'trainer' round, 1," in waiter[1], waiter
    assert "reported no wait in bps_gossip since" in waiter[1], waiter
    assert "evaluating or saving on one rank alone? see docs/gossip.md#evaluating-on-one-rank" in waiter[1], waiter


@pytest.mark.timeout(60)
def test_a_rank_that_stopped_early_is_named_with_its_last_round(cluster):
    """Rank 0 takes 3 steps and shuts down; rank 1 takes a fourth: its loss of rank 0 says
    which round rank 0 sent last and that it took a round fewer."""
    job = cluster(2, env={"BPS_GOSSIP_TIMEOUT": "30"})
    done = job.run_job("uneven_steps_job", "stop_early", timeout=25)
    result = outcomes(done)
    assert result[0][0] == "ok", result
    lost = result[1]
    assert lost[0] == "PeerLostError" and lost[2] < 15, lost
    assert "left the job" in lost[1] and "it sent its last 'trainer' round, 2," in lost[1], lost
    assert "this rank waits for its round 3: it took 1 gossip round (one a step) fewer than this rank" in lost[1], lost


@pytest.mark.timeout(90)
def test_the_evaluation_patterns_work_and_slow_ranks_are_not_out_of_step(cluster):
    """docs/gossip.md#evaluating-on-one-rank, with BPS_GOSSIP_TIMEOUT=2 (peers are told where a
    rank waits after 0.5 s): every rank evaluates its shard and one push_pull sums the counts;
    or average_parameters(), rank 0 evaluates alone for 4.5 s (over 2 timeouts), every rank meets at
    bps.barrier(). Between them the ranks are slow by turns, in gossip rounds and in the average
    (each waits for the other past the notice, never out of step): the job completes."""
    job = cluster(2, env={"BPS_GOSSIP_TIMEOUT": "2"})
    done = job.run_job("uneven_steps_job", "evaluation_patterns", timeout=80)
    assert_all_ok(done, job)
    assert all(f.results[0][0] == "ok" for f in done), [f.results for f in done]
    assert done[0].results[1] == done[1].results[1]  # the exact average at the end


def test_the_docs_the_messages_point_to_exist():
    """The sections the messages name (bps_gossip.worker.wait_notices) are headings of docs/gossip.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "gossip.md").read_text()
    anchors = {line.lstrip("#").strip().lower().replace(" ", "-") for line in text.splitlines()
               if line.startswith("## ")}
    for doc in (wait_notices.EVALUATING_DOC, wait_notices.OUT_OF_STEP_DOC):
        path, anchor = doc.split("#")
        assert path == "docs/gossip.md" and anchor in anchors, (doc, sorted(anchors))
