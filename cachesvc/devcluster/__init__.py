"""A cachesvc cluster on this one machine, for `cachesvc up`, the tests and the benchmarks.

Not the distributed cluster itself: this package only starts and stops local
processes.

Modules:
    procs: starting a process in its own session and stopping it by pid (SIGTERM, grace, SIGKILL); free ports.
    seaweed: a SeaweedFS S3 server bound to 127.0.0.1, and a boto3 client for it.
    shard: `LocalShard`, a metadata shard of `cachesvc meta` processes, stopped, killed or restarted by pid.
    up: `cachesvc up`: a metadata shard, an S3 server and a cache server, wired together.
"""

__all__: list[str] = []
