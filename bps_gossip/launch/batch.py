"""The batch backend: one task of ``srun -n N bpslaunch ...`` or ``mpirun -np N bpslaunch ...``,
placed in the job by the environment Slurm or the MPI launcher gives it (issue 14).

The layout is pure functions from a ``Mapping[str, str]`` to the processes this task must run
(:func:`layout`, :func:`plan`); :class:`BatchBackend` starts them.

Every task runs one worker (the user's command). A *node* (one host of the step) is one
BytePS "worker machine": ``DMLC_WORKER_ID`` = the node's index, ``BYTEPS_LOCAL_RANK`` /
``BYTEPS_LOCAL_SIZE`` = the task's index and count on its node, ``DMLC_NUM_WORKER`` = the
number of nodes. The first task of each node (local rank 0) also runs one server
(``DMLC_NUM_SERVER`` = the number of nodes, BytePS's advice of one per host), and task 0
runs the scheduler as well. Variables the user set (DMLC_*) win over derived ones; a set
``DMLC_NUM_WORKER`` or ``DMLC_WORKER_ID`` that contradicts the launcher's layout is an error.

Sources, in this order (the innermost launcher wins: mpirun inside a Slurm job is MPI):

- Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; the port from
  OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE.
- MPICH / Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
- Slurm (a task of an srun step): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
  SLURM_STEP_ID, SLURM_JOB_ID, SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST / SLURM_NODELIST),
  SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE). A batch script itself (no
  SLURM_STEP_ID) is not a task: ``srun bpslaunch ...`` is.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import zlib
from collections.abc import Mapping

from ..config import NO_SECRET_NOTED_VAR, load_config
from ..errors import ConfigError
from ..transport.addresses import launcher_node_host
from .backend import Backend, Process, check_command, note

# Derived scheduler ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's ephemeral
# range (32768-60999), so that no outgoing connection holds the port by chance.
PORT_BASE = 20000
PORT_SPAN = 12768
SLURM_STEPS_PER_JOB = 8  # steps 0..7 of a job get distinct ports (see slurm_port)
_SLURM_MAX_NORMAL_STEP = 0xFFFFFFF0  # larger step ids are Slurm's batch, extern and interactive steps
MAX_HOSTS = 100000
_HOST_CHARS = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the cluster manager says about this task and the step it belongs to."""

    manager: str  # "slurm", "openmpi" or "mpich"
    rank: int  # the task's index in the step (SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMI_RANK)
    size: int  # tasks in the step
    local_rank: int  # the task's index on its node
    local_size: int  # tasks on this node
    node_index: int | None  # this node's index (None: unknown, the user must set DMLC_WORKER_ID)
    num_nodes: int | None  # nodes of the step (None: unknown, the user must set DMLC_NUM_WORKER)
    node_offset: int | None  # the step-wide index of this node's first task, when known
    root_uri: str | None  # the first node's address (None: unknown, DMLC_PS_ROOT_URI needed)
    node_host: str | None  # this node's address for the others (None: bps_gossip's default)
    host_label: str | None  # the node's name for output prefixes
    root_port: int | None  # derived from the job's id (None: DMLC_PS_ROOT_PORT needed)
    port_source: str  # how root_port was derived, for messages


