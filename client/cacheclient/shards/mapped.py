"""`CachedShardMapDataset`: MDS shards read sample by sample, in any order (a map-style dataset).

An MDS shard begins with its sample count and a table of each sample's
offset, so sample i can be read alone. Each sample is cached as a range key
of its shard (`cacheclient.wire.ranges`: the bytes `begin`..`end` of the
object), which the server reads from S3 with one ranged GET on a miss; the
offset table is read once per shard and process, as a range key too. A
random sampler (`DataLoader(shuffle=True)`) then costs one cache read per
sample, and a co-located worker reads a warm sample straight from the
server's L2 (`cacheclient._source`).

WebDataset tars cannot be read this way (a sample's place in a tar is known
only by reading the tar up to it), nor compressed MDS shards: use
`CachedShardDataset` for them. The sample keys this dataset caches are not
those of `CachedShardDataset` (whole 16 MiB parts): reading one shard both
ways caches it twice.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset

from cacheclient._source import ReadCounts
from cacheclient.client import CacheClient, connect
from cacheclient.shards.dataset import Shard, _mds_shards
from cacheclient.shards.formats import CorruptShardError, MDSColumns, ShardError
from cacheclient.shards.source import ShardSource
from cacheclient.wire import parse_s3_uri

__all__ = ["CachedShardMapDataset"]


class CachedShardMapDataset(ReadCounts, Dataset[Any]):
    """Samples of MDS shards by index, each read on its own through the cache (a map-style dataset).

    `dataset[i]` is sample i in the order of the index's shards, the dict
    `streaming.StreamingDataset(local=...)[i]` returns for the same files
    (decoded by the same column encodings), then `transform`.

    Args:
        shards: MDS shards with their index entries (`from_s3` lists them).
        cache: the cache server or cluster, "host:port" (or a metadata shard's "meta=..."), or a `CacheClient`.
        transform: applied to each sample.
        allow_unsafe_types: unpickle MDS `pkl` columns (as `streaming` requires too).
        Others: of the cache and its S3 fallback, as `CachedShardDataset`'s.

    Raises:
        ShardError: a shard is compressed, or has no index entry.
    """

    _source: ShardSource

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        cache: CacheClient | str,
        transform: Callable[[Any], Any] | None = None,
        allow_unsafe_types: bool = False,
        **source: Any,
    ) -> None:
        self._shards = list(shards)
        for shard in self._shards:
            if shard.compression:
                raise ShardError(
                    f"MDS shard {shard.name} is {shard.compression}-compressed: its samples cannot be read one by "
                    "one; use CachedShardDataset"
                )
            if shard.columns is None or shard.samples is None:
                raise ShardError(f"MDS shard {shard.name} needs its index entry (samples, columns)")
            shard.columns.decoders(allow_unsafe_types, f"MDS shard {shard.name}")
        self._ends: list[int] = []
        total = 0
        for shard in self._shards:
            total += shard.samples or 0
            self._ends.append(total)
        self.transform = transform
        self.allow_unsafe_types = allow_unsafe_types
        self._source = ShardSource(cache, **source)
        self._offsets: dict[int, tuple[int, ...]] = {}
        self._decoders: dict[MDSColumns, list[Callable[[bytes], Any]]] = {}

    @classmethod
    def from_s3(cls, uri: str, *, cache: CacheClient | str, **kwargs: Any) -> CachedShardMapDataset:
        """The MDS shards under `uri` ("s3://bucket/prefix/"), as `CachedShardDataset.from_s3(..., format="mds")`
        lists them (the index.json there, else every index.json under it)."""
        bucket, prefix = parse_s3_uri(uri)
        client = connect(cache, timeout=kwargs.get("timeout", 60.0), token=kwargs.get("token"))
        try:
            shards = _mds_shards(client, prefix, dict(client.list(prefix, bucket=bucket)))
        finally:
            if client is not cache:
                client.close()
        if not shards:
            raise ShardError(f"no mds shards under {uri}")
        kwargs.setdefault("s3_bucket", bucket)
        return cls(shards, cache=cache, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_offsets"], state["_decoders"] = {}, {}  # each process reads and builds its own
        return state

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def shards(self) -> list[Shard]:
        """The shards, in index order."""
        return list(self._shards)

    def __getitem__(self, index: int) -> Any:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a dataset of {len(self)}")
        index %= len(self)
        n = bisect.bisect_right(self._ends, index)
        shard = self._shards[n]
        local = index - (self._ends[n - 1] if n else 0)
        offsets = self._offsets.get(n) or self._read_offsets(n)
        begin, end = offsets[local], offsets[local + 1]
        if end <= begin:
            raise CorruptShardError(shard.name, 4 + 4 * (local + 1), f"sample {local} ends before it begins")
        data = self._source.read_part(shard.key, begin, end - 1)
        if len(data) != end - begin:
            raise CorruptShardError(
                shard.name, begin, f"sample {local}: {len(data)} bytes, its offsets say {end - begin}"
            )
        columns = shard.columns
        assert columns is not None
        if columns not in self._decoders:
            self._decoders[columns] = columns.decoders(self.allow_unsafe_types, f"MDS shard {shard.name}")
        sample = columns.decode(data, self._decoders[columns], shard.name, begin)
        return self.transform(sample) if self.transform is not None else sample

    def _read_offsets(self, n: int) -> tuple[int, ...]:
        """Shard `n`'s offset table (count + 1 offsets), read once per process and checked against its index."""
        shard = self._shards[n]
        samples = shard.samples or 0
        header = 4 * (samples + 2)
        if header > shard.size:
            raise CorruptShardError(shard.name, 0, f"a {shard.size}-byte shard cannot hold {samples} samples' offsets")
        raw = self._source.read_part(shard.key, 0, header - 1)
        if len(raw) != header:
            raise CorruptShardError(shard.name, 0, f"the offset table is {len(raw)} bytes, want {header}")
        count = struct.unpack_from("<I", raw)[0]
        if count != samples:
            raise CorruptShardError(shard.name, 0, f"the shard holds {count} samples, its index.json says {samples}")
        offsets = struct.unpack_from(f"<{samples + 1}I", raw, 4)
        if offsets[0] < header or offsets[-1] != shard.size or any(b < a for a, b in itertools.pairwise(offsets)):
            raise CorruptShardError(
                shard.name, 4, f"the offset table spans bytes {offsets[0]}-{offsets[-1]} of a {shard.size}-byte shard"
            )
        self._offsets[n] = offsets
        return offsets
