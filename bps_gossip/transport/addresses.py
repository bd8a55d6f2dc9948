"""Addresses of this host: which one others reach it at, and how to tell an IP from a name."""

from __future__ import annotations

import ipaddress
import socket


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
