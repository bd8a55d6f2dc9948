"""Emulated hosts on one Linux machine: a network namespace per host, each joined by a
veth pair to a bridge in a private 'switch' namespace, with a tc rate limit on both
ends of every link (egress both ways: a host's upload and its download).

Nothing is created in the root namespace and no namespace has a default route, so the
private subnet (10.213.0.0/24 unless told otherwise) exists only between these hosts
and no traffic can leave the machine. Every namespace's name starts with ``PREFIX``
and the creating process's pid, so ``cleanup_leftovers`` can find what a killed run
left behind without touching a live run's namespaces.

Needs root, ``ip`` (iproute2) and ``tc``. Used by scripts/netns_job.py.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

PREFIX = "bpsgn"  # every namespace made here starts with this (keep it short: names show in `ip netns`)
DEFAULT_SUBNET = "10.213.0.0/24"
HOST_IFACE = "eth0"  # the link's name inside every host namespace (MXNet's DMLC_INTERFACE)
COMMAND_TIMEOUT = 20.0  # seconds for one ip/tc command


class NetnsError(RuntimeError):
    """A missing prerequisite or a failed ip/tc command."""


def check_prerequisites() -> None:
    """Raise NetnsError unless this is Linux, we are root, and ip and tc are installed."""
    if not sys.platform.startswith("linux"):
        raise NetnsError(f"network namespaces need Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise NetnsError("network namespaces and tc need root: run this script as root (e.g. with sudo)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise NetnsError(f"'{tool}' is not on PATH: install {package} (apt-get install iproute2)")
    run(["ip", "netns", "list"])  # fails early when the kernel or iproute2 lacks netns support


def interpreter_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as if this script's interpreter's environment were activated: its bin directory
    first on PATH (and VIRTUAL_ENV set when it is a virtualenv).

    ``sudo .venv/bin/python scripts/...`` drops the activated virtualenv from PATH, so a bare
    ``python`` or ``bpslaunch`` in a command run inside a namespace would be the system's,
    without mxnet or bps_gossip. The namespaces share this file system, so this one works there.
    """
    bin_dir = os.path.dirname(sys.executable)  # not resolved: a venv's python is a symlink out of it
    out = dict(env)
    rest = [p for p in out.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
    out["PATH"] = os.pathsep.join([bin_dir, *rest])
    if sys.prefix != sys.base_prefix:
        out["VIRTUAL_ENV"] = sys.prefix
    return out


def run(argv: Sequence[str], check: bool = True) -> str:
    """Run one ip/tc command with a timeout; return stdout, raise NetnsError on failure."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"'{' '.join(argv)}' did not finish within {COMMAND_TIMEOUT} s") from None
    if check and done.returncode != 0:
        raise NetnsError(f"'{' '.join(argv)}' failed (rc {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list`` prints 'name (id: N)')."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process still inside ``namespace`` (only ours can be there), by pid."""
    for pid in run(["ip", "netns", "pids", namespace], check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespace(namespace: str) -> None:
    """Kill what runs in ``namespace`` and delete it (its veth ends and qdiscs go with it)."""
    kill_namespace_processes(namespace)
    run(["ip", "netns", "delete", namespace], check=False)


def _owner_alive(namespace: str) -> bool:
    owner = namespace[len(PREFIX):].split("-", 1)[0]
    if not owner.isdigit():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(force: bool = False) -> list[str]:
    """Delete namespaces named ``PREFIX<pid>-...`` whose creating process is gone (all with
    ``force``); return their names."""
    removed = []
    for namespace in namespaces():
        if namespace.startswith(PREFIX) and (force or not _owner_alive(namespace)):
            delete_namespace(namespace)
            removed.append(namespace)
    return removed


def tbf(namespace: str, device: str, mbit: float) -> None:
    """Limit ``device``'s egress to ``mbit`` Mbit/s with a token bucket.

    The bucket holds 4 ms of traffic (at least 16 KiB): enough for the timer granularity
    at high rates, small enough that bursts above the rate stay short.
    """
    rate_bytes = mbit * 1e6 / 8
    burst = max(16 * 1024, int(rate_bytes * 0.004))
    run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
         "burst", str(burst), "latency", "50ms"])


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, its address and the rate of its link."""

    name: str
    namespace: str
    address: str
    mbit: float
    switch_port: str  # the veth end on the bridge


class Network:
    """Hosts on one switch. ``create()`` builds it; ``destroy()`` (also run at exit and on
    SIGTERM/SIGINT/SIGHUP once created) kills what runs inside and removes every namespace.

    ``mbit``: every link's rate in both directions (0: unlimited); ``slow``: host name ->
    a different rate for that host's link; ``sysctls``: per-namespace kernel settings for
    every host, e.g. {"net.ipv4.tcp_slow_start_after_idle": "0"}.
    """

    def __init__(self, names: Sequence[str], mbit: float, slow: dict[str, float] | None = None,
                 subnet: str = DEFAULT_SUBNET, sysctls: dict[str, str] | None = None) -> None:
        network = ipaddress.ip_network(subnet)
        if not network.is_private:
            raise NetnsError(f"subnet {subnet} is not a private range")
        if len(names) > network.num_addresses - 2:
            raise NetnsError(f"subnet {subnet} is too small for {len(names)} hosts")
        unknown = set(slow or {}) - set(names)
        if unknown:
            raise NetnsError(f"slow link for unknown host(s) {sorted(unknown)}; hosts are {list(names)}")
        self.prefixlen = network.prefixlen
        tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{tag}-switch"
        addresses = network.hosts()
        self.hosts = {
            name: Host(name, f"{tag}-{name}", str(next(addresses)), (slow or {}).get(name, mbit), f"p{index}")
            for index, name in enumerate(names)
        }
        self.sysctls = dict(sysctls or {})
        self.created: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    def create(self) -> Network:
        """Build the switch, the hosts and their rate-limited links; returns self."""
        atexit.register(self.destroy)
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                # SystemExit unwinds through every finally clause (processes killed, then destroy()).
                self._previous_handlers[signum] = signal.signal(signum, _exit_on_signal)
        try:
            self._build()
        except BaseException:
            self.destroy()  # a half-built network must not outlive the failure
            raise
        return self

    def _build(self) -> None:
        self._add_namespace(self.switch)
        run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for host in self.hosts.values():
            self._add_namespace(host.namespace)
            # Both ends are created directly inside their namespaces: the root namespace never sees them.
            run(["ip", "link", "add", "name", HOST_IFACE, "netns", host.namespace, "type", "veth",
                 "peer", "name", host.switch_port, "netns", self.switch])
            run(["ip", "-n", self.switch, "link", "set", host.switch_port, "master", "br0"])
            run(["ip", "-n", self.switch, "link", "set", host.switch_port, "up"])
            run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", HOST_IFACE])
            run(["ip", "-n", host.namespace, "link", "set", HOST_IFACE, "up"])
            run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            for key, value in self.sysctls.items():  # net.* settings are per namespace
                run(["ip", "netns", "exec", host.namespace, "sysctl", "-q", "-w", f"{key}={value}"])
            if host.mbit > 0:
                tbf(host.namespace, HOST_IFACE, host.mbit)  # the host's upload
                tbf(self.switch, host.switch_port, host.mbit)  # its download

    def _add_namespace(self, namespace: str) -> None:
        run(["ip", "netns", "add", namespace])
        self.created.append(namespace)

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    interface = HOST_IFACE  # the link's name inside every host namespace

    def address(self, host: str) -> str:
        """The host's IP address on the private subnet."""
        return self.hosts[host].address

    def traffic(self, host: str, interface: str = HOST_IFACE) -> tuple[int, int]:
        """Bytes (received, sent) so far on ``host``'s link (``interface``): proof that traffic crossed it."""
        stats = json.loads(run(["ip", "-n", self.hosts[host].namespace, "-s", "-j", "link", "show", interface]))
        counters = stats[0]["stats64"]
        return int(counters["rx"]["bytes"]), int(counters["tx"]["bytes"])

    def describe(self) -> str:
        """One line per host: namespace, address, link rate."""
        lines = []
        for host in self.hosts.values():
            rate = f"{host.mbit:g} Mbit/s" if host.mbit > 0 else "unlimited"
            lines.append(f"  {host.name:<8} {host.address:<15} {rate:>16}  (netns {host.namespace})")
        return "\n".join(lines)

    def destroy(self) -> None:
        """Kill every process inside our namespaces and delete them. Idempotent."""
        for namespace in reversed(self.created):
            delete_namespace(namespace)
        self.created.clear()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous_handlers.clear()

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


