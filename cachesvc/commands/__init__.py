"""The command-line front ends: parsing flags, then handing off to the package that does the work.

Modules:
    cachesvc: the `cachesvc` command (`python -m cachesvc`): `serve` a cache
        server, `meta` a metadata-shard node, `up` a local cluster, `demo`.
    cachectl: the `cachectl` admin command: `get`, `put`, `rm`, `stats`,
        `warm`, `leader`, `nodes`.
    warm: `cachectl warm`, loading an S3 prefix into the cache with a progress bar.
    demo: `cachesvc demo`, a DataLoader epoch from S3, then cold and warm through the cache.
"""

__all__: list[str] = []
