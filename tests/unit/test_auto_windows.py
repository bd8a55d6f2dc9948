"""mode='auto''s window measurements combined over ranks (issue 37): one rank's lie about its
step time, or any number no honest rank sends, cannot move the decision every rank takes."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.unit


def window(seconds: float, loss: float = 2.0, known: float = 1.0) -> list[float]:
    # seconds a step, routing changed, lateness, average's seconds, lr, loss, loss known, allreduce estimate
    return [seconds, 0.0, 0.0, 0.5, 0.01, loss, known, 0.08]


def test_a_liars_step_time_moves_nothing(caplog):
    from mxnet_plugin.modes.auto import combine_windows

    honest = [window(0.05), window(0.06), window(0.055)]
    for lie in (1000.0, 1e5):  # the attack: 1000 s for a gossip window put every rank in allreduce
        combined = combine_windows(np.array([*honest, window(lie)]))
        assert 0.05 <= combined[0] <= 0.06, combined
    for lie in (-1000.0, np.nan, np.inf, 2e6):  # none an honest rank sends: left out, named
        with caplog.at_level("WARNING", logger="bps_gossip"):
            combined = combine_windows(np.array([*honest, window(lie)]))
        assert combined[0] == pytest.approx(0.055), combined
        assert "ranks [3] reported values that are not finite or out of range" in caplog.text
        caplog.clear()


def test_the_loss_is_known_only_if_every_usable_rank_gave_it():
    from mxnet_plugin.modes.auto import combine_windows

    assert combine_windows(np.array([window(0.05), window(0.05)]))[6] == 1.0
    assert combine_windows(np.array([window(0.05), window(0.05, loss=0.0, known=0.0)]))[6] == 0.0


def test_no_usable_row_is_no_decision():
    from mxnet_plugin.modes.auto import combine_windows

    assert combine_windows(np.array([window(-1.0), window(np.nan)])) is None
