"""The cache server: the gRPC face of one engine, its place in the cluster, and `cachesvc serve`.

Modules:
    server: building the tiers and the engine from a config, `create_server` and `serve`.
    service: the CacheService servicer (decode, call the engine, encode).
    status: the status code an error is answered with, from the wire contract's table.
    handoff: values read for a streamed answer, held until the caller's stream fetches them.
    ownership: which keys this server owns, by the placement map it last fetched.
    membership: registering in the metadata shard, heartbeats, following the placement.
    peers: peer fill, asking a key's previous owner before object storage.
    processes: `cachesvc serve --processes N`, one engine process per core.

The gRPC plumbing it shares with the metadata node is `cachesvc.rpc`.
"""

__all__: list[str] = []
