"""Manifests: one value that makes a save the current one for its name, committed in one of two ways.

Checkpoints (`cacheclient.checkpoint`) and saved models (`cacheclient.models`)
both end a save by storing one value, a manifest naming everything else the
save wrote, and making it the one a reader of that name finds. Both use the
`Manifests` interface here, with one of two back-ends:

- `ShardManifests`, for a client that routes by a metadata shard
  (`cache.cluster.shard`): the value is stored under a key that names its
  checksum, and then a record in the shard names that key with the value's
  size and xxh3-64 checksum. The record is one Raft entry, so the commit is
  linearizable (once `save` returns every client that asks the shard sees
  the new value, whole, and a save that dies before its record never
  happened), and a reader checks the value against the record. A value the
  commit replaces can be kept, in the same entry, under a retired record,
  for its owner to free later.
- `CacheManifests`, for a client of one server: the value under the name's
  own key is the commit.

`manifests(cache, ...)` picks the back-end by the client. `ShardRecords` is
the shard's side alone: records that each name one value, for listing and
for changes of several records in one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from cacheclient.client import CacheClient
from cacheclient.errors import CacheClientError
from cacheclient.meta import CommandRefusedError, MetaClient
from cacheclient.wire import checksum
from cacheclient.wire import meta_pb2 as meta_pb

__all__ = [
    "CacheManifests",
    "Manifests",
    "Record",
    "RecordMismatch",
    "Saved",
    "ShardManifests",
    "ShardRecords",
    "manifests",
]


@dataclass(frozen=True)
class Record:
    """A record in the metadata shard naming a value: the value's cache key, size and xxh3-64 checksum."""

    name: str
    """What the record commits (a checkpoint's or a model's name), not the record's own name."""
    key: bytes
    size: int
    checksum: int
    revision: int = 0
    """The log index that wrote the record: records in this order are oldest first."""


class RecordMismatch(CacheClientError):
    """The value a shard record names is missing from the cache, or is not the value the record describes.

    Attributes:
        record: the record.
        missing: True when the value is missing, False when its size or checksum differs.
    """

    def __init__(self, record: Record, *, missing: bool) -> None:
        what = "is missing from the cache" if missing else "does not match the record's size and checksum"
        super().__init__(f"{record.name}: the value {record.key!r} {what}")
        self.record = record
        self.missing = missing


@dataclass(frozen=True)
class Saved:
    """What `Manifests.save` did: the value's key, and the shard record it replaced (None without one)."""

    key: bytes
    replaced: Record | None = None


class Manifests(Protocol):
    """Where a kind of manifest is committed: one value per name, read whole or not at all."""

    def load(self, name: str) -> tuple[bytes, bytes] | None:
        """(key, value) of the value committed as `name`'s, or None when none is.

        Raises:
            RecordMismatch: the shard's record names a value that is missing or another.
            CorruptValueError: the value failed its checksum in transit.
        """
        ...

    def save(
        self, name: str, data: bytes, *, settle: Callable[[bytes], None] | None = None, durable: bool = False
    ) -> Saved:
        """Stores `data` and commits it as `name`'s; `settle(key)` runs in between (to wait until it is durable)."""
        ...


class ShardRecords:
    """Records in the metadata shard that each name one value (a `Manifest` record of one `ManifestItem`).

    One `propose` is one Raft log entry: its commands are applied together
    or not at all.
    """

    _READ_CONCURRENCY = 8
    """Record reads in flight in `get_many` (each a linearizable read)."""

    def __init__(self, meta: MetaClient) -> None:
        self.meta = meta

    def get(self, record: str, name: str) -> Record | None:
        """The record called `record` (committing `name`), or None when there is none naming one value."""
        found = self.meta.get_manifest(record)
        if found is None or len(found.items) != 1:
            return None
        item = found.items[0]
        return Record(name, item.key.encode(), item.size, item.checksum, found.revision)

    def get_many(self, pairs: Sequence[tuple[str, str]]) -> list[Record]:
        """The records of (record, name) pairs, side by side; those gone since they were listed are left out."""
        if len(pairs) > 1:
            with ThreadPoolExecutor(self._READ_CONCURRENCY, thread_name_prefix="shard-records") as pool:
                found = list(pool.map(lambda pair: self.get(*pair), pairs))
        else:
            found = [self.get(*pair) for pair in pairs]
        return [r for r in found if r is not None]

    def names(self, prefix: str) -> list[str]:
        """The names of every record that starts with `prefix`, sorted."""
        return [name for name in self.meta.list_manifests() if name.startswith(prefix)]

    @staticmethod
    def put(record: str, value: Record) -> meta_pb.Command:
        """The command that makes `record` name `value`'s key, size and checksum."""
        item = meta_pb.ManifestItem(key=value.key.decode(), size=value.size, checksum=value.checksum)
        return meta_pb.Command(put_manifest=meta_pb.PutManifest(manifest=meta_pb.Manifest(name=record, items=[item])))

    @staticmethod
    def delete(record: str) -> meta_pb.Command:
        """The command that deletes `record`."""
        return meta_pb.Command(delete_manifest=meta_pb.DeleteManifest(name=record))

    def propose(self, commands: Sequence[meta_pb.Command]) -> None:
        """Applies `commands` in one log entry.

        Raises:
            CommandRefusedError: the shard refused a put (naming the record);
                a refused delete (of a record already gone) is harmless and passes.
        """
        if not commands:
            return
        results = self.meta.propose(commands)
        for command, result in zip(commands, results, strict=True):
            if not result.ok and command.WhichOneof("op") == "put_manifest":
                raise CommandRefusedError(
                    f"the metadata shard refused {command.put_manifest.manifest.name}: {result.error}"
                )


