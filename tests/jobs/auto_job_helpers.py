"""What the mode='auto' jobs share (tests/jobs/auto_mode_job.py, auto_averaging_job.py,
auto_plateau_job.py): a digest of a net's trained parameters and a model_zoo CNN to train."""

from __future__ import annotations

import hashlib

import mxnet as mx
import numpy as np
from mxnet.gluon.model_zoo import vision


def digest(net):
    """sha1 of the trained parameters' values, in name order (BatchNorm's running statistics,
    each rank's own, left out)."""
    params = [p.data().asnumpy() for p in sorted(net.collect_params().values(), key=lambda p: p.name)
              if p.grad_req != "null"]
    return hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() for a in params)).hexdigest()


def zoo_model(name, rank, hybridize):
    """model_zoo's ``name`` for 10 classes, Xavier-initialized from seed ``rank``."""
    mx.random.seed(rank)
    net = vision.get_model(name, classes=10)
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    return net


def batch(rng, size):
    """A random batch of ``size`` 32x32 images and labels."""
    x = mx.nd.array(rng.uniform(size=(size, 3, 32, 32)))
    y = mx.nd.array(rng.randint(0, 10, size=size))
    return x, y
