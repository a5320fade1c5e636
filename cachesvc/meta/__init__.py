"""The metadata shard: cluster membership, placement and manifests, replicated with Raft.

Modules:
    raft: the pure consensus core and its storage (LMDB on disk, memory for the simulator).
    state: the replicated state machine (cache nodes, placement map, dataset manifests).
    node: the driver: one thread runs the core, persists, sends, applies, serves reads.
    transport: Raft messages between nodes over gRPC (bounded queues, drop on overflow).
    service: the gRPC servicers and `serve`, behind `cachesvc meta` (its flags: `cachesvc.commands`).
    local: a shard of local processes, for tests, benchmarks and local clusters.
    failpoint: crash points for tests (`CACHESVC_FAILPOINT`).

Clients use `cacheclient.meta.MetaClient`.
"""

__all__: list[str] = []
