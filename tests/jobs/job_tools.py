"""What every job script of the cluster tests shares: reporting a result, running one scenario.

A job module (tests/jobs/<topic>_job.py) holds one function per scenario and ends with
``run(SCENARIOS)``; a test starts it on every worker with ``cluster.run_job("<topic>_job",
"<scenario>", *args)`` and reads what each rank reported (``Finished.result``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable


def report(value: Any) -> None:
    """Print one JSON result line for the test to read."""
    print("RESULT " + json.dumps(value), flush=True)


def run(scenarios: dict[str, Callable[..., None]]) -> None:
    """Run the scenario that ``sys.argv[1]`` names, with the rest of the arguments (strings)."""
    if len(sys.argv) < 2 or sys.argv[1] not in scenarios:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(scenarios)}}} [ARG...]")
    scenarios[sys.argv[1]](*sys.argv[2:])
