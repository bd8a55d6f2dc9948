"""Addresses of this host: which one others reach it at, and how to tell an IP from a name."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from collections.abc import Mapping

from ..errors import ConfigError

INTERFACE_VAR = "DMLC_INTERFACE"  # ps-lite's; BytePS reads the same name (it has no BYTEPS_ one)
_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's (primary) IPv4 address
_IFNAMSIZ = 16  # struct ifreq's name field, its NUL included
_IFREQ_BYTES = 40  # sizeof(struct ifreq) on Linux: the name, then a union of 24 bytes


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` is localhost or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_node_host(root_uri: str, root_port: int | None) -> str:
    """The address others reach this process at when DMLC_NODE_HOST is unset: 127.0.0.1 for a
    loopback scheduler; else what this host's name resolves to (in a Kubernetes pod, the pod's
    IP: the kubelet writes it into /etc/hosts); if that is a loopback address or does not
    resolve, the local address of the route to the scheduler."""
    if is_loopback(root_uri):
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = None
    if address is not None and not is_loopback(address):
        return address
    return route_source(root_uri, root_port or 9) or address or "127.0.0.1"


def launcher_node_host(env: Mapping[str, str], address: str) -> dict[str, str]:
    """What a launcher sets for a process it starts on the host it knows as ``address``:
    DMLC_NODE_HOST=address, or nothing when ``env`` (the user's) names DMLC_INTERFACE: the
    process then advertises that interface's address on its own host (the user's choice wins
    over the launcher's guess, as DMLC_NODE_HOST of one's own does)."""
    return {} if (env.get(INTERFACE_VAR) or "").strip() else {"DMLC_NODE_HOST": address}


def route_source(host: str, port: int) -> str | None:
    """The local IPv4 address this host would use to reach ``host``, or None.

    Connecting a UDP socket only asks the kernel for a route: no packet is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:  # an unresolvable name (a Service not yet in DNS), no route
        return None


def interface_names() -> list[str]:
    """The network interfaces of this host (of this process's network namespace), by index."""
    try:
        return [name for _, name in sorted(socket.if_nameindex())]
    except OSError:
        return []


def interface_address(name: str, variable: str = INTERFACE_VAR) -> str:
    """The IPv4 address of network interface ``name`` (its primary one, the first ``ip addr``
    lists: ps-lite takes the same), for DMLC_INTERFACE. Raises ConfigError naming ``variable``
    and the interfaces that exist when ``name`` is not one, or has no IPv4 address.

    Asked of the kernel with ioctl(SIOCGIFADDR), the call ``ifconfig`` makes: standard library
    only, answered in this process's own network namespace, and the two failures come apart
    (ENODEV: no such interface; EADDRNOTAVAIL: no IPv4 address). /proc/net lists no IPv4
    addresses per interface (fib_trie is a routing table's dump), and ``ip`` may not be installed.
    """
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"{variable} is read on Linux only (this is {sys.platform}): set DMLC_NODE_HOST "
                          "to the address of that interface instead")
    if not name or len(name.encode()) >= _IFNAMSIZ or any(c.isspace() or c in "/\0" for c in name):
        raise ConfigError(f"{variable}={name!r} is not a network interface name (at most {_IFNAMSIZ - 1} "
                          f"characters, no '/' or spaces); this host has {_listing()}")
    try:
        return _ipv4_of(name)
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            raise ConfigError(f"{variable}={name!r}: no such network interface on this host; "
                              f"it has {_listing()}") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"{variable}={name!r} has no IPv4 address (bps_gossip advertises IPv4 only); "
                              f"this host has {_listing()}; or set DMLC_NODE_HOST") from None
        raise ConfigError(f"{variable}={name!r}: cannot read its address ({exc}); "
                          f"this host has {_listing()}") from None


def _ipv4_of(name: str) -> str:
    """ioctl(SIOCGIFADDR) on interface ``name``; OSError as the kernel reports it."""
    import fcntl  # Unix only: imported where it is needed

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, name.encode().ljust(_IFREQ_BYTES, b"\0"))
    return socket.inet_ntoa(answer[20:24])  # sockaddr_in after the name: family (2), port (2), address (4)


def _listing() -> str:
    """The interfaces of this host with their IPv4 addresses, for an error message."""
    found = []
    for name in interface_names():
        try:
            found.append(f"{name} ({_ipv4_of(name)})")
        except OSError:
            found.append(f"{name} (no IPv4 address)")
    return ", ".join(found) if found else "no network interfaces that could be listed"
