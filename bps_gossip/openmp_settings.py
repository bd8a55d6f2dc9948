"""OpenMP's settings for a worker (what :mod:`bps_gossip.placement` plans with): the user's thread
counts, read as MXNet reads them, and how idle OpenMP threads wait (docs/placement.md)."""

from __future__ import annotations

from collections.abc import Mapping

THREAD_VARS = ("OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS")
__all__ = ["TEAM_SPIN_COUNT", "THREAD_VARS", "user_threads", "wait_policy"]


def user_threads(env: Mapping[str, str]) -> tuple[int | None, int, list[str]]:
    """The user's OMP_NUM_THREADS (None: unset) and MXNET_CPU_WORKER_NTHREADS (1: unset), and notes."""
    notes, values = [], []
    for name in THREAD_VARS:
        raw = (env.get(name) or "").strip()
        first = raw.split(",")[0].strip()  # OMP_NUM_THREADS may list nested levels: 8,2
        values.append(int(first) if first.isdecimal() and int(first) > 0 else None)
        if raw:
            notes.append(f"the user's {name}={raw} kept" + ("" if values[-1] else " (not a positive number: "
                                                                                 "planned as if unset)"))
    return values[0], values[1] or 1, notes


# libgomp (MXNet's wheel links the system's) lets an idle OpenMP thread spin GOMP_SPINCOUNT times,
# then sleep: 300000 by default, forever under ACTIVE (which let idle processes beside a worker take
# its cores). Ten million (a few ms) keeps a team awake between MXNet's small parallel regions.
TEAM_SPIN_COUNT = "10000000"


def wait_policy(env: Mapping[str, str], threads: int, workers: int, cores: int, notes: list[str]) -> dict[str, str]:
    """PASSIVE where the workers' OpenMP threads outnumber the cores (idle ones sleep at once, not
    spin on a core another team needs); a longer spin where each team has its cores (one worker
    x 2 threads on 2 cores: 1.1-1.5x, docs/placement.md). The user's own settings win."""
    mine = [name for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if (env.get(name) or "").strip()]
    if mine:
        notes.extend(f"the user's {name}={env[name].strip()} kept" for name in mine)
        return {}
    if threads < 2:
        return {}
    if workers * threads > cores:
        notes.append(f"{workers} x {threads} OpenMP threads on {cores} core(s): idle ones sleep (OMP_WAIT_POLICY=PASSIVE)")
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    notes.append(f"{workers} x {threads} OpenMP threads on {cores} core(s): each team has its cores, so idle threads "
                 f"spin a few ms before sleeping (GOMP_SPINCOUNT={TEAM_SPIN_COUNT}; your own setting wins)")
    return {"GOMP_SPINCOUNT": TEAM_SPIN_COUNT}
