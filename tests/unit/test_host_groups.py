"""bps_gossip.host_groups on typed address-book entries: who reduces with whom, for gossip and
for push_pull, by each host-reduce mode (unit tests, no processes)."""

from __future__ import annotations

from bps_gossip.host_groups import group_of, host_groups, one_host_job, push_pull_groups, same_host
from bps_gossip.protocol import BookEntry


def entries(hosts: list[str], mode: str = "auto") -> list[BookEntry]:
    return [BookEntry(rank=rank, uid=f"{rank:02x}", addr=f"tcp://{host}:{9000 + rank}", host=host, pid=rank + 1,
                      local_rank=0, local_size=1, host_reduce=mode) for rank, host in enumerate(hosts)]


def test_two_hosts_with_a_remote_server_reduce_by_host():
    workers = entries(["a", "b", "a", "b"])
    assert host_groups(workers, ["tcp://a:1"]) == [(0, 2), (1, 3)]
    assert push_pull_groups(workers, ["tcp://a:1"]) == [(0, 2), (1, 3)]
    assert group_of(host_groups(workers, ["tcp://a:1"]), 3) == (1, 3)
    assert same_host(workers[0], workers[2]) and not same_host(workers[0], workers[1])


def test_one_host_is_one_push_pull_group_but_gossip_stays_flat_under_auto():
    workers = entries(["a", "a", "a"])
    assert one_host_job(workers)
    assert push_pull_groups(workers, ["tcp://a:1"]) == [(0, 1, 2)]
    assert host_groups(workers, ["tcp://a:1"]) == [(0,), (1,), (2,)]  # the server is on the host: nothing to save


def test_any_worker_off_leaves_every_rank_alone():
    workers = entries(["a", "a", "b", "b"])
    workers[3] = BookEntry(**{**workers[3].__dict__, "host_reduce": "off"})
    assert host_groups(workers, ["tcp://c:1"]) == [(0,), (1,), (2,), (3,)]
    assert not one_host_job(entries(["a", "a"], "off"))
    assert push_pull_groups(entries(["a", "a"], "off"), []) == [(0,), (1,)]


def test_on_groups_even_where_auto_would_not():
    assert host_groups(entries(["a", "a"], "on"), ["tcp://a:1"]) == [(0, 1)]
    assert host_groups(entries(["a", "b"], "on"), []) == [(0,), (1,)]
    assert not one_host_job(entries(["a"]))  # one worker: nothing to reduce
