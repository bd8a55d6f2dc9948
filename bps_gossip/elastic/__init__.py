"""Elastic training: keep going when workers die or join (Horovod Elastic's user model).

Wrap the training function with :func:`run`, keep everything that must survive a
change in a :class:`State` (``ObjectState`` for plain Python values; ``mxnet_plugin.
elastic.GluonState`` for a network and its trainer), and call ``state.commit()``
every few steps. A crash rolls every rank back to the last commit; a join or a
graceful leave goes on from where the job is. See docs/elastic.md.
"""

from .run import run
from .sampler import ElasticSampler
from .state import ObjectState, State, broadcast_object

__all__ = ["ElasticSampler", "ObjectState", "State", "broadcast_object", "run"]
