"""Programs that fail, or look around, before bps_gossip is part of them: slots that crash or
fail at start-up under an elastic bpslaunch (tests/clusters/test_launcher_elastic.py), a Gluon
script without ``import mxnet_plugin`` (test_launch_failures.py), and the start-up hook that
lets MXNet import under a new numpy (tests/unit/test_startup_hook.py).

Nothing of bps_gossip, numpy or mxnet is imported at the top: each scenario imports what it
uses at the point a user's script would, since what is imported when is what these tests see.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
import time
import types

from job_tools import run


def crash_once_then(script: str) -> None:
    """Slot 1's first process dies by SIGKILL before the rendezvous (CRASH_MARKER marks that it
    did); every other process runs ``script`` as its main program."""
    marker = pathlib.Path(os.environ["CRASH_MARKER"])
    if os.environ["BYTEPS_LOCAL_RANK"] == "1" and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), 9)  # before the rendezvous: the replacement takes over the slot
    runpy.run_path(script, run_name="__main__")


def slot_one_exits() -> None:
    """Every process of slot 1 exits with code 3 at once; slot 0 joins the job and sleeps."""
    if os.environ["BYTEPS_LOCAL_RANK"] == "1":
        sys.exit(3)
    import bps_gossip as bps

    bps.init()
    time.sleep(1000)


def slot_one_fails_differently() -> None:
    """Every process of slot 1 exits at once, each with another code (3, 4, ...: the count of
    files in FAILED_DIR, where each leaves one); slot 0 sleeps (a rendezvous would wait for slot 1)."""
    if os.environ["BYTEPS_LOCAL_RANK"] == "1":
        failed = pathlib.Path(os.environ["FAILED_DIR"])
        count = len(list(failed.iterdir()))
        (failed / str(os.getpid())).touch()
        sys.exit(3 + count)
    time.sleep(60)


def gluon_without_plugin() -> None:
    """A Gluon step with kvstore='bpsgossip' but no ``import mxnet_plugin``: MXNet drops the
    kvstore it does not know and the rank trains alone."""
    import mxnet as mx
    from mxnet import autograd, gluon

    net = gluon.nn.Dense(1)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="bpsgossip")
    with autograd.record():
        loss = net(mx.nd.ones((4, 3))).sum()
    loss.backward()
    trainer.step(4)
    print("stepped", flush=True)


def hook_waits_for_mxnet() -> None:
    """Whether the hook's finder is on sys.meta_path: at start, after another first import, after
    importing mxnet (three lines, True or False)."""
    def names() -> list[str]:
        return [getattr(m, "__name__", "") for m in sys.meta_path]

    print("BeforeMXNet" in names())
    assert "colorsys" not in sys.modules  # a first import, as json's was in a bare script
    import colorsys  # noqa: F401

    print("BeforeMXNet" in names())
    import mxnet  # noqa: F401

    print("BeforeMXNet" in names())


def hook_restores_aliases(version: str) -> None:
    """The hook under a fake numpy of ``version``: ``added,names|numpy.bool after``."""
    fake = types.ModuleType("numpy")
    fake.__version__ = version
    if fake.__version__.startswith("2"):
        fake.bool = "numpy.bool"
    sys.modules["numpy"] = fake
    import bps_gossip_numpy_aliases as hook

    added = hook.restore_numpy_aliases()
    assert all(getattr(fake, name) is hook.ALIASES[name] for name in added)
    print(",".join(added) + "|" + str(fake.__dict__.get("bool")))


if __name__ == "__main__":
    run({"crash_once_then": crash_once_then, "slot_one_exits": slot_one_exits,
         "slot_one_fails_differently": slot_one_fails_differently, "gluon_without_plugin": gluon_without_plugin,
         "hook_waits_for_mxnet": hook_waits_for_mxnet, "hook_restores_aliases": hook_restores_aliases})
