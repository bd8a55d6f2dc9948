"""The workers of tests/clusters/test_interface.py, on emulated hosts with two links each (eth0 and
eth1 of scripts/netns.py's TwoLinkNetwork; /sys inside ``ip netns exec`` is the namespace's own).
Each prints one ``RESULT`` line: what it advertises, what the address book holds, and the bytes
each link carried while it pushed."""

from __future__ import annotations

import numpy as np
from job_tools import report, run

import bps_gossip as bps
from bps_gossip import runtime, testing

LINKS = ("eth0", "eth1")


def link_bytes() -> dict[str, int]:
    """Bytes received plus sent so far on each of this host's links."""
    counts = {}
    for link in LINKS:
        total = 0
        for name in ("rx", "tx"):
            with open(f"/sys/class/net/{link}/statistics/{name}_bytes") as counter:
                total += int(counter.read())
        counts[link] = total
    return counts


def push_pull_on_the_interface(elements: str, rounds: str) -> None:
    """``rounds`` push_pulls of ``elements`` float32, each sum checked; reports node_host, the
    book's servers and workers, and each link's bytes meanwhile."""
    bps.init()
    rank, size = bps.rank(), bps.size()
    book = testing.address_book()
    before = link_bytes()
    x = np.full(int(elements), rank + 1, dtype=np.float32)
    for _ in range(int(rounds)):
        out = bps.push_pull(x, name="t", average=False)
        assert np.all(out == size * (size + 1) / 2), out[:4]
    after = link_bytes()
    report({"rank": rank, "node_host": runtime.current("interface_job").config.node_host,
            "servers": list(book.servers), "workers": [[w.addr, w.host] for w in book.workers],
            "bytes": {link: after[link] - before[link] for link in LINKS}})
    bps.shutdown()


if __name__ == "__main__":
    run({"push_pull_on_the_interface": push_pull_on_the_interface})
