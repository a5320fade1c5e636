"""A dataset's reader in one process: its cache client, the co-located L2, and S3 while the cache is down.

`CachedDataset`, `CachedIterableDataset` (`cacheclient.torch`) and
`CachedShardDataset` (`cacheclient.shards`) read through a subclass of
`Source`. A source is picklable: each process (a DataLoader worker, a
forked child) makes its own connections and keeps its own counters on first
use, never its parent's.

On the cache server's machine, values resident in the server's L2 are read
straight from its LMDB file (checksums verified; no gRPC hop). In a routed
cluster only the owner's copy is read, by the client's placement map: a node
that held a key before the placement moved it may keep an older value.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cacheclient._lmdb_reader import L2Reader, colocated_reader
from cacheclient.client import CacheClient, connect
from cacheclient.errors import CacheClientError, DeadlineError, UnavailableError
from cacheclient.process_local import ProcessLocal
from cacheclient.wire import s3_config

if TYPE_CHECKING:
    from cacheclient.cluster import Cluster
    from cacheclient.node import NodeClient
    from cacheclient.wire.placement import PlacementMap

__all__ = ["CACHE_DOWN", "ClusterL2", "Here", "ReadCounts", "Source"]

log = logging.getLogger(__name__)

L2_RECHECK_SECONDS = 5.0
"""Seconds before a process asks again for a co-located L2 it could not open."""

CACHE_DOWN = (UnavailableError, DeadlineError)
"""Failures of the cache server (not of the request) after which a read goes to S3.

Not DATA_LOSS: the server reports corrupt bytes in S3, which S3 would return too."""


@dataclass
class Here:
    """What a `Source` holds in one process: its connections and its counters."""

    client: CacheClient
    fallback_reads: int = 0
    local_hits: int = 0
    l2: L2Reader | ClusterL2 | None = None
    l2_next_check: float = 0.0
    s3: Any = None
    cache_down_until: float = 0.0


class ClusterL2:
    """Co-located reads in a cluster: each key from the L2 of its owner, for the owners on this machine.

    The readers are opened again when the placement map's version changes.
    """

    def __init__(
        self, cluster: Cluster, open_reader: Callable[[NodeClient | CacheClient, str], L2Reader | None]
    ) -> None:
        self._cluster = cluster
        self._open_reader = open_reader
        self._version = -1
        self._readers: dict[str, L2Reader] = {}

    def readers(self) -> dict[str, L2Reader]:
        """The co-located nodes' L2 readers, by address, for the current placement map."""
        return self._readers_for(self._cluster.placement())

    def _readers_for(self, placement: PlacementMap) -> dict[str, L2Reader]:
        if placement.version != self._version:
            readers = {}
            for node in placement.nodes:
                reader = self._readers.get(node) or self._open_reader(self._cluster.node(node), node)
                if reader is not None:
                    readers[node] = reader
            self._readers, self._version = readers, placement.version
        return self._readers

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values the co-located owners' L2 files hold (None for the rest)."""
        placement = self._cluster.placement()
        readers = self._readers_for(placement)
        results: list[bytes | None] = [None] * len(keys)
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            owner = placement.locate(key)
            if owner in readers:
                by_node.setdefault(owner, []).append(i)
        for node, indexes in by_node.items():
            for i, value in zip(indexes, readers[node].get_many([keys[i] for i in indexes]), strict=True):
                results[i] = value
        return results

    def get_into(self, key: bytes, into: bytearray) -> memoryview | bytes | None:
        """The value the co-located owner's L2 holds, copied into `into` (`L2Reader.get_into`); else None."""
        placement = self._cluster.placement()
        owner = placement.locate(key)
        reader = None if owner is None else self._readers_for(placement).get(owner)
        return None if reader is None else reader.get_into(key, into)


