"""The summation server.

One ROUTER socket receives pushes from every worker; the I/O thread acknowledges each large
push at once (the worker's credit), checks it against its round, and sums it: on the I/O
thread itself for small partitions (no hop to another thread and back), on a thread pool
(BYTEPS_SERVER_ENGINE_THREAD) for large ones. When all workers of the generation have pushed,
each gets the sum back.

- :mod:`.node`: the process: sockets, registration (:mod:`bps_gossip.rendezvous`), the loop,
  the scheduler's notices.
- :mod:`.rounds`: which pushes belong together, checks, results and failures (no sockets).
- :mod:`.pool`: the summation threads.

Run it with ``DMLC_ROLE=server bpslaunch`` or ``python -m bps_gossip.server``.
"""

from __future__ import annotations

from .node import Server, main

__all__ = ["Server", "main"]
