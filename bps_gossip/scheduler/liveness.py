"""Which registered nodes are gone: asked of the kernel on this host, else of their heartbeats.

Pure bookkeeping over :class:`~bps_gossip.scheduler.membership.Membership`: the scheduler decides what a
loss means.
"""

from __future__ import annotations

import logging

from .membership import Membership, Node


def why_gone(node: Node, now: float, timeout: float) -> str | None:
    """Why ``node`` counts as gone, or None while it lives. On this host the kernel tells at
    once; heartbeats would take a timeout."""
    if node.local is not None and node.local.alive() is False:  # None: the kernel cannot tell now
        return "its process exited"
    if now - node.last_seen > timeout:
        return f"no heartbeat for {now - node.last_seen:.1f} s"
    return None


def silent(members: Membership, now: float, timeout: float) -> list[tuple[Node, str]]:
    """Alive or joining nodes that are gone, and why."""
    found = []
    for node in list(members.nodes.values()):
        if node.state not in ("alive", "joining"):
            continue
        why = why_gone(node, now, timeout)
        if why is not None:
            found.append((node, why))
    return found


def forget_dead_before_start(members: Membership, now: float, timeout: float, log: logging.Logger) -> None:
    """A node that registered and died before the rendezvous would hold its place for good
    (a replacement is refused as a duplicate, the rendezvous never completes): forget it."""
    for node in list(members.nodes.values()):
        why = why_gone(node, now, timeout)
        if why is None:
            continue
        members.forget(node.uid)
        log.warning("%s pid %s on %s is gone before the rendezvous (%s); its place is free again",
                    node.role, node.pid, node.host, why)
