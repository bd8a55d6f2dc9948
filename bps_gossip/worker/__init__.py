"""The worker side of bps_gossip: the engine thread (:mod:`.engine`) and the parts it routes
between: the scheduler link, the server links (partitions, credit, replies; small pushes sent
from the caller's thread), the host link and host rounds (reducing by host), and the peer
endpoint (gossip). Tensor checks and operations are shared by the API in bps_gossip.collectives.
"""
