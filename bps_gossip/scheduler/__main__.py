"""``python -m bps_gossip.scheduler``: run the scheduler from the environment."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
