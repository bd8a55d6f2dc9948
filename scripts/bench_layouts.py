"""What handling oneDNN layouts costs per step (mxnet_plugin/layouts.py), on resnet18_v1 at 32x32.

    OMP_NUM_THREADS=1 python scripts/bench_layouts.py

Prints the cost of make_default() and of the non-blocking probe per array when the layout
is already the default (the common path: every gradient of an allreduce step), the reorder
of the weights an inference forward left in oneDNN layouts, and one training
forward+backward for scale. One process, no cluster.
"""

from __future__ import annotations

import time

import mxnet as mx
from mxnet.gluon.model_zoo import vision

from mxnet_plugin.layouts import holds_onednn_layout, make_default


def per_array_us(arrays: list, fn, repeats: int = 200) -> float:
    """Microseconds per call of ``fn`` on each of ``arrays``."""
    start = time.perf_counter()
    for _ in range(repeats):
        for array in arrays:
            fn(array)
    return (time.perf_counter() - start) / repeats / len(arrays) * 1e6


def main() -> None:
    """Measure and print."""
    net = vision.resnet18_v1(classes=10)
    net.initialize()
    net.hybridize()
    x = mx.nd.random.uniform(shape=(2, 3, 32, 32))
    with mx.autograd.record():
        loss = net(x)
    loss.backward()
    mx.nd.waitall()
    params = list(net.collect_params().values())
    grads = [p.grad() for p in params if p.grad_req != "null"]
    arrays = [p.data() for p in params] + grads
    default_us = per_array_us(arrays, make_default)
    probe_us = per_array_us(arrays, holds_onednn_layout)
    print(f"{len(arrays)} arrays in the default layout: make_default {default_us:.2f} us, probe {probe_us:.2f} us each")
    print(f"per allreduce step ({len(grads)} gradients: make_default + 2 probes): "
          f"{len(grads) * (default_us + 2 * probe_us) / 1e3:.3f} ms")
    net(x).wait_to_read()  # inference: convolution weights now hold oneDNN layouts
    weights = [p.data() for p in params if holds_onednn_layout(p.data())]
    start = time.perf_counter()
    for weight in weights:
        make_default(weight)
    megabytes = sum(w.size for w in weights) * 4 / 1e6
    print(f"reorder of {len(weights)} oneDNN weights ({megabytes:.1f} MB) after an inference forward: "
          f"{(time.perf_counter() - start) * 1e3:.2f} ms")
    start = time.perf_counter()
    with mx.autograd.record():
        loss = net(x)
    loss.backward()
    mx.nd.waitall()
    print(f"one training forward+backward (batch 2): {(time.perf_counter() - start) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