# -- Slurm's notations ---------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """Split ``text`` on the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"host list {text!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise ConfigError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _range_values(body: str, text: str) -> list[str]:
    """The numbers of one bracket, ``01-03,7`` -> 01 02 03 7 (zero padding kept)."""
    values = []
    for item in body.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or dash and not high.isdigit():
            raise ConfigError(f"host list {text!r}: [{body}] is not a list of numbers and ranges")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"host list {text!r}: range {item} goes down")
        if int(high) - int(low) >= MAX_HOSTS:
            raise ConfigError(f"host list {text!r}: range {item} has more than {MAX_HOSTS} hosts")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _expand(item: str, text: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if not _HOST_CHARS.match(item):
            raise ConfigError(f"host list {text!r}: {item!r} is not a host name")
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    tails = _expand(rest, text) if rest else [""]
    if prefix and not _HOST_CHARS.match(prefix):
        raise ConfigError(f"host list {text!r}: {prefix!r} is not part of a host name")
    hosts = [prefix + value + tail for value in _range_values(body, text) for tail in tails]
    if len(hosts) > MAX_HOSTS:
        raise ConfigError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
    return hosts


def parse_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-03,7],gpu5`` -> node01 node02 node03 node7 gpu5;
    ``a-[1-2]-x`` -> a-1-x a-2-x; several brackets in one name give every combination
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), as ``scontrol show hostnames`` does."""
    text = text.strip()
    if not text:
        raise ConfigError("the host list is empty")
    hosts: list[str] = []
    for item in _split_top(text):
        if not item.strip():
            raise ConfigError(f"host list {text!r}: an empty name between commas")
        hosts.extend(_expand(item.strip(), text))
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's tasks per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.match(r"^\s*(\d+)\s*(?:\(x(\d+)\))?\s*$", item)
        if not match or int(match.group(1)) < 1 or match.group(2) is not None and int(match.group(2)) < 1:
            raise ConfigError(f"tasks per node {text!r}: {item!r} is not N or N(xM)")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise ConfigError(f"tasks per node {text!r} names more than {MAX_HOSTS} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return counts


def slurm_port(job_id: int, step_id: int) -> int:
    """The scheduler's port of one srun step: ``20000 + (8 * job_id + step_id % 8) % 12768``.
    Steps 0-7 of a job, and the steps of 1,596 consecutive jobs, never share a port."""
    return PORT_BASE + (SLURM_STEPS_PER_JOB * job_id + step_id % SLURM_STEPS_PER_JOB) % PORT_SPAN


def text_port(job_id: str) -> int:
    """The scheduler's port for an MPI job id (text): ``20000 + crc32(id) % 12768``."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


# -- reading the launchers' variables -------------------------------------------------------
def _int(env: Mapping[str, str], *names: str, minimum: int = 0) -> int | None:
    """The first of ``names`` that is set, as an integer >= ``minimum`` (None if none is set)."""
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
            if value < minimum:
                raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
            return value
    return None


def _need(env: Mapping[str, str], *names: str, minimum: int = 0) -> int:
    value = _int(env, *names, minimum=minimum)
    if value is None:
        raise ConfigError(f"{' or '.join(names)} is not set (the launcher should set it for every task)")
    return value


def _below(name: str, value: int, limit_name: str, limit: int) -> None:
    if value >= limit:
        raise ConfigError(f"{name}={value} must be smaller than {limit_name}={limit}")


def detect(env: Mapping[str, str]) -> str | None:
    """Which launcher started this process: "openmpi", "mpich", "slurm" (a task of an srun
    step), or None."""
    if env.get("OMPI_COMM_WORLD_RANK"):
        return "openmpi"
    if env.get("PMI_RANK") and env.get("MPI_LOCALRANKID"):
        return "mpich"
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if env.get("SLURM_PROCID") and step and (not step.isdigit() or int(step) < _SLURM_MAX_NORMAL_STEP):
        return "slurm"
    return None


def slurm_layout(env: Mapping[str, str]) -> Layout:
    """The layout of one task of an srun step."""
    rank = _need(env, "SLURM_PROCID")
    size = _need(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    local_rank = _need(env, "SLURM_LOCALID")
    node_index = _need(env, "SLURM_NODEID")
    job_id = _need(env, "SLURM_JOB_ID", "SLURM_JOBID")
    step_id = _need(env, "SLURM_STEP_ID", "SLURM_STEPID")
    list_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    tasks_name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), None)
    if list_name is None or tasks_name is None:
        raise ConfigError("SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE (or SLURM_NODELIST and "
                          "SLURM_TASKS_PER_NODE) must be set in a Slurm task")
    nodes = parse_hostlist(env[list_name])
    per_node = parse_tasks_per_node(env[tasks_name])
    if len(per_node) != len(nodes):
        raise ConfigError(f"{tasks_name}={env[tasks_name]!r} gives {len(per_node)} node(s) but "
                          f"{list_name}={env[list_name]!r} names {len(nodes)}")
    if sum(per_node) != size:
        raise ConfigError(f"{tasks_name}={env[tasks_name]!r} adds up to {sum(per_node)} tasks, not {size}")
    _below("SLURM_PROCID", rank, "the number of tasks", size)
    _below("SLURM_NODEID", node_index, "the number of nodes", len(nodes))
    _below("SLURM_LOCALID", local_rank, f"the tasks on node {nodes[node_index]}", per_node[node_index])
    name = env.get("SLURMD_NODENAME") or nodes[node_index]
    one_node = len(nodes) == 1  # everything on this host: loopback, as bpslaunch -np does
    return Layout("slurm", rank, size, local_rank, per_node[node_index], node_index, len(nodes),
                  sum(per_node[:node_index]), "127.0.0.1" if one_node else nodes[0],
                  "127.0.0.1" if one_node else name, name, slurm_port(job_id, step_id),
                  f"from SLURM_JOB_ID={job_id} and SLURM_STEP_ID={step_id}")


