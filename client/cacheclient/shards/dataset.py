"""`CachedShardDataset`: WebDataset tar and MosaicML MDS shards read through the cache, sample by sample.

Each shard is read whole, once per epoch, front to back: its parts are range
keys (`cacheclient.shards.source`), so a cold epoch costs about one S3 GET
per 8 MiB (the server's S3 part size; one per shard for smaller shards) and
a warm one costs none.
Each worker hands the server the parts of its shards in the order it will
read them (a prefetch plan), so the next shards arrive while it parses the
current one.

Training semantics, as `CachedIterableDataset`'s: each epoch the shard list
is shuffled with `seed + epoch` (the same on every rank), split across ranks
(`torch.distributed`, else `RANK`/`WORLD_SIZE`) and then DataLoader workers
by bytes (`balanced`: each shard to whichever has the fewest bytes so far;
round-robin across ranks with `equal_shards`), and each worker passes its
samples through a shuffle buffer seeded by the seed, epoch, rank and worker: every sample exactly once per epoch, in an
order that is a function of the seed and epoch. `state_dict()` resumes mid
epoch by replaying the worker's shards up to its position without yielding
them (through the cache, so a resume costs cache reads, not S3 ones).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from cacheclient._source import ReadCounts
from cacheclient.client import CacheClient, PrefetchPlan, connect
from cacheclient.errors import CacheClientError
from cacheclient.shards.formats import CorruptShardError, MDSColumns, ShardError, ShardStream, mds_records, tar_samples
from cacheclient.shards.source import DEFAULT_PART_BYTES, ShardSource, part_keys, parts
from cacheclient.wire import parse_s3_uri

__all__ = ["FORMATS", "CachedShardDataset", "Shard"]

log = logging.getLogger(__name__)

FORMATS = ("webdataset", "mds")
DEFAULT_WINDOW_BYTES = 256 << 20
"""Default prefetch window of a rank (shared by its workers): shard bytes fetched ahead and not yet read."""


@dataclass(frozen=True)
class Shard:
    """A shard: its cache key (object name under the server's S3 prefix) and size, and for MDS its index entry."""

    key: bytes
    size: int
    samples: int | None = None
    columns: MDSColumns | None = None
    compression: str | None = None

    @property
    def name(self) -> str:
        return self.key.decode("utf-8", "replace")


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def balanced(order: Sequence[int], sizes: Sequence[int], parts: int, part: int) -> list[int]:
    """The shards of `order` that fall to `part` of `parts`, in order: each shard goes to the part with the
    fewest bytes so far (the lowest-numbered on a tie), so no part reads more than one shard's bytes over
    another. Shards of one size are dealt round-robin; a small last shard no longer leaves one DataLoader
    worker reading a third more than the other (7 shards, one small, over 2 workers: 4 full ones to one)."""
    loads = [0] * parts
    mine: list[int] = []
    for i in order:
        least = min(range(parts), key=lambda j: (loads[j], j))
        loads[least] += sizes[i]
        if least == part:
            mine.append(i)
    return mine


def _shuffled(items: Iterator[Any], size: int, rng: random.Random, initial: int) -> Iterator[Any]:
    """`items` through a shuffle buffer of `size`: each item out is a random one of the buffer.

    The first comes out once `initial` items are in (at most `size`), and the
    buffer grows by one item per item out until it holds `size` (as
    webdataset's `shuffle(bufsize, initial)`): a worker yields its first
    sample after reading `initial`, not `size` (with 1 MiB samples and a
    256-sample buffer, a worker read its whole share of a small epoch before
    its first batch). The first items out are drawn from fewer, so less
    shuffled.
    """
    items = iter(items)
    start = max(1, min(initial, size))
    buffer: list[Any] = []
    for item in items:
        buffer.append(item)
        if len(buffer) < size:
            buffer.extend(itertools.islice(items, 1))  # one more in for each one out, until it is full
        if len(buffer) >= start:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


class CachedShardDataset(ReadCounts, IterableDataset[Any]):
    """An iterable dataset over WebDataset (`format="webdataset"`) or MDS (`format="mds"`) shards, through cachesvc.

    Yields what the format's own reader yields: for WebDataset the dict of a
    sample's files' bytes by extension with `__key__` and `__url__`
    (`webdataset.WebDataset` with no decoder), for MDS the dict of decoded
    columns (`streaming.StreamingDataset`). A corrupt or truncated shard, or
    an MDS index that disagrees with its shards, raises `CorruptShardError`
    (or `ShardError`) naming the shard and offset.

    Args:
        shards: the shards (`from_s3` lists them).
        cache: the cache server, "host:port", or a `CacheClient`.
        format: "webdataset" or "mds".
        shuffle: shuffle the shards, and the samples through the buffer, every epoch.
        seed: base of every shuffle; equal on every rank.
        shuffle_buffer: samples each worker holds to shuffle (0: shards shuffled, samples in shard order).
        shuffle_initial: samples in the buffer before a worker yields its first
            (at most `shuffle_buffer`); the buffer fills as samples go out.
        equal_shards: drop the last shards of each epoch's order so every rank
            reads the same number of shards (dealt round-robin); otherwise
            every sample is read once, the shards split by bytes.
        part_bytes: bytes of a shard one cache value (a range key) holds.
        prefetch_window_bytes: window of each rank's prefetch (split among its workers); 0: none.
        transform: applied to each sample.
        allow_unsafe_types: unpickle MDS `pkl` columns (as `streaming` requires too).
        token, timeout: of the cache server.
        fallback: read parts from S3 directly (ranged GETs) while the cache is unreachable.
        s3_bucket, s3_key_prefix, s3_endpoint, s3_region: for the fallback, as `CachedIterableDataset`'s.
        retry_cache_after: seconds to read from S3 before trying a failed cache again.
        local_reads: on the cache server's machine, read parts resident in its
            L2 straight from its LMDB file (checksums verified; no gRPC hop; in a
            cluster, from the part's owner): "auto", True (with a warning naming
            why not) or False, as `CachedDataset`'s.
    """

    _source: ShardSource

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        cache: CacheClient | str,
        format: str,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 256,
        shuffle_initial: int = 64,
        equal_shards: bool = False,
        part_bytes: int = DEFAULT_PART_BYTES,
        prefetch_window_bytes: int = DEFAULT_WINDOW_BYTES,
        transform: Callable[[Any], Any] | None = None,
        allow_unsafe_types: bool = False,
        token: str | None = None,
        timeout: float = 60.0,
        fallback: bool = True,
        s3_bucket: str | None = None,
        s3_key_prefix: str = "",
        s3_endpoint: str | None = None,
        s3_region: str | None = None,
        retry_cache_after: float = 5.0,
        local_reads: bool | str = "auto",
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        if shuffle_buffer < 0 or shuffle_initial < 1 or part_bytes < 1:
            raise ValueError("shuffle_buffer must be 0 or more, and shuffle_initial and part_bytes at least 1")
        self._shards = list(shards)
        self.format = format
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.shuffle_initial = shuffle_initial
        self.equal_shards = equal_shards
        self.part_bytes = part_bytes
        self.prefetch_window_bytes = prefetch_window_bytes
        self.transform = transform
        self.allow_unsafe_types = allow_unsafe_types
        self._source = ShardSource(
            cache, token=token, timeout=timeout, fallback=fallback, s3_bucket=s3_bucket, s3_key_prefix=s3_key_prefix,
            s3_endpoint=s3_endpoint, s3_region=s3_region, retry_cache_after=retry_cache_after, local_reads=local_reads,
        )  # fmt: skip
        if format == "mds":
            for shard in self._shards:
                if shard.columns is None or shard.samples is None:
                    raise ValueError(f"MDS shard {shard.name} needs its index entry (samples, columns)")
                shard.columns.decoders(allow_unsafe_types, f"MDS shard {shard.name}")
        self.epoch = 0
        self._start = 0
        self._yielded = 0
        self._shard_id: tuple[int, int, int, int] | None = None

    @classmethod
    def from_s3(cls, uri: str, *, format: str, cache: CacheClient | str, **kwargs: Any) -> CachedShardDataset:
        """The shards under `uri` ("s3://bucket/prefix/"), listed (and MDS indexes read) once through `cache`.

        WebDataset: every `.tar` object under the prefix, in name order. MDS:
        the `index.json` at the prefix, else every `index.json` under it
        (one per stream), and the shards each names. The bucket must be the
        one the cache server caches; the prefix is relative to its S3
        prefix. Other arguments as in the constructor.

        Raises:
            ShardError: no shards, or an MDS index that is malformed or names
                shards that are missing or of another size than it says.
        """
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        bucket, prefix = parse_s3_uri(uri)
        client = connect(cache, timeout=kwargs.get("timeout", 60.0), token=kwargs.get("token"))
        try:
            listing = dict(client.list(prefix, bucket=bucket))
            if format == "webdataset":
                shards = [Shard(key, size) for key, size in sorted(listing.items()) if key.endswith(b".tar")]
            else:
                shards = _mds_shards(client, prefix, listing)
        finally:
            if client is not cache:
                client.close()
        if not shards:
            raise ShardError(f"no {format} shards under {uri}")
        kwargs.setdefault("s3_bucket", bucket)
        return cls(shards, cache=cache, format=format, **kwargs)

    @property
    def shards(self) -> list[Shard]:
        """The shards, in listing order."""
        return list(self._shards)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose shuffle the next iteration reads; a resume position of another epoch is dropped."""
        if epoch != self.epoch:
            self._start = 0
            self._yielded = 0
        self.epoch = epoch

    def _my_shards(self) -> tuple[list[int], tuple[int, int, int, int]]:
        rank, world = _rank_and_world()
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        order = list(range(len(self._shards)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        sizes = [shard.size for shard in self._shards]
        if self.equal_shards:
            order = order[: len(order) - len(order) % world]
            ours = order[rank::world]  # the same number of shards on every rank
        else:
            ours = balanced(order, sizes, world, rank)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return balanced(ours, sizes, workers, worker), (rank, world, worker, workers)

    def __iter__(self) -> Iterator[Any]:
        mine, shard_id = self._my_shards()
        start = self._start
        if self._shard_id is not None and start and self._shard_id != shard_id:
            rank, world, _, workers = self._shard_id
            raise ShardError(
                f"cannot resume: the state was saved by rank {rank} of {world} with {workers} DataLoader "
                f"worker(s); resume with the same layout"
            )
        self._shard_id = shard_id
        self._start = 0
        self._yielded = start
        return self._read(mine, shard_id, start)

    def _read(self, mine: list[int], shard_id: tuple[int, int, int, int], skip: int) -> Iterator[Any]:
        plan_keys = [pk for i in mine for pk in part_keys(self._shards[i].key, self._shards[i].size, self.part_bytes)]
        window = self.prefetch_window_bytes // shard_id[3]
        plan = self._source.prefetch(plan_keys, window) if self.prefetch_window_bytes else None
        rng = random.Random(f"{self.seed}/{self.epoch}/{shard_id[0]}/{shard_id[2]}")
        records = self._records(mine, plan)
        if self.shuffle and self.shuffle_buffer:
            records = _shuffled(records, self.shuffle_buffer, rng, self.shuffle_initial)
        try:
            for n, sample in enumerate(records):
                if n < skip:
                    continue
                if self.transform is not None:
                    sample = self.transform(sample)
                self._yielded = n + 1
                yield sample
        finally:
            if plan is not None:
                with contextlib.suppress(CacheClientError):
                    plan.close()

    def _decode(
        self,
        shard: Shard,
        offset: int,
        data: bytes | memoryview,
        decoders: dict[MDSColumns, list[Callable[[bytes], Any]]],
    ) -> Any:
        columns = shard.columns
        assert columns is not None
        if columns not in decoders:
            decoders[columns] = columns.decoders(self.allow_unsafe_types, f"MDS shard {shard.name}")
        return columns.decode(data, decoders[columns], shard.name, offset)

    def _records(self, mine: list[int], plan: PrefetchPlan | None) -> Iterator[Any]:
        """Each shard's samples, in `mine`'s order (MDS samples decoded here, from views of the part in hand:
        a column is copied once, and no sample in the shuffle buffer pins a part)."""
        read = 0
        decoders: dict[MDSColumns, list[Callable[[bytes], Any]]] = {}
        # Co-located, every part is copied from the L2 into this one buffer (the stream copies out what it
        # yields): 16 MiB faulted in once, not once a part.
        buffer: bytearray | None = None
        for i in mine:
            shard = self._shards[i]
            spans = parts(shard.size, self.part_bytes)

            def read_part(j: int, shard: Shard = shard, spans: list[tuple[int, int]] = spans) -> bytes | memoryview:
                nonlocal read, buffer
                if buffer is None and self._source.local_l2() is not None:
                    buffer = bytearray(self.part_bytes)
                value = self._source.read_part(shard.key, *spans[j], into=buffer)
                read += 1
                if plan is not None:
                    with contextlib.suppress(CacheClientError):
                        plan.consumed(read)
                return value

            stream = ShardStream(shard.name, shard.size, spans, read_part)
            if self.format == "webdataset":
                url = f"s3://{self._source.s3_bucket}/{shard.name}" if self._source.s3_bucket else shard.name
                yield from tar_samples(stream, url)
                continue
            assert shard.samples is not None
            if shard.compression:
                stream = _decompressed(stream, shard.compression)
            for offset, data in mds_records(stream, shard.samples, views=True):
                yield self._decode(shard, offset, data, decoders)

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: the epoch, and the samples this worker already yielded in it."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "seed": self.seed,
            "yielded": self._yielded,
            "num_shards": len(self._shards),
        }
        if self._shard_id is not None:
            state["shard"] = list(self._shard_id)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue where the saved one stopped.

        Raises:
            ShardError: the state belongs to another shard list or seed.
        """
        if state.get("num_shards") != len(self._shards) or state.get("seed") != self.seed:
            raise ShardError(
                f"cannot resume: the state is for {state.get('num_shards')} shards with seed {state.get('seed')}, "
                f"this dataset has {len(self._shards)} with seed {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["yielded"])
        self._yielded = self._start
        shard = state.get("shard")
        self._shard_id = (shard[0], shard[1], shard[2], shard[3]) if shard else None


def _decompressed(stream: ShardStream, compression: str) -> ShardStream:
    """A compressed MDS shard's raw bytes (decompressed whole, by `streaming`'s own codecs)."""
    data = b"".join(bytes(piece) for piece in stream.rest())
    try:
        from streaming.base.compression import decompress
    except ImportError:
        raise ShardError(f"shard {stream.name} is {compression}-compressed: install mosaicml-streaming") from None
    try:
        raw = decompress(compression, data)
    except Exception as exc:
        raise CorruptShardError(stream.name, 0, f"does not decompress as {compression}: {exc}") from exc
    return ShardStream(stream.name, len(raw), [(0, len(raw) - 1)] if raw else [], lambda _: raw)


def _mds_shards(client: CacheClient, prefix: str, listing: dict[bytes, int]) -> list[Shard]:
    """The shards the MDS index(es) under `prefix` name, checked against the listing."""
    base = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    indexes = sorted(k for k in listing if k == b"index.json" or k.endswith(b"/index.json"))
    root = (base + "index.json").encode()
    if root in listing:
        indexes = [root]
    shards: list[Shard] = []
    for index_key in indexes:
        where = f"MDS index {index_key.decode(errors='replace')}"
        raw = client.get(index_key)
        try:
            index = json.loads(raw or b"")
            entries = index["shards"]
            version = index["version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardError(f"{where} is not an MDS index: {exc!r}") from None
        if version != 2:
            raise ShardError(f"{where}: version {version}, want 2")
        directory = index_key[: -len(b"index.json")]
        for n, entry in enumerate(entries):
            try:
                if entry["format"] != "mds":
                    raise ShardError(f"{where}: shard {n} is {entry['format']!r}, not mds")
                compression = entry.get("compression") or None
                info = entry["zip_data"] if compression else entry["raw_data"]
                key = directory + str(info["basename"]).encode()
                size, samples = int(info["bytes"]), int(entry["samples"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ShardError(f"{where}: shard {n} is malformed: {exc!r}") from None
            if key not in listing:
                raise ShardError(f"{where} names shard {key.decode(errors='replace')}, which is not in S3")
            if listing[key] != size:
                raise CorruptShardError(
                    key.decode(errors="replace"), min(size, listing[key]),
                    f"{where} says {size} bytes, the object has {listing[key]}",
                )  # fmt: skip
            columns = MDSColumns.from_index(entry, where)
            shards.append(Shard(key, size, samples, columns, compression))
    return shards