SECOND_IFACE = "eth1"  # a TwoLinkNetwork host's second link
SECOND_SUBNET = "10.214.0.0/24"


class TwoLinkNetwork(Network):
    """Hosts with two network interfaces, as machines with a second NIC (a fast data network
    beside the one ssh reaches): ``eth0`` on ``subnet`` and ``eth1`` on ``second_subnet``, each
    subnet on its own bridge of the switch namespace. Both links unlimited unless ``mbit``.
    Processes pick one with DMLC_INTERFACE (tests/clusters/test_interface.py)."""

    def __init__(self, names: Sequence[str], mbit: float = 0.0, subnet: str = DEFAULT_SUBNET,
                 second_subnet: str = SECOND_SUBNET) -> None:
        super().__init__(names, mbit, subnet=subnet)
        second = ipaddress.ip_network(second_subnet)
        if not second.is_private or second.overlaps(ipaddress.ip_network(subnet)):
            raise NetnsError(f"second subnet {second_subnet} must be private and apart from {subnet}")
        if len(names) > second.num_addresses - 2:
            raise NetnsError(f"second subnet {second_subnet} is too small for {len(names)} hosts")
        self.second_prefixlen = second.prefixlen
        addresses = second.hosts()
        self.second = {name: str(next(addresses)) for name in names}

    def _build(self) -> None:
        super()._build()
        run(["ip", "-n", self.switch, "link", "add", "br1", "type", "bridge"])
        run(["ip", "-n", self.switch, "link", "set", "br1", "up"])
        for index, host in enumerate(self.hosts.values()):
            port = f"q{index}"  # its switch end, beside the first link's p<index>
            run(["ip", "link", "add", "name", SECOND_IFACE, "netns", host.namespace, "type", "veth",
                 "peer", "name", port, "netns", self.switch])
            run(["ip", "-n", self.switch, "link", "set", port, "master", "br1"])
            run(["ip", "-n", self.switch, "link", "set", port, "up"])
            run(["ip", "-n", host.namespace, "addr", "add", f"{self.second[host.name]}/{self.second_prefixlen}",
                 "dev", SECOND_IFACE])
            run(["ip", "-n", host.namespace, "link", "set", SECOND_IFACE, "up"])
            if host.mbit > 0:
                tbf(host.namespace, SECOND_IFACE, host.mbit)
                tbf(self.switch, port, host.mbit)

    def address(self, host: str, interface: str = HOST_IFACE) -> str:
        """The host's IP address on the link ``interface`` (eth0: the first subnet, eth1: the second)."""
        if interface == SECOND_IFACE:
            return self.second[host]
        if interface != HOST_IFACE:
            raise NetnsError(f"hosts have {HOST_IFACE} and {SECOND_IFACE}, not {interface}")
        return super().address(host)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
