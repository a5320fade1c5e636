"""Where a shard's bytes come from: its parts as range keys through the cache, or S3 directly while the cache is down.

A shard is cached as range keys (`cacheclient.wire.ranges`), one per part of
`DEFAULT_PART_BYTES`, not as one value: a shard may be larger than a
server's `max_value_bytes` (WebDataset shards of 1 GiB are common), a part
is read by the server as ranged GETs of its S3 part size (8 MiB) in parallel, a
prefetch plan over the parts keeps a bounded window of a shard ahead of the
reader instead of all of it, and a reader holds one part in memory at a
time. `cachectl warm` loads shards as the same range keys, so a warmed
shard is a warm epoch.

On the cache server's machine, a part resident in the server's L2 is read
straight from its LMDB file, checksum verified, as `CachedDataset` reads
samples (`cacheclient._source`; in a cluster, from its owner's L2): no gRPC
hop for a warm epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cacheclient._source import CACHE_DOWN, Source
from cacheclient.client import PrefetchPlan
from cacheclient.errors import CacheClientError
from cacheclient.shards.formats import ShardError
from cacheclient.wire import object_name, range_key

__all__ = ["DEFAULT_PART_BYTES", "SHARD_SUFFIXES", "ShardSource", "is_shard", "part_keys", "parts"]

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 16 << 20
"""Bytes of a shard one range key holds (the last part holds the rest)."""

SHARD_SUFFIXES = (".tar", ".mds", ".mds.zstd", ".mds.gz", ".mds.bz2", ".mds.br", ".mds.snappy")
"""Object names that `cachectl warm` loads as shard parts (range keys) rather than as whole objects."""


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


class ShardSource(Source):
    """Reads shard parts through the cache, or from S3 with ranged GETs while the cache is unreachable.

    Picklable; each process makes its own connections and counts its own reads.
    """

    def read_part(self, key: bytes, start: int, end: int, into: bytearray | None = None) -> bytes | memoryview:
        """Bytes `start`..`end` (inclusive) of the shard cached as `key`.

        `into`: a part read from the co-located L2 is copied into it and
        comes as a view of it, valid until the next read with it (others come as bytes).

        Raises:
            ShardError: no such object, or the range runs past it (the shard changed since it was listed).
            CacheClientError: the cache failed and the fallback is off.
        """
        part = range_key(key, start, end)
        local = self.local_get([part])[0] if into is None else self.local_get_into(part, into)
        if local is not None:
            return local
        if self.cache_usable():
            try:
                value = self.client.get(part)
            except CACHE_DOWN as exc:
                self.cache_failed(exc)
            except CacheClientError as exc:
                raise ShardError(f"shard {key.decode(errors='replace')}: bytes={start}-{end}: {exc}") from exc
            else:
                if value is None:
                    raise ShardError(f"shard {key.decode(errors='replace')}: no such object in object storage")
                return value
        return self._read_s3(key, start, end)

    def _read_s3(self, key: bytes, start: int, end: int) -> bytes:
        import botocore.exceptions

        assert self.s3_bucket is not None
        where = f"s3://{self.s3_bucket}/{object_name(self.s3_key_prefix, key)}"
        try:
            response = self.s3_client().get_object(
                Bucket=self.s3_bucket, Key=object_name(self.s3_key_prefix, key), Range=f"bytes={start}-{end}"
            )
            value: bytes = response["Body"].read()
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise ShardError(
                f"shard {key.decode(errors='replace')}: reading {where} bytes={start}-{end}: {exc}"
            ) from exc
        self.here.fallback_reads += 1
        return value

    def prefetch(self, keys: Sequence[tuple[bytes, int]], window_bytes: int) -> PrefetchPlan | None:
        """Hands the server a plan of (range key, length), in reading order; None when it cannot be started."""
        if not keys or window_bytes <= 0 or not self.cache_usable():
            return None
        try:
            return self.client.prefetch([k for k, _ in keys], window_bytes=window_bytes, sizes=[n for _, n in keys])
        except CacheClientError as exc:
            log.warning("shard prefetch plan not started: %s", exc)
            return None
