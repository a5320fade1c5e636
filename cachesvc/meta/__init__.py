"""The metadata shard: cluster membership, placement and manifests, replicated with Raft.

`cachesvc.meta.raft` holds the pure consensus core and its storage;
`cachesvc.meta.linearizability` checks client histories against a key-value model.
"""

__all__: list[str] = []
