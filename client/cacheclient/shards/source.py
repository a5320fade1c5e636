"""Where a shard's bytes come from: its parts as range keys through the cache, or S3 directly while the cache is down.

A shard is cached as range keys (`cacheclient.wire.ranges`), one per part of
`DEFAULT_PART_BYTES`, not as one value: a shard may be larger than a
server's `max_value_bytes` (WebDataset shards of 1 GiB are common), a part
is read by the server as ranged GETs of its S3 part size (8 MiB) in parallel, a
prefetch plan over the parts keeps a bounded window of a shard ahead of the
reader instead of all of it, and a reader holds one part in memory at a
time. `cachectl warm` loads shards as the same range keys, so a warmed
shard is a warm epoch.

On the cache server's machine (one server, not a routed cluster), a part
resident in the server's L2 is read straight from its LMDB file, checksum
verified, as `CachedDataset` reads samples: no gRPC hop for a warm epoch.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cacheclient._lmdb_reader import L2Reader
from cacheclient.client import CacheClient, PrefetchPlan, connect
from cacheclient.errors import CacheClientError, DeadlineError, UnavailableError
from cacheclient.process_local import ProcessLocal
from cacheclient.shards.formats import ShardError
from cacheclient.wire import boot_id, object_name, range_key, s3_config

__all__ = ["DEFAULT_PART_BYTES", "SHARD_SUFFIXES", "ShardSource", "is_shard", "part_keys", "parts"]

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 16 << 20
"""Bytes of a shard one range key holds (the last part holds the rest)."""

SHARD_SUFFIXES = (".tar", ".mds", ".mds.zstd", ".mds.gz", ".mds.bz2", ".mds.br", ".mds.snappy")
"""Object names that `cachectl warm` loads as shard parts (range keys) rather than as whole objects."""

_CACHE_DOWN = (UnavailableError, DeadlineError)
_L2_RECHECK_SECONDS = 5.0


def is_shard(key: bytes) -> bool:
    """Whether `key` names a shard file (by its suffix)."""
    return key.endswith(tuple(s.encode() for s in SHARD_SUFFIXES))


def parts(size: int, part_bytes: int = DEFAULT_PART_BYTES) -> list[tuple[int, int]]:
    """(start, end), inclusive, of each part of a shard of `size` bytes."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be at least 1, got {part_bytes}")
    return [(start, min(start + part_bytes, size) - 1) for start in range(0, size, part_bytes)]


def part_keys(key: bytes, size: int, part_bytes: int = DEFAULT_PART_BYTES) -> list[tuple[bytes, int]]:
    """(range key, length) of each part of the shard cached as `key`."""
    return [(range_key(key, start, end), end - start + 1) for start, end in parts(size, part_bytes)]


@dataclass
class _Here:
    client: CacheClient
    s3: Any = None
    fallback_reads: int = 0
    local_reads: int = 0
    cache_down_until: float = 0.0
    l2: L2Reader | None = None
    l2_next_check: float = 0.0


