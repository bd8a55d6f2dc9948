"""``python -m bps_gossip.launch`` is ``bpslaunch`` with this interpreter."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
