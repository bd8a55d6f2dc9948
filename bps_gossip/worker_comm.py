"""The worker API as the default link of the gossip core and comm of the elastic core.

bps_gossip.gossip and bps_gossip.elastic never import the worker API (bps_gossip.api):
they are handed a :class:`~bps_gossip.gossip.link.Link` or an
:class:`~bps_gossip.elastic.comm.Comm`, or take the default that :func:`register` (called
when bps_gossip is imported) installs here: the initialized worker's
:class:`~bps_gossip.worker.peer_link.PeerLink`, and the ``api`` module itself, whose
functions are exactly the Comm protocol.
"""

from __future__ import annotations

from . import api
from .elastic.comm import set_default_comm_provider
from .gossip.link import set_default_link_provider


def register() -> None:
    """Make the worker's link and comm the defaults of bps_gossip.gossip and bps_gossip.elastic."""
    set_default_link_provider(api.peer_link)
    set_default_comm_provider(lambda: api)
