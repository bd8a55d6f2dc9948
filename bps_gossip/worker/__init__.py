"""The worker side of bps_gossip: engine, handles, tensor checks."""
