"""cachesvc: a tiered, distributed data cache for AI training and inference.

The server side: tiers (`cachesvc.tiers`), the engine that moves bytes
between them (`cachesvc.engine`), eviction policies (`cachesvc.policy`), the
cache server (`cachesvc.server`), the metadata shard (`cachesvc.meta`), the
gRPC plumbing both services stand on (`cachesvc.rpc`), a local cluster for
`cachesvc up` and the tests (`cachesvc.devcluster`) and the `cachesvc` /
`cachectl` commands. The client library is `cacheclient`; the services import
only its floor (the wire contract, errors, fork-safe handles, the metadata
and one-server clients), never its front.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
