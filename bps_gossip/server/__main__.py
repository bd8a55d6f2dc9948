"""``python -m bps_gossip.server``: run one server from the environment."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