class Source:
    """The cache, the co-located L2 and the S3 fallback of one dataset, per process.

    Args:
        cache: a `CacheClient`, or the address of a server or metadata shard.
        local_reads: read the co-located server's L2 (and its shared L1) directly:
            "auto" (when on its machine, silently otherwise), True (the same,
            with a warning naming why not) or False.
        fallback: read from S3 while the cache is unreachable (needs `s3_bucket`).
        retry_cache_after: seconds to read from S3 before trying a failed cache again.
    """

    def __init__(
        self,
        cache: CacheClient | str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        fallback: bool = True,
        s3_bucket: str | None = None,
        s3_key_prefix: str = "",
        s3_endpoint: str | None = None,
        s3_region: str | None = None,
        local_reads: bool | str = "auto",
        retry_cache_after: float = 5.0,
    ) -> None:
        if local_reads not in (True, False, "auto"):
            raise ValueError(f"local_reads must be True, False or 'auto', got {local_reads!r}")
        self.cache = cache
        self.token = token
        self.timeout = timeout
        self.fallback = fallback
        self.s3_bucket = s3_bucket
        self.s3_key_prefix = s3_key_prefix
        self.s3_endpoint = s3_endpoint
        self.s3_region = s3_region
        self.local_reads = local_reads
        self.retry_cache_after = retry_cache_after
        self._here = ProcessLocal(self._new_here)

    def _new_here(self) -> Here:
        # local_reads=False: every read over gRPC, the server's shared L1 too.
        colocated = False if self.local_reads is False else None
        return Here(connect(self.cache, timeout=self.timeout, token=self.token, colocated=colocated))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_here"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._here = ProcessLocal(self._new_here)

    @property
    def here(self) -> Here:
        """This process's connections and counters."""
        return self._here.get()

    @property
    def client(self) -> CacheClient:
        """This process's client of the cache."""
        return self._here.get().client

    @property
    def fallback_reads(self) -> int:
        """Values this process read from S3 directly."""
        return self._here.get().fallback_reads

    @property
    def local_hits(self) -> int:
        """Values this process read from the co-located L2."""
        return self._here.get().local_hits

    # -- the co-located path ------------------------------------------------

    def local_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of `keys` the co-located L2 holds (None for the rest, and all None when not co-located)."""
        here = self._here.get()
        reader = self.local_l2()
        if reader is None:
            return [None] * len(keys)
        try:
            values = reader.get_many(keys)
        except Exception as exc:  # a bad mapping, a resized file: the server still answers
            self._local_failed(here, exc)
            return [None] * len(keys)
        here.local_hits += sum(v is not None for v in values)
        return values

    def local_get_into(self, key: bytes, into: bytearray) -> memoryview | bytes | None:
        """`key`'s value from the co-located L2 copied into `into` (`L2Reader.get_into`); None as `local_get`."""
        here = self._here.get()
        reader = self.local_l2()
        if reader is None:
            return None
        try:
            value = reader.get_into(key, into)
        except Exception as exc:  # as in local_get
            self._local_failed(here, exc)
            return None
        here.local_hits += value is not None
        return value

    @staticmethod
    def _local_failed(here: Here, exc: Exception) -> None:
        log.warning("co-located reads off for %.0fs: %s", L2_RECHECK_SECONDS, exc)
        here.l2, here.l2_next_check = None, time.monotonic() + L2_RECHECK_SECONDS

    def local_l2(self) -> L2Reader | ClusterL2 | None:
        """A reader of the server's L2 when this process runs on the server's machine, else None."""
        if self.local_reads is False:
            return None
        here = self._here.get()
        if here.l2 is None and time.monotonic() >= here.l2_next_check:
            here.l2 = self._open_local_l2(here.client)
            if here.l2 is None:
                # Not co-located, or the server did not answer: ask again later
                # (a transient failure must not turn the fast path off for good).
                here.l2_next_check = time.monotonic() + L2_RECHECK_SECONDS
        return here.l2

    def _open_local_l2(self, client: CacheClient) -> L2Reader | ClusterL2 | None:
        if client.cluster.routed:
            cluster = ClusterL2(client.cluster, self._open_reader)
            return cluster if cluster.readers() else None
        # One server: its Info gets the reads' own deadline (up to 30 s). A server too busy to answer
        # within 5 s (a loaded machine) is no reason to read every value over gRPC for the next 5 s,
        # and the read that follows would wait as long for a server that does not answer at all.
        return self._open_reader(client, str(self.cache), timeout=30.0)

    def _open_reader(self, client: NodeClient | CacheClient, name: str, timeout: float = 5.0) -> L2Reader | None:
        """A reader of the L2 of the server `client` talks to, when it runs on this machine; else None.

        In a cluster each node is asked in turn, 5 s at most: one hung node must not hold up the others'."""
        return colocated_reader(client, name, timeout=min(self.timeout, timeout), explain=self.local_reads is True)

    # -- the fallback -------------------------------------------------------

    def cache_usable(self) -> bool:
        """False while reads skip a cache that failed (for `retry_cache_after` seconds)."""
        return time.monotonic() >= self._here.get().cache_down_until

    def cache_failed(self, exc: CacheClientError) -> None:
        """Reads go to S3 for `retry_cache_after` seconds; raises `exc` when they cannot."""
        if not self.fallback:
            raise exc
        if not self.s3_bucket:
            raise CacheClientError(
                f"{exc}; no S3 fallback: the dataset was not built with from_s3() or s3_bucket="
            ) from exc
        # Skip the cache for a while instead of waiting out a dead server on every batch.
        self._here.get().cache_down_until = time.monotonic() + self.retry_cache_after
        log.warning("cache %s unreachable (%s); reading from S3 for %.0fs", self.cache, exc, self.retry_cache_after)

    def s3_client(self) -> Any:
        """This process's boto3 client for the fallback."""
        here = self._here.get()
        if here.s3 is None:
            import boto3

            endpoint = self.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            config = s3_config(connect_timeout=5, read_timeout=60, max_attempts=5, path_style=bool(endpoint))
            region = self.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            here.s3 = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region or "us-east-1", config=config
            )
        return here.s3


class ReadCounts:
    """What a dataset over a `Source` (its `_source`) reports of where this process's reads went."""

    _source: Source

    @property
    def local_reads(self) -> int:
        """Values (samples, or shard parts) this process read from the co-located server's L2 directly."""
        return self._source.local_hits

    @property
    def fallback_reads(self) -> int:
        """Values (samples, or shard parts) this process read from S3 directly because the cache was unreachable."""
        return self._source.fallback_reads