def mpi_layout(env: Mapping[str, str], manager: str) -> Layout:
    """The layout of one rank started by Open MPI's or MPICH's mpirun. MPI gives no host list:
    one host (local size == size) runs on 127.0.0.1; else DMLC_PS_ROOT_URI must name rank 0's
    host. Nodes are blocks of ``local_size`` consecutive ranks (mpirun's default, --map-by slot)."""
    if manager == "openmpi":
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    rank, size = _need(env, names[0]), _need(env, names[1], minimum=1)
    local_rank, local_size = _need(env, names[2]), _need(env, names[3], minimum=1)
    _below(names[0], rank, names[1], size)
    _below(names[2], local_rank, names[3], local_size)
    if local_size > size:
        raise ConfigError(f"{names[3]}={local_size} is larger than {names[1]}={size}")
    # OMPI_COMM_WORLD_NODE_RANK is not the node's index (it counts the processes on the node),
    # so the index comes from the blocks: valid when every node runs local_size consecutive ranks.
    blocks = size % local_size == 0 and rank % local_size == local_rank
    node_index = rank // local_size if blocks else None
    job_id = (env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "").strip()
    one_host = local_size == size
    return Layout(manager, rank, size, local_rank, local_size, node_index,
                  size // local_size if blocks else None, rank - local_rank if blocks else None,
                  "127.0.0.1" if one_host else None, "127.0.0.1" if one_host else None, None,
                  text_port(job_id) if job_id else None,
                  f"from the MPI job id {job_id}" if job_id else "")


def layout(env: Mapping[str, str]) -> Layout | None:
    """This task's layout, or None when no launcher's task environment is present."""
    manager = detect(env)
    if manager is None:
        return None
    return slurm_layout(env) if manager == "slurm" else mpi_layout(env, manager)


# -- the processes of this task -------------------------------------------------------------
def _user_int(env: Mapping[str, str], name: str, derived: int | None, why: str, fix: str) -> int:
    """A DMLC_* count or index: the user's value if set (it must agree with ``derived``), else
    ``derived``; neither is an error that says how to fix it."""
    value = _int(env, name)
    if value is not None:
        if derived is not None and value != derived:
            raise ConfigError(f"{name}={value} contradicts the launcher's layout ({why}: {derived}); "
                              f"unset {name}")
        return value
    if derived is None:
        raise ConfigError(f"{name} cannot be derived: {fix}")
    return derived


def _passing(manager: str, name: str, value: str) -> str:
    """How ``manager``'s launcher gives every task a variable, for error messages."""
    if manager == "openmpi":
        return f"-x {name}={value}"
    if manager == "mpich":
        return f"-genv {name} {value}"
    return f"--export=ALL,{name}={value}"


