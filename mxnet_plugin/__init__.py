"""MXNet / Gluon binding of bps_gossip (the byteps.mxnet API). Filled in by the mxnet_plugin issue."""
