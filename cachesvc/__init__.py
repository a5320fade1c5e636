"""cachesvc: a tiered, distributed data cache for AI training and inference.

The server side: tiers (`cachesvc.tiers`), the engine that moves bytes
between them (`cachesvc.engine`), eviction policies (`cachesvc.policy`), the
gRPC server (`cachesvc.server`), the metadata shard (`cachesvc.meta`) and the
`cachesvc` / `cachectl` commands. The client library is `cacheclient`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
