"""The scheduler: rendezvous, ranks, address book, barriers, heartbeats.

It binds DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT with one ROUTER socket (every interface with
DMLC_USE_KUBERNETES=1). Every server and worker registers; when all are in, each gets the
address book and its rank. Nodes that stop heart-beating are declared lost, and every
other node is told at once so that nobody waits for the dead. Once every worker has left
or died, the scheduler tells the servers to terminate and exits (BytePS issue #264: its
scheduler never did).

Elastic jobs (BPS_GOSSIP_ELASTIC=1) change membership instead of failing: a lost
worker or server, a graceful leave, or (at the next commit check) workers waiting to
join open a new generation. Every member is told ``changed`` at once (pending work
of the old generation fails, recoverably); the workers answer ``rejoin``; once all
have, the new address book goes out with one ``restore`` flag for everybody (true if
anything crashed since the last book). A job below BPS_GOSSIP_MIN_WORKERS for longer
than BPS_GOSSIP_ELASTIC_TIMEOUT fails with a message to every worker.

- :mod:`.node`: the process: its socket and handler table, registration, barriers and commit
  checks, losses and the end of the job.
- :mod:`.changes`: elastic generations.
- :mod:`.liveness`: which nodes are gone.

Run it with ``DMLC_ROLE=scheduler bpslaunch`` or ``python -m bps_gossip.scheduler``.
"""

from __future__ import annotations

from ..transport.sockets import MAX_CONTROL_BYTES
from .changes import Change
from .node import Scheduler, bind_host, main

__all__ = ["MAX_CONTROL_BYTES", "Change", "Scheduler", "bind_host", "main"]