class ShardSource:
    """Reads shard parts through the cache, or from S3 with ranged GETs while the cache is unreachable.

    Picklable; each process makes its own connections and counts its own fallback reads.
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
        retry_cache_after: float = 5.0,
        local_reads: bool = True,
    ) -> None:
        self.cache = cache
        self.local_reads = local_reads
        self.token = token
        self.timeout = timeout
        self.fallback = fallback
        self.s3_bucket = s3_bucket
        self.s3_key_prefix = s3_key_prefix
        self.s3_endpoint = s3_endpoint
        self.s3_region = s3_region
        self.retry_cache_after = retry_cache_after
        self._here = ProcessLocal(self._new_here)

    def _new_here(self) -> _Here:
        return _Here(connect(self.cache, timeout=self.timeout, token=self.token))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_here"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._here = ProcessLocal(self._new_here)

    @property
    def client(self) -> CacheClient:
        """This process's client of the cache."""
        return self._here.get().client

    @property
    def fallback_reads(self) -> int:
        """Parts this process read from S3 directly."""
        return self._here.get().fallback_reads

    @property
    def local_hits(self) -> int:
        """Parts this process read from the co-located server's L2 directly."""
        return self._here.get().local_reads

    def _local_l2(self, here: _Here) -> L2Reader | None:
        if not self.local_reads:
            return None
        if here.l2 is None and time.monotonic() >= here.l2_next_check:
            here.l2 = self._open_l2(here.client)
            if here.l2 is None:  # not co-located, or the server did not answer: ask again later
                here.l2_next_check = time.monotonic() + _L2_RECHECK_SECONDS
        return here.l2

    def _open_l2(self, client: CacheClient) -> L2Reader | None:
        """A reader of the server's L2 when it runs on this machine (one server, not a routed cluster)."""
        if client.cluster.routed:
            return None
        try:
            info = client.info(timeout=min(self.timeout, 5.0))
        except CacheClientError:
            return None
        path = info.get("l2_path") or ""
        same_machine = info.get("boot_id") == boot_id() and info.get("hostname") == socket.gethostname()
        if not (same_machine and path and os.path.exists(os.path.join(path, "data.mdb"))):
            return None
        reader = L2Reader(path, int(info.get("l2_map_size") or 0))
        try:
            reader.get_many([])
        except Exception as exc:  # lmdb.Error and OSError alike: the gRPC path still works
            log.warning("co-located shard reads off: cannot open %s read-only (%s)", path, exc)
            return None
        return reader

    def read_part(self, key: bytes, start: int, end: int) -> bytes:
        """Bytes `start`..`end` (inclusive) of the shard cached as `key`.

        Raises:
            ShardError: no such object, or the range runs past it (the shard changed since it was listed).
            CacheClientError: the cache failed and the fallback is off.
        """
        here = self._here.get()
        part = range_key(key, start, end)
        reader = self._local_l2(here)
        if reader is not None:
            try:
                local = reader.get_many([part])[0]
            except Exception as exc:  # a bad mapping, a resized file: the server still answers
                log.warning("co-located shard reads off for %.0fs: %s", _L2_RECHECK_SECONDS, exc)
                here.l2, here.l2_next_check, local = None, time.monotonic() + _L2_RECHECK_SECONDS, None
            if local is not None:
                here.local_reads += 1
                return local
        if time.monotonic() >= here.cache_down_until:
            try:
                value = here.client.get(part)
            except _CACHE_DOWN as exc:
                if not self.fallback or not self.s3_bucket:
                    raise
                here.cache_down_until = time.monotonic() + self.retry_cache_after
                log.warning("cache %s unreachable (%s); reading shards from S3 for %.0fs", self.cache, exc,
                            self.retry_cache_after)  # fmt: skip
            except CacheClientError as exc:
                raise ShardError(f"shard {key.decode(errors='replace')}: bytes={start}-{end}: {exc}") from exc
            else:
                if value is None:
                    raise ShardError(f"shard {key.decode(errors='replace')}: no such object in object storage")
                return value
        return self._read_s3(key, start, end)

    def _s3_client(self) -> Any:
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

    def _read_s3(self, key: bytes, start: int, end: int) -> bytes:
        import botocore.exceptions

        assert self.s3_bucket is not None
        where = f"s3://{self.s3_bucket}/{object_name(self.s3_key_prefix, key)}"
        try:
            response = self._s3_client().get_object(
                Bucket=self.s3_bucket, Key=object_name(self.s3_key_prefix, key), Range=f"bytes={start}-{end}"
            )
            value: bytes = response["Body"].read()
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise ShardError(
                f"shard {key.decode(errors='replace')}: reading {where} bytes={start}-{end}: {exc}"
            ) from exc
        self._here.get().fallback_reads += 1
        return value

    def prefetch(self, keys: Sequence[tuple[bytes, int]], window_bytes: int) -> PrefetchPlan | None:
        """Hands the server a plan of (range key, length), in reading order; None when it cannot be started."""
        if not keys or window_bytes <= 0 or time.monotonic() < self._here.get().cache_down_until:
            return None
        try:
            return self.client.prefetch([k for k, _ in keys], window_bytes=window_bytes, sizes=[n for _, n in keys])
        except CacheClientError as exc:
            log.warning("shard prefetch plan not started: %s", exc)
            return None
