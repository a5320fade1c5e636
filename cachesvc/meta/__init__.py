"""The metadata shard: cluster membership, placement and manifests, replicated with Raft.

Modules:
    raft: the pure consensus core and its storage (LMDB on disk, memory for the simulator).
    state: the replicated state machine (cache nodes, placement map, dataset manifests).
    node: the driver: one thread runs the core, persists, sends, applies, serves reads.
    transport: Raft messages between nodes over gRPC (bounded queues, drop on overflow).
    service: the gRPC servicers and `serve`, behind `cachesvc meta` (its flags: `cachesvc.commands`).
    metrics: the node's Raft state and counters for Prometheus.
    failpoint: crash points for tests (`CACHESVC_FAILPOINT`).

A node's settings are `cachesvc.config.MetaNodeConfig` and the `NodeConfig` derived from it;
its gRPC plumbing is `cachesvc.rpc`, shared with the cache server. A shard of local processes
(tests, benchmarks, `cachesvc up`) is `cachesvc.devcluster.shard.LocalShard`. Clients use
`cacheclient.meta.MetaClient`.
"""

__all__: list[str] = []
