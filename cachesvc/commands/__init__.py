"""The command-line front ends: parsing flags, then handing off to the package that does the work.

Modules:
    cachesvc: the `cachesvc` command (`python -m cachesvc`): `serve` a cache
        server, `meta` a metadata-shard node, `up` a local cluster, `demo`.
    cachectl: the `cachectl` admin command: its parser, `get`, `put`, `rm`,
        `ls`, `evict`, `stats`, `leader`, `nodes`, `drain`, and its exit statuses.
    views: `cachectl status` and `cachectl top`, the cluster at a glance.
    warm: `cachectl warm`, loading an S3 prefix into the cache with a progress bar.
    checkpoints: `cachectl checkpoints ls|show|rm`.
    common: what the cachectl commands share (addresses, token, CA, clients, exit
        statuses); views, warm and checkpoints stand on it, cachectl on all four.
    demo: `cachesvc demo`, a DataLoader epoch from S3, then cold and warm through the cache.
"""

__all__: list[str] = []
