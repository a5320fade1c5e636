"""PyTorch datasets that read samples through cachesvc: drop-in for `torch.utils.data.DataLoader`.

`CachedDataset` is map-style: the DataLoader's batch of indices becomes one
`get_many` round trip (`__getitems__`, which torch calls for every batch).
`CachedIterableDataset` shards by rank and by worker, shuffles with a seed per
epoch, and saves and restores its position mid-epoch (`state_dict`), also
through torchdata's `StatefulDataLoader`.

Both are built from an S3 prefix (`from_s3("s3://bucket/prefix", cache=...)`,
listed once through the cache server, which holds the S3 configuration) or
from an explicit list of keys. A job needs only the cache address, or, for a
cluster, a `CacheClient(meta=...)` that routes each key to its node
(`cache=` takes either).

Where the bytes come from, fastest first:

1. the server's L2, read straight from its LMDB file when the client runs on
   the server's machine (the co-located path; checksums verified, a miss or a
   bad record falls through to 2);
2. the cache server over gRPC, which answers from L1/L2 or reads through from S3;
3. S3 directly with boto3, only while the cache server is unreachable
   (`fallback=True`, the default): a cache outage slows a job but does not kill
   it. Credentials come from the standard AWS environment and config files; the
   endpoint from `s3_endpoint=` or `AWS_ENDPOINT_URL`. Each such read is counted
   in `fallback_reads`, per process (each DataLoader worker counts its own and
   logs a warning when it turns to S3).

Sampler-order prefetch: the server can fetch ahead of the reads from S3 when it
knows the order. `CachedDataset.prefetch_epoch(indices)` hands it the sampler's
order; `CachedIterableDataset` hands over its own shuffled shard each epoch.

Processes: every connection (gRPC channel, boto3 client, LMDB handle) is made
lazily in the process that uses it, so the datasets work under the `fork`,
`forkserver` and `spawn` start methods, with a client used in the parent
before the workers start, and they pickle without their connections. One
limit is gRPC's: a fork at the moment a gRPC thread of the parent is busy
(for example a call made by the parent just before the DataLoader starts its
workers) can crash or hang a forked worker. The datasets make no call in the
parent after `from_s3` returns; where a job's own parent-side calls cannot be
kept apart from the fork, use the `forkserver` or `spawn` start method.

This is the only cacheclient module that imports torch (`pip install cachesvc[torch]`).
"""

from __future__ import annotations

import logging
import os
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from cacheclient._source import CACHE_DOWN, ReadCounts, Source
from cacheclient.client import CacheClient, PrefetchPlan, connect
from cacheclient.errors import CacheClientError, CorruptValueError
from cacheclient.plans import Plan
from cacheclient.shards.dataset import CachedShardDataset
from cacheclient.shards.formats import CorruptShardError, ShardError
from cacheclient.shards.mapped import CachedShardMapDataset
from cacheclient.wire import object_matches, object_name, parse_s3_uri
from cacheclient.wire.s3 import NOT_FOUND_CODES, error_code

__all__ = [
    "CachedDataset",
    "CachedIterableDataset",
    "CachedShardDataset",
    "CachedShardMapDataset",
    "CorruptShardError",
    "DatasetError",
    "DecodeError",
    "EpochPrefetch",
    "SampleNotFoundError",
    "ShardError",
    "parse_s3_uri",
]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_BYTES = 256 << 20
"""Default prefetch window: bytes fetched ahead of the reads and not yet read."""


class DatasetError(RuntimeError):
    """A dataset cannot be built or a sample cannot be produced; the message names the key or prefix."""


class SampleNotFoundError(DatasetError):
    """No object holds a sample's key: it was deleted after the manifest was made, or the key list is wrong."""


class DecodeError(DatasetError):
    """The `decode` or `transform` callable raised on a sample; the original exception is the cause."""


def _key_text(key: bytes) -> str:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + key.hex()


def _as_key(key: str | bytes) -> bytes:
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


