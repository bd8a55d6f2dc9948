"""Tensor fusion's bucket plan (mxnet_plugin/fusion.py), in process: every rank must plan alike."""

from __future__ import annotations

import mxnet as mx
import pytest

from mxnet_plugin import fusion


def params(shapes: list[tuple[int, ...]], dtypes: list[str] | None = None) -> list[tuple[int, mx.gluon.Parameter]]:
    made = []
    for index, shape in enumerate(shapes):
        param = mx.gluon.Parameter(f"p{index}", shape=shape, dtype=(dtypes or ["float32"] * len(shapes))[index])
        param.initialize(ctx=mx.cpu())
        made.append((index, param))
    return made


def test_small_gradients_share_buckets_large_ones_go_alone():
    ready = params([(10,), (20, 3), (1 << 17,), (5,)])  # 512 KiB > SMALL_BYTES
    buckets, alone = fusion.plan_buckets(ready)
    assert [[p.name for _, p in b] for b in buckets] == [["p0", "p1", "p3"]]
    assert [p.name for _, p in alone] == ["p2"]
    assert fusion.bucket_name(buckets[0]) == "fused_gradient_p0_3"
    assert fusion.bucket_layout(buckets[0]) == "fused [p0(10,), p1(20, 3), p3(5,)]"


def test_buckets_are_cut_by_size_and_dtype():
    count = fusion.BUCKET_BYTES // (200 * 1024) + 2  # 200 KiB gradients: more than one bucket's worth
    ready = params([(50 * 1024,)] * count + [(4,), (4,)], ["float32"] * count + ["float16", "float32"])
    buckets, alone = fusion.plan_buckets(ready)
    assert not alone
    sizes = [len(b) for b in buckets]
    assert sum(sizes) == count + 2 and len(buckets) == 4
    assert all(len({p.dtype for _, p in b}) == 1 for b in buckets)


def test_untrained_parameters_are_left_out_and_long_layouts_become_a_digest():
    ready = params([(3,)] * 60)
    ready[0][1].grad_req = "null"
    buckets, _ = fusion.plan_buckets(ready)
    assert "p0" not in {p.name for b in buckets for _, p in b}
    layout = fusion.bucket_layout(buckets[0])
    assert layout.startswith("fused 59 gradients, layout ") and len(layout) < 80


@pytest.mark.parametrize("devices", [1, 2])
def test_plan_does_not_depend_on_devices(devices):
    ctx = [mx.cpu(i) for i in range(devices)]
    made = []
    for index, shape in enumerate([(10,), (1 << 17,), (7, 7)]):
        param = mx.gluon.Parameter(f"q{index}", shape=shape)
        param.initialize(ctx=ctx)
        made.append((index, param))
    buckets, alone = fusion.plan_buckets(made)
    assert [[p.name for _, p in b] for b in buckets] == [["q0", "q2"]] and [p.name for _, p in alone] == ["q1"]
