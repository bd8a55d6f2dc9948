"""Where a worker's threads run (tests/clusters/test_placement.py): the CPUs of its main thread
(inherited by OpenMP's), of the engine and ZeroMQ's threads, and of its job's scheduler and server.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading

from job_tools import report, run

import bps_gossip as bps


def engine_cpus() -> list[int]:
    """The CPUs the engine thread may run on."""
    engine = next(t for t in threading.enumerate() if t.name == "bps-gossip-engine")
    return sorted(os.sched_getaffinity(engine.native_id))


def zmq_cpus() -> list[int]:
    """The CPUs of ZeroMQ's background threads, together."""
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            if comm.read().startswith("ZMQbg"):
                cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


def service_cpus() -> dict[str, list[int]]:
    """{role: CPUs} of this job's scheduler and server (same DMLC_PS_ROOT_PORT), alive until shutdown."""
    services = {}
    port = os.environ["DMLC_PS_ROOT_PORT"].encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                env = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
            if env.get(b"DMLC_PS_ROOT_PORT") == port and env.get(b"DMLC_ROLE") in (b"server", b"scheduler"):
                services[env[b"DMLC_ROLE"].decode()] = sorted(os.sched_getaffinity(int(pid)))
        except OSError:
            pass
    return services


def probe() -> None:
    """Under bpslaunch: one ``PROBE {json}`` line (the launcher's prefix before it) with every
    placement this worker sees, and the thread counts it was given."""
    bps.init()
    print("PROBE " + json.dumps({"local_rank": bps.local_rank(), "main": sorted(os.sched_getaffinity(0)),
          "engine": engine_cpus(), "zmq": zmq_cpus(), "services": service_cpus(),
          "omp": os.environ.get("OMP_NUM_THREADS"), "mxnet": os.environ.get("MXNET_CPU_WORKER_NTHREADS")}), flush=True)
    bps.barrier()
    bps.shutdown()


def place_myself() -> None:
    """A worker started without bpslaunch plans in bps.init(); worker 1 loads an OpenMP runtime
    first, as importing mxnet does. Reports its CPUs and OMP_NUM_THREADS."""
    if os.environ["DMLC_WORKER_ID"] == "1":
        ctypes.CDLL("libgomp.so.1")  # as importing mxnet does
    bps.init()
    report({"local_rank": bps.local_rank(), "main": sorted(os.sched_getaffinity(0)), "engine": engine_cpus(),
            "omp": os.environ.get("OMP_NUM_THREADS")})
    bps.barrier()
    bps.shutdown()


if __name__ == "__main__":
    run({"probe": probe, "place_myself": place_myself})
