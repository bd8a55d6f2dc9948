"""Reducing by host, in one place: where a worker's partitions go in its host group
(:mod:`.link`: to the leader, the leader's own aggregation, or pushed as the host's sum) and how a
leader sums its locals' partitions through shared memory (:mod:`.aggregations`). Which workers
form a group is bps_gossip.host_groups (servers and gossip use it too)."""

from .aggregations import (
           MAX_HOST_ROUNDS,
           HostAggregation,
           HostAggregations,
           add_into,
           copy_to,
           host_route,
)
from .link import HostLink, Way

__all__ = ["MAX_HOST_ROUNDS", "HostAggregation", "HostAggregations", "HostLink", "Way", "add_into", "copy_to",
           "host_route"]