class ShardManifests:
    """The `Manifests` back-end of a client with a metadata shard: a value under its checksum, then its record.

    Args:
        cache: the cache the values are stored in.
        records: the shard's records.
        record: the name of `name`'s commit record.
        value_key: the cache key of `name`'s value with this checksum.
        retired: given, a commit that replaces another value keeps the
            replaced one under the record this names, in the same log entry,
            for its owner to free; None: the replaced value is left as it is.
    """

    def __init__(
        self,
        cache: CacheClient,
        records: ShardRecords,
        *,
        record: Callable[[str], str],
        value_key: Callable[[str, int], bytes],
        retired: Callable[[Record], str] | None = None,
    ) -> None:
        self.cache = cache
        self.records = records
        self._record = record
        self._value_key = value_key
        self._retired = retired

    def get(self, name: str) -> Record | None:
        """`name`'s commit record, or None."""
        return self.records.get(self._record(name), name)

    def read(self, record: Record) -> bytes:
        """The value `record` names, checked against its size and checksum.

        Raises:
            RecordMismatch: the value is missing or another.
            CorruptValueError: it failed its checksum in transit.
        """
        # The key names the value's checksum, checked below: any stored copy is the value (`verified_reads`).
        data = self.cache.verified_reads().get(record.key)
        if data is None:
            raise RecordMismatch(record, missing=True)
        if len(data) != record.size or checksum(data) != record.checksum:
            raise RecordMismatch(record, missing=False)
        return data

    def load(self, name: str) -> tuple[bytes, bytes] | None:
        record = self.get(name)
        return None if record is None else (record.key, self.read(record))

    def save(
        self, name: str, data: bytes, *, settle: Callable[[bytes], None] | None = None, durable: bool = False
    ) -> Saved:
        sum64 = checksum(data)
        value = Record(name, self._value_key(name, sum64), len(data), sum64)
        self.cache.put(value.key, data, durable=durable)
        if settle is not None:
            settle(value.key)
        replaced = self.get(name) if self._retired is not None else None
        commands = [self.records.put(self._record(name), value)]
        if self._retired is not None and replaced is not None and replaced.key != value.key:
            commands.append(self.records.put(self._retired(replaced), replaced))
        self.records.propose(commands)  # the commit point
        return Saved(value.key, replaced)


class CacheManifests:
    """The `Manifests` back-end of a client of one server: the value under its name's key is the commit.

    Args:
        cache: the cache the values are stored in.
        key: the cache key of `name`'s value.
    """

    def __init__(self, cache: CacheClient, *, key: Callable[[str], bytes]) -> None:
        self.cache = cache
        self._key = key

    def load(self, name: str) -> tuple[bytes, bytes] | None:
        key = self._key(name)
        data = self.cache.get(key)
        return None if data is None else (key, data)

    def save(
        self, name: str, data: bytes, *, settle: Callable[[bytes], None] | None = None, durable: bool = False
    ) -> Saved:
        key = self._key(name)
        self.cache.put(key, data, durable=durable)
        if settle is not None:
            settle(key)
        return Saved(key)


def manifests(
    cache: CacheClient,
    *,
    key: Callable[[str], bytes],
    record: Callable[[str], str],
    value_key: Callable[[str, int], bytes],
    retired: Callable[[Record], str] | None = None,
) -> ShardManifests | CacheManifests:
    """The back-end for `cache`: `ShardManifests` when it routes by a metadata shard, else `CacheManifests`.

    Args:
        cache: the client.
        key: `CacheManifests`' key of a name's value.
        record, value_key, retired: `ShardManifests`' names of a commit
            record, of a value under its checksum, and of a retired record.
    """
    shard = cache.cluster.shard
    if shard is None:
        return CacheManifests(cache, key=key)
    return ShardManifests(cache, ShardRecords(shard), record=record, value_key=value_key, retired=retired)
