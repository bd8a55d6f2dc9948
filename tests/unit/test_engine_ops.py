"""mxnet_plugin.engine_ops: work queued in MXNet's engine through MXEnginePushAsyncND.

In one process, no cluster: the work runs after earlier writes to its arrays, later readers
wait until ``done()`` is called (from another thread, as the core's engine thread does), work
that raises still releases the engine (a wait raises its error instead of hanging), and an error
given to ``done`` fails the next wait on the arrays written and on what is computed from them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from mxnet_plugin.engine_ops import push_async  # noqa: E402
from mxnet_plugin.layouts import raw_view  # noqa: E402


@pytest.mark.timeout(60)
def test_work_runs_after_writes_and_readers_wait_for_done():
    array = mx.nd.zeros((1000,))
    array += 1  # a pending write the work must see
    seen = []
    release = threading.Event()

    def work(done):
        view = raw_view(array, "test")
        seen.append(float(view[0]))

        def later():
            release.wait(10)
            view[:] = 7  # the engine still grants access: done() was not called yet
            done()

        threading.Thread(target=later).start()

    push_async(work, [], [array], "test")
    result = array * 2  # queued behind the work
    release.set()
    assert np.all(result.asnumpy() == 14)
    assert seen == [1.0]


@pytest.mark.timeout(60)
def test_operations_on_one_array_run_in_order_and_done_is_called_once():
    array = mx.nd.zeros((4,))
    order = []

    def make(step):
        def work(done):
            raw_view(array, "order")[:] += 1
            order.append(step)
            done()
            done()  # a second call is ignored
        return work

    for step in range(20):
        push_async(make(step), [], [array], "order", priority=step)
    assert np.all(array.asnumpy() == 20)
    assert order == list(range(20))


@pytest.mark.timeout(60)
def test_work_that_raises_still_releases_the_engine():
    array = mx.nd.ones((3,))

    def work(done):
        raise RuntimeError("boom")

    push_async(work, [], [array], "raises")
    with pytest.raises(mx.base.MXNetError, match="RuntimeError: boom"):  # completed for it, with its error
        (array + 1).asnumpy()
    mx.nd.waitall()
    assert np.all((array + 1).asnumpy() == 2)  # the error was raised once; the array reads again


@pytest.mark.timeout(60)
def test_an_error_given_to_done_fails_the_next_read_of_everything_computed_from_it():
    """Issue 33, item 1: a failed push_pull must fail the next read of its arrays (MXNet keeps the
    error on the arrays the operation writes and passes it on to what is computed from them)."""
    array, untouched = mx.nd.ones((4,)), mx.nd.ones((4,))

    def work(done):
        threading.Thread(target=done, args=(ConnectionError("rank 0 left"),)).start()

    push_async(work, [], [array], "fails")
    downstream = array * 2 + 1
    assert np.all(untouched.asnumpy() == 1)  # arrays that do not depend on it read as usual
    with pytest.raises(mx.base.MXNetError, match="ConnectionError: rank 0 left"):
        downstream.asnumpy()
    push_async(lambda done: threading.Thread(target=done, args=(RuntimeError("again"),)).start(), [], [array], "x")
    with pytest.raises(mx.base.MXNetError, match="RuntimeError: again"):
        mx.nd.waitall()  # as for MXNet's own failed operators
    assert np.all(array.asnumpy() == 1)


@pytest.mark.timeout(60)
def test_reads_are_not_written_and_wait_for_their_writers():
    source = mx.nd.zeros((8,))
    source += 3
    target = mx.nd.zeros((8,))

    def work(done):
        raw_view(target, "copy")[:] = raw_view(source, "copy")
        done()

    push_async(work, [source], [target], "copy")
    assert np.all(target.asnumpy() == 3)