class _Source(Source):
    """Where a dataset's samples come from: the co-located L2, the cache, or S3 while the cache is down."""

    def fetch(self, keys: Sequence[bytes], *, local: bool = True) -> list[bytes]:
        """The values of `keys`, in order.

        Raises:
            SampleNotFoundError: a key has no object (names the key).
            CacheClientError: the cache failed and fallback is off or impossible.
        """
        here = self.here
        values: list[bytes | None] = self.local_get(keys) if local else [None] * len(keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing and self.cache_usable():
            try:
                found = here.client.get_many([keys[i] for i in missing])
            except CACHE_DOWN as exc:
                self.cache_failed(exc)
            else:
                for i, value in zip(missing, found, strict=True):
                    if value is None:
                        raise SampleNotFoundError(f"sample {_key_text(keys[i])!r} not found: no object holds this key")
                    values[i] = value
                missing = []
        for i in missing:
            values[i] = self._read_s3(keys[i])
        return values  # type: ignore[return-value]

    def _read_s3(self, key: bytes) -> bytes:
        import botocore.exceptions

        assert self.s3_bucket is not None
        name = object_name(self.s3_key_prefix, key)
        where = f"s3://{self.s3_bucket}/{name}"
        try:
            response = self.s3_client().get_object(Bucket=self.s3_bucket, Key=name)
            value: bytes = response["Body"].read()
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in NOT_FOUND_CODES:
                raise SampleNotFoundError(f"sample {_key_text(key)!r} not found: no object {where}") from None
            raise DatasetError(f"sample {_key_text(key)!r}: reading {where} failed: {exc}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise DatasetError(f"sample {_key_text(key)!r}: reading {where} failed: {exc}") from exc
        if not object_matches(value, response.get("Metadata", {}), str(response.get("ETag", ""))):
            raise CorruptValueError(f"sample {_key_text(key)!r}: {where} failed its checksum")
        self.here.fallback_reads += 1
        return value


def _list_manifest(
    uri: str, cache: CacheClient | str, token: str | None, timeout: float
) -> tuple[str, str, list[bytes], list[int]]:
    bucket, prefix = parse_s3_uri(uri)
    client = connect(cache, timeout=timeout, token=token)
    keys: list[bytes] = []
    sizes: list[int] = []
    try:
        for key, size in client.list(prefix, bucket=bucket):
            if key.endswith(b"/") and size == 0:
                continue  # a "directory" marker, not a sample
            keys.append(key)
            sizes.append(size)
    finally:
        if client is not cache:
            client.close()
    if not keys:
        raise DatasetError(
            f"no objects under {uri} (prefix {prefix!r} of the bucket cache server {cache} is configured with)"
        )
    return bucket, prefix, keys, sizes


class _Samples(ReadCounts):
    """What both datasets share: a manifest of keys and sizes, a source, and the decode step."""

    _source: _Source

    def _setup(
        self,
        keys: Sequence[str | bytes],
        cache: CacheClient | str,
        sizes: Sequence[int] | None,
        decode: Callable[[bytes], Any] | None,
        transform: Callable[[Any], Any] | None,
        return_key: bool,
        source_kwargs: dict[str, Any],
    ) -> None:
        if sizes is not None and len(sizes) != len(keys):
            raise ValueError(f"sizes has {len(sizes)} entries for {len(keys)} keys")
        self._keys = [_as_key(k) for k in keys]
        self._sizes = list(sizes) if sizes is not None else None
        self.decode = decode
        self.transform = transform
        self.return_key = return_key
        self._source = _Source(cache, **source_kwargs)

    @property
    def keys(self) -> list[str]:
        """The samples' keys, in manifest order."""
        return [_key_text(k) for k in self._keys]

    @property
    def sizes(self) -> list[int] | None:
        """The samples' sizes in bytes, when known (from the listing)."""
        return self._sizes

    def _samples(self, keys: Sequence[bytes], values: Sequence[bytes]) -> list[Any]:
        out = []
        for key, value in zip(keys, values, strict=True):
            try:
                sample: Any = value if self.decode is None else self.decode(value)
                if self.transform is not None:
                    sample = self.transform(sample)
            except Exception as exc:
                raise DecodeError(f"sample {_key_text(key)!r}: decode failed: {type(exc).__name__}: {exc}") from exc
            out.append((_key_text(key), sample) if self.return_key else sample)
        return out


def _source_kwargs(
    token: str | None,
    timeout: float,
    fallback: bool,
    s3_bucket: str | None,
    s3_key_prefix: str,
    s3_endpoint: str | None,
    s3_region: str | None,
    local_reads: bool | str,
    retry_cache_after: float,
) -> dict[str, Any]:
    return {
        "token": token,
        "timeout": timeout,
        "fallback": fallback,
        "s3_bucket": s3_bucket,
        "s3_key_prefix": s3_key_prefix,
        "s3_endpoint": s3_endpoint,
        "s3_region": s3_region,
        "local_reads": local_reads,
        "retry_cache_after": retry_cache_after,
    }


_COMMON_ARGS = """
        cache: the cache server, "host:port", or a `CacheClient` (a cluster's:
            `CacheClient(meta="HOST:PORT,...")`); each process uses its own connections.
        sizes: the samples' sizes in bytes, when known; they keep prefetch windows exact.
        decode: turns a sample's bytes into a sample (default: the bytes).
        transform: applied to each decoded sample.
        return_key: yield (key, sample) pairs instead of samples.
        token: bearer token of the cache server.
        timeout: deadline of each cache call, seconds.
        fallback: read from S3 directly while the cache server is unreachable.
        s3_bucket: bucket for the fallback (`from_s3` sets it from the URI); it
            must be the bucket the cache server is configured with.
        s3_key_prefix: the cache server's S3 prefix (`--s3-prefix`), for the
            fallback: keys are relative to it.
        s3_endpoint: S3 endpoint for the fallback (default: AWS_ENDPOINT_URL or AWS).
        s3_region: S3 region for the fallback (default: AWS_REGION or us-east-1).
        local_reads: read the co-located server's L2 directly: "auto" (when on
            the server's machine), True (same, and log why not when it cannot),
            or False.
        retry_cache_after: seconds to read from S3 before trying a failed cache again.
"""


class CachedDataset(Dataset[Any], _Samples):
    """A map-style dataset of objects read through cachesvc: sample i is the object `keys[i]`.

    Args:
        keys: the objects' keys (relative to the cache server's S3 prefix).
    """

    __doc__ = (__doc__ or "") + _COMMON_ARGS

    def __init__(
        self,
        keys: Sequence[str | bytes],
        *,
        cache: CacheClient | str,
        sizes: Sequence[int] | None = None,
        decode: Callable[[bytes], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        return_key: bool = False,
        token: str | None = None,
        timeout: float = 30.0,
        fallback: bool = True,
        s3_bucket: str | None = None,
        s3_key_prefix: str = "",
        s3_endpoint: str | None = None,
        s3_region: str | None = None,
        local_reads: bool | str = "auto",
        retry_cache_after: float = 5.0,
    ) -> None:
        kwargs = _source_kwargs(
            token, timeout, fallback, s3_bucket, s3_key_prefix, s3_endpoint, s3_region, local_reads, retry_cache_after
        )
        self._setup(keys, cache, sizes, decode, transform, return_key, kwargs)
        self._plan_order: array[int] | None = None
        self._plan_window = 0
        self._plan: PrefetchPlan | None = None
        self._plan_pid = -1

    @classmethod
    def from_s3(cls, uri: str, *, cache: CacheClient | str, **kwargs: Any) -> CachedDataset:
        """A dataset of every object under `uri` ("s3://bucket/prefix"), listed once through `cache`.

        The listing and the reads go through the cache server, which holds the
        S3 configuration: `bucket` must be the bucket it is configured with,
        and `prefix` is relative to its S3 prefix. Other arguments as in the
        constructor.

        Raises:
            DatasetError: no objects under the prefix.
            CacheClientError: the cache server cannot list.
        """
        bucket, _, keys, sizes = _list_manifest(uri, cache, kwargs.get("token"), kwargs.get("timeout", 30.0))
        kwargs.setdefault("s3_bucket", bucket)
        return cls(keys, cache=cache, sizes=sizes, **kwargs)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at `indices`: one batched read for the DataLoader's whole batch."""
        keys = [self._keys[i] for i in indices]
        self._start_plan_here()
        # While a plan runs, every read goes through the server: it learns the
        # plan's progress from the reads it serves.
        values = self._source.fetch(keys, local=self._plan_order is None)
        return self._samples(keys, values)

    # -- sampler-order prefetch ---------------------------------------------

    def prefetch_epoch(self, indices: Sequence[int], *, window_bytes: int = DEFAULT_WINDOW_BYTES) -> EpochPrefetch:
        """Hands the server this epoch's read order, so it fetches ahead of the reads from S3.

        Use around one epoch, before the DataLoader's iterator is made::

            order = list(sampler)            # the order the DataLoader will read
            loader = DataLoader(dataset, sampler=order, batch_size=32, num_workers=4)
            with dataset.prefetch_epoch(order):
                for batch in loader:
                    ...

        The plan starts with the first batch, in the process that reads it
        (worker 0, or this process without workers), never in a parent that
        forks workers while a stream is open. It ends with the `with` block
        (or when the worker exits). Workers must not be persistent across
        epochs, or they keep the previous epoch's plan.

        Args:
            indices: sample indices in the order they will be read.
            window_bytes: most bytes fetched ahead and not yet read.
        """
        for i in indices:
            if not 0 <= i < len(self._keys):
                raise IndexError(f"prefetch_epoch: index {i} out of range for {len(self._keys)} samples")
        self._close_plan()
        self._plan_order = array("q", indices)
        self._plan_window = window_bytes
        return EpochPrefetch(self)

    def _start_plan_here(self) -> None:
        if self._plan_order is None or self._plan_pid == os.getpid():
            return
        info = get_worker_info()
        self._plan_pid = os.getpid()
        self._plan = None
        if info is not None and info.id != 0:
            return
        plan = Plan.sampler_order(self._keys, self._plan_order, self._sizes)
        try:
            self._plan = plan.start(self._source.client, window_bytes=self._plan_window).prefetch
        except CacheClientError as exc:
            log.warning("prefetch plan not started: %s", exc)

    def _close_plan(self) -> None:
        if self._plan is not None and self._plan_pid == os.getpid():
            self._plan.close()
        self._plan = None
        self._plan_pid = -1
        self._plan_order = None

    @property
    def prefetch_plan(self) -> PrefetchPlan | None:
        """The plan this process started (no workers), for its `progress`; None otherwise."""
        return self._plan if self._plan_pid == os.getpid() else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plan"] = None
        state["_plan_pid"] = -1
        return state


class EpochPrefetch:
    """The prefetch of one epoch of a `CachedDataset`; a context manager that ends it."""

    def __init__(self, dataset: CachedDataset) -> None:
        self._dataset = dataset

    @property
    def plan(self) -> PrefetchPlan | None:
        return self._dataset.prefetch_plan

    def close(self) -> None:
        """Ends the plan (the server stops fetching); later reads do not prefetch."""
        self._dataset._close_plan()

    def __enter__(self) -> EpochPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class CachedIterableDataset(IterableDataset[Any], _Samples):
    """An iterable dataset of objects read through cachesvc, sharded by rank and worker.

    Each epoch, the manifest is shuffled with `seed + epoch` (the same order on
    every rank), split across ranks (`torch.distributed`, else the `RANK` and
    `WORLD_SIZE` environment variables), then across DataLoader workers. Call
    `set_epoch(epoch)` before each epoch, as with `DistributedSampler`.

    Resume: `state_dict()` records the epoch and how far this shard got;
    `load_state_dict()` makes the next iteration continue from there. With
    torchdata's `StatefulDataLoader` this happens per worker automatically;
    with a plain DataLoader it works without workers.

    Prefetch: each worker hands the server its shard's order for the epoch
    and reports its progress, so S3 fetches run ahead of the reads.

    Args:
        keys: the objects' keys (relative to the cache server's S3 prefix).
        shuffle: shuffle every epoch (else manifest order).
        seed: base of the per-epoch shuffle; equal on every rank.
        fetch_size: samples read per round trip.
        prefetch_window_bytes: window of each worker's prefetch plan; 0 turns
            prefetch off.
        equal_shards: drop the last samples so every rank gets the same number
            (a distributed job that needs equal batch counts); otherwise every
            sample is read exactly once and shards may differ by one.
    """

    __doc__ = (__doc__ or "") + _COMMON_ARGS

    def __init__(
        self,
        keys: Sequence[str | bytes],
        *,
        cache: CacheClient | str,
        sizes: Sequence[int] | None = None,
        decode: Callable[[bytes], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        return_key: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        fetch_size: int = 32,
        prefetch_window_bytes: int = DEFAULT_WINDOW_BYTES,
        equal_shards: bool = False,
        token: str | None = None,
        timeout: float = 30.0,
        fallback: bool = True,
        s3_bucket: str | None = None,
        s3_key_prefix: str = "",
        s3_endpoint: str | None = None,
        s3_region: str | None = None,
        local_reads: bool | str = "auto",
        retry_cache_after: float = 5.0,
    ) -> None:
        if fetch_size < 1:
            raise ValueError(f"fetch_size must be at least 1, got {fetch_size}")
        kwargs = _source_kwargs(
            token, timeout, fallback, s3_bucket, s3_key_prefix, s3_endpoint, s3_region, local_reads, retry_cache_after
        )
        self._setup(keys, cache, sizes, decode, transform, return_key, kwargs)
        self.shuffle = shuffle
        self.seed = seed
        self.fetch_size = fetch_size
        self.prefetch_window_bytes = prefetch_window_bytes
        self.equal_shards = equal_shards
        self.epoch = 0
        self._start = 0
        self._yielded = 0
        self._shard_id: tuple[int, int, int, int] | None = None

    @classmethod
    def from_s3(cls, uri: str, *, cache: CacheClient | str, **kwargs: Any) -> CachedIterableDataset:
        """A dataset of every object under `uri`, listed once through `cache`; see `CachedDataset.from_s3`."""
        bucket, _, keys, sizes = _list_manifest(uri, cache, kwargs.get("token"), kwargs.get("timeout", 30.0))
        kwargs.setdefault("s3_bucket", bucket)
        return cls(keys, cache=cache, sizes=sizes, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose shuffle the next iteration reads; a resume position of another epoch is dropped."""
        if epoch != self.epoch:
            self._start = 0
            self._yielded = 0
        self.epoch = epoch

    def _order(self) -> list[int]:
        order = list(range(len(self._keys)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def _shard(self) -> tuple[list[int], tuple[int, int, int, int]]:
        rank, world = _rank_and_world()
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        order = self._order()
        if self.equal_shards:
            order = order[: len(order) - len(order) % world]
        mine = order[rank::world]
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return mine[worker::workers], (rank, world, worker, workers)

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        rank, world = _rank_and_world()
        n = len(self._keys)
        if self.equal_shards:
            return n // world
        return len(range(rank, n, world))

    def __iter__(self) -> Iterator[Any]:
        shard, shard_id = self._shard()
        start = self._start
        if self._shard_id is not None and start and self._shard_id != shard_id:
            rank, world, _, workers = self._shard_id
            raise DatasetError(
                f"cannot resume: the state was saved by rank {rank} of {world} with {workers} DataLoader "
                f"worker(s); resume with the same layout"
            )
        self._shard_id = shard_id
        self._start = 0
        self._yielded = start
        return self._read(shard, start)

    def _read(self, shard: list[int], start: int) -> Iterator[Any]:
        plan = self._open_plan(shard[start:])
        try:
            position = start
            while position < len(shard):
                indices = shard[position : position + self.fetch_size]
                keys = [self._keys[i] for i in indices]
                values = self._source.fetch(keys, local=True)
                samples = self._samples(keys, values)
                position += len(indices)
                if plan is not None:
                    plan.consumed(position - start)
                for sample in samples:
                    self._yielded += 1
                    yield sample
        finally:
            if plan is not None:
                plan.close()

    def _open_plan(self, shard: list[int]) -> PrefetchPlan | None:
        if not self.prefetch_window_bytes or not shard:
            return None
        info = get_worker_info()
        window = self.prefetch_window_bytes // (info.num_workers if info is not None else 1)
        plan = Plan.sampler_order(self._keys, shard, self._sizes)
        try:
            return plan.start(self._source.client, window_bytes=max(window, 1)).prefetch
        except CacheClientError as exc:
            log.warning("prefetch plan not started: %s", exc)
            return None

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: the epoch, and the samples of this shard already yielded."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "seed": self.seed,
            "yielded": self._yielded,
            "num_samples": len(self._keys),
        }
        if self._shard_id is not None:
            state["shard"] = list(self._shard_id)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue where the saved one stopped.

        Raises:
            DatasetError: the state belongs to a different manifest or seed.
        """
        if state.get("num_samples") != len(self._keys) or state.get("seed") != self.seed:
            raise DatasetError(
                f"cannot resume: the state is for {state.get('num_samples')} samples with seed {state.get('seed')}, "
                f"this dataset has {len(self._keys)} with seed {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["yielded"])
        self._yielded = self._start
        shard = state.get("shard")
        self._shard_id = (shard[0], shard[1], shard[2], shard[3]) if shard else None
