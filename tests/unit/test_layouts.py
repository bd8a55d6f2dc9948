"""mxnet_plugin.layouts.IdleViews: views of parameters' memory kept between steps.

In one process, no cluster: a kept view must always be the array's memory now, also after
an inference forward put a convolution weight into a oneDNN layout, and a slot that holds
another array must not hand out the old one's view. Views are of idle arrays: every test waits
for MXNet's engine first, as the gossip trainer does.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from mxnet_plugin.layouts import IdleViews  # noqa: E402


@pytest.mark.timeout(60)
def test_a_kept_view_reads_and_writes_the_array():
    views = IdleViews()
    array = mx.nd.arange(12).reshape((3, 4))
    mx.nd.waitall()
    view = views.flat("a", array)
    assert view.shape == (12,) and np.array_equal(view, np.arange(12))
    assert views.flat("a", array) is view  # kept: the same array at the same address
    view[:] = 5
    assert np.all(array.asnumpy() == 5)


@pytest.mark.timeout(60)
def test_a_slot_given_another_array_views_that_one():
    views = IdleViews()
    first, second = mx.nd.ones((4,)), mx.nd.zeros((6,))
    mx.nd.waitall()
    views.flat("p", first)
    view = views.flat("p", second)
    assert view.shape == (6,) and np.all(view == 0)
    view[:] = 3
    assert np.all(second.asnumpy() == 3) and np.all(first.asnumpy() == 1)
    assert views.flat("empty", mx.nd.empty((0,))).size == 0


@pytest.mark.timeout(60)
def test_a_weight_an_inference_forward_reordered_is_viewed_in_the_default_layout():
    conv = mx.gluon.nn.Conv2D(16, 3, in_channels=8)
    conv.initialize(mx.init.Xavier())
    weight = conv.weight.data()
    expected = weight.asnumpy().reshape(-1)
    views = IdleViews()
    views.flat("w", weight)
    conv(mx.nd.ones((2, 8, 16, 16))).wait_to_read()  # inference: oneDNN may block the weight's layout
    mx.nd.waitall()
    view = views.flat("w", weight)
    assert np.array_equal(view, expected)
    view[:] = 0.5  # the memory the next forward reads
    assert np.all(weight.asnumpy() == 0.5)
    assert np.allclose(conv(mx.nd.ones((1, 8, 3, 3))).asnumpy(), 0.5 * 8 * 9 + conv.bias.data().asnumpy())
