"""bpslaunch: start the processes of a job (``python -m bps_gossip.launch`` is ``bpslaunch``).

One module per part: :mod:`.cli` (the command line and the choice of backend),
:mod:`.backend` (what a backend is, and how to add one), the backends :mod:`.local` (``-np``),
:mod:`.ssh` (``-H``), :mod:`.batch` (a task of srun or mpirun) and :mod:`.byteps` (DMLC_ROLE),
:mod:`.elastic` (restarting failed workers, ``--join``), :mod:`.supervisor` (the children:
output, exit codes, stopping), :mod:`.hosts` (``-H`` and ``--hostfile``) and :mod:`.remote`
(what ssh runs on every host: ``python -m bps_gossip.launch.remote``).
"""

from __future__ import annotations