def plan(env: Mapping[str, str], place: Layout, hostname: str = "localhost") -> list[Process]:
    """The processes this task runs: its worker, plus a server on each node's first task and the
    scheduler on task 0. ``env`` is the task's whole environment; ``hostname`` names this host in
    output prefixes when the launcher gives no node name."""
    launcher = {"slurm": "srun", "openmpi": "mpirun", "mpich": "mpiexec"}[place.manager]
    layout_fix = ("run the same number of ranks on every host, in blocks (mpirun's default mapping, "
                  "not --map-by node), or give every rank its own DMLC_WORKER_ID and pass "
                  f"DMLC_NUM_WORKER (the number of hosts): {launcher} {_passing(place.manager, 'DMLC_NUM_WORKER', '2')}")
    num_nodes = _user_int(env, "DMLC_NUM_WORKER", place.num_nodes, "nodes", layout_fix)
    node_index = _user_int(env, "DMLC_WORKER_ID", place.node_index, "this node's index", layout_fix)
    _below("DMLC_WORKER_ID", node_index, "DMLC_NUM_WORKER", num_nodes)
    num_servers = _int(env, "DMLC_NUM_SERVER", minimum=1) or num_nodes
    root_uri = env.get("DMLC_PS_ROOT_URI", "").strip() or place.root_uri
    if root_uri is None:
        raise ConfigError(
            f"DMLC_PS_ROOT_URI is not set, and {launcher} gives no host list: the ranks run on several "
            f"hosts ({place.local_size} of {place.size} on this one). Give the address of rank 0's host, "
            f"e.g. {launcher} {_passing(place.manager, 'DMLC_PS_ROOT_URI', 'host1')} ...")
    port_text = env.get("DMLC_PS_ROOT_PORT", "").strip()
    if not port_text and place.root_port is None:
        raise ConfigError(f"DMLC_PS_ROOT_PORT is not set and {launcher} exports no job id to derive it "
                          f"from; pick a free port, e.g. {launcher} "
                          f"{_passing(place.manager, 'DMLC_PS_ROOT_PORT', '29500')} ...")
    node_host = env.get("DMLC_NODE_HOST", "").strip()
    host = place.host_label or hostname
    base = dict(env)
    base.update({"DMLC_NUM_WORKER": str(num_nodes), "DMLC_NUM_SERVER": str(num_servers),
                 "DMLC_PS_ROOT_URI": root_uri, "DMLC_PS_ROOT_PORT": port_text or str(place.root_port)})
    if node_host:
        base["DMLC_NODE_HOST"] = node_host
    elif place.node_host:  # unless DMLC_INTERFACE names the interface whose address each process takes
        base.update(launcher_node_host(env, place.node_host))
    base.setdefault("PYTHONUNBUFFERED", "1")  # piped Python output would otherwise come in blocks
    rank = place.node_offset + place.local_rank if place.node_offset is not None else place.rank
    processes = []
    if place.rank == 0:
        processes.append(Process("scheduler", "scheduler", f"[scheduler@{host}] ", {**base, "DMLC_ROLE": "scheduler"}))
    if place.local_rank == 0:
        for index in range(node_index, num_servers, num_nodes):  # one per node; more wrap around
            processes.append(Process("server", f"server{index}", f"[server{index}@{host}] ",
                                     {**base, "DMLC_ROLE": "server"}))
    processes.append(Process("worker", f"worker{rank}", f"[{rank}@{host}] ", {
        **base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(node_index),
        "BYTEPS_LOCAL_RANK": str(place.local_rank), "BYTEPS_LOCAL_SIZE": str(place.local_size)}))
    return processes


def describe(place: Layout, processes: list[Process], env: Mapping[str, str]) -> str:
    """One line for task 0's output: the layout and where the scheduler is (``env``: the task's
    own environment, to tell a port the user set from a derived one)."""
    derived = processes[-1].env
    how = "" if env.get("DMLC_PS_ROOT_PORT", "").strip() else f" (port {place.port_source})"
    return (f"{place.manager} task {place.rank} of {place.size}: {derived['DMLC_NUM_WORKER']} node(s), "
            f"{derived['DMLC_NUM_SERVER']} server(s), scheduler at {derived['DMLC_PS_ROOT_URI']}:"
            f"{derived['DMLC_PS_ROOT_PORT']}{how}")


class BatchBackend(Backend):
    """This task's worker, and the server and scheduler :func:`plan` gives it. The task's
    scheduler and server serve the other tasks' workers too: they get as long as they take
    after this task's worker (they exit once every worker of the job has shut down)."""

    services_seconds = None

    def __init__(self, place: Layout, env: Mapping[str, str]) -> None:
        self.place = place
        self.env = dict(env)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> BatchBackend | None:
        if args.no_batch_env or env.get("DMLC_ROLE"):
            return None
        place = layout(env)
        return None if place is None else cls(place, env)

    def plan(self, command: list[str]) -> list[Process]:
        check_command(command, self.env)
        processes = plan(self.env, self.place, socket.gethostname())
        worker = load_config(processes[-1].env)
        if not worker.distributed:
            return processes[-1:]  # a one-task job: no scheduler or server, as with -np 1
        for process in processes[:-1]:
            load_config(process.env)
        if self.place.rank == 0:
            note(describe(self.place, processes, self.env))
            if worker.keys is None:
                note("no job secret (BPS_GOSSIP_SECRET / BPS_GOSSIP_SECRET_FILE unset): sockets are not "
                     "authenticated or encrypted, as in BytePS; see docs/launcher-clusters.md to set one")
        if worker.keys is None:  # said once above, by task 0: not again by every process of every task
            for process in processes:
                process.env[NO_SECRET_NOTED_VAR] = "1"
        return processes
