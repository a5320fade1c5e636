"""The tier contract: what every tier (memory, LMDB, S3) promises the engine.

A tier stores bytes by key and nothing else: it does not choose what to
evict (the engine asks its policy) and it does not move bytes to other tiers
(the engine does). One parametrized suite (`tests/test_tier_contract.py`)
runs against every implementation.

Failure semantics, for every tier:
- `get` returns None on a miss and raises `CorruptValue` when the stored bytes
  fail their checksum; a corrupt entry is never returned.
- A failed `put` (any exception) leaves the old value, if any, readable.
- `put` raises `TierFull` when the entry's cost exceeds the free budget; the
  engine makes room first, so this is a bug guard, not flow control.
- `delete` of a missing key is not an error.
- Object storage raises `TierUnavailable` when it cannot be reached.

Expiry: `put(..., expires_at=T)` stores a wall-clock deadline (Unix seconds,
0 for none) with the value. A tier that survives restarts keeps it and hands
it back from `scan`, so a TTL outlives the process; tiers do not enforce it
themselves (the engine does, and co-located readers check it on their own).

Optional capabilities are protocols of their own, checked with `isinstance`,
never with `getattr`: `ListableTier` (object storage lists its keys) and
`RevalidatingTier` (object storage tells whether an object changed behind a
cached copy), `NamedListingTier` (object storage lists its objects' names,
ETags, sizes and times, a page per request: copies vouched in bulk),
`VersionedTier` (object storage says the version of an object from one HEAD)
and `SharedTier` (an L1 that co-located clients read without the server:
what they may read is the engine's to say).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "Entry",
    "ListableTier",
    "ListedObject",
    "MappedTier",
    "MarkableTier",
    "NamedListingTier",
    "PlacedFile",
    "ResidentKey",
    "RevalidatingTier",
    "SharedTier",
    "SyncedTier",
    "Tier",
    "VersionedTier",
    "WriterStillOpen",
]


@dataclass(frozen=True, slots=True)
class Entry:
    """A value as a tier hands it back: the bytes and their xxh3-64 checksum."""

    value: bytes
    checksum: int
    dirty: bool = False
    version: int = 0
    """The value's version (`cachesvc.engine.versions`); 0: unknown (a tier that keeps none, an old record)."""


class WriterStillOpen(Exception):
    """A placed file someone still holds open for writing (`PlacedFile.open`)."""


class PlacedFile(mmap.mmap):
    """A value a co-located client wrote into a file the server handed it, mapped read-only: bytes to every
    tier (it has the buffer protocol), and to the local-disk tier that handed the file out, a file to rename
    into place instead of writing (`LMDBTier.put`).

    Open it with `PlacedFile.open` once the writer says it is done.
    """

    path: Path

    @classmethod
    def open(cls, path: Path) -> PlacedFile:
        """Maps the regular file at `path` once no process holds it open for writing.

        A read lease (`F_SETLEASE`) is granted only while no descriptor of
        the file is open for writing, anywhere: taken and let go at once, it
        proves that the client that wrote the file has closed the descriptor
        it was handed, so the bytes the server maps and checks are final
        (and the client cannot truncate the file under the map).

        Raises:
            WriterStillOpen: a descriptor of the file is still open for writing.
            OSError: the file is gone, not a regular file, or empty.
        """
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                raise OSError(f"{path}: not a regular file with bytes in it")
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            except BlockingIOError:
                raise WriterStillOpen(f"{path} is still open for writing") from None
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            # Populated at once: the checksum pass reads every page (one fault-in, not one fault per 64 KiB).
            placed = cls(fd, info.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        placed.path = Path(path)
        return placed


@dataclass(frozen=True, slots=True)
class ResidentKey:
    """One key found in a tier when it is reopened (see `Tier.scan`)."""

    key: bytes
    cost: int
    dirty: bool
    expires_at: float = 0.0
    """Wall-clock Unix seconds after which the value is expired; 0: never."""
    version: int = 0
    """The value's version as the tier kept it; 0: unknown."""
    size: int = 0
    """The value's length in bytes (0 when unreadable)."""


class Tier(Protocol):
    """A store of bytes by key with an optional byte budget."""

    name: str
    """Short name used in stats and errors: "l1", "l2", "l3"."""

    capacity_bytes: int | None
    """The byte budget, or None for a tier without one (object storage)."""

    @property
    def used_bytes(self) -> int:
        """Bytes charged against the budget by resident entries."""

    def cost(self, key: bytes, size: int) -> int:
        """Bytes an entry with this key and a value of `size` bytes is charged."""

    def get(self, key: bytes) -> Entry | None:
        """The stored value, verified against its checksum; None on a miss."""

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int,
        *,
        dirty: bool = False,
        expires_at: float = 0.0,
        version: int = 0,
    ) -> None:
        """Stores `value` under `key`, replacing any old value atomically.

        `dirty` marks a value object storage does not have yet; `expires_at`
        is its wall-clock expiry (0: none); `version` the value's version
        (0: unknown). A persistent tier keeps all three, and object storage
        the version (in the object's metadata), handing it back in `Entry`.
        """

    def delete(self, key: bytes) -> bool:
        """Removes the key; returns whether it was there."""

    def contains(self, key: bytes) -> bool:
        """Whether the key is stored, without reading the value."""

    def scan(self) -> Iterator[ResidentKey]:
        """Every key stored, for rebuilding indexes and policies on start."""

    def list_keys(self) -> list[bytes]:
        """Every key stored, as `scan` lists them, without what else it reads (a move's recheck needs the keys
        alone): a snapshot of the tier's own index where it keeps one."""

    def info(self) -> dict[str, str | int]:
        """What an operator or a co-located reader needs to know (for example LMDB's path and map size)."""

    def close(self) -> None:
        """Releases handles; pending writes are durable once it returns."""


@runtime_checkable
class MappedTier(Protocol):
    """A tier that can hand a value over as a read-only map of where it lies, without copying it."""

    def get_mapped(self, key: bytes) -> Entry | None:
        """`get`, a value that lies in a file of its own handed as a read-only map of it (checked against its
        checksum there), for a reader that only passes the bytes on (an upload); others as `get` gives them."""
        ...


@runtime_checkable
class SyncedTier(Protocol):
    """A tier on a disk whose writes can be made to survive the machine losing power, not only the process."""

    def sync_keys(self, keys: Sequence[bytes]) -> None:
        """Returns once the values of `keys` as last written here, and their index, are on disk (synced)."""
        ...


@runtime_checkable
class MarkableTier(Protocol):
    """A tier that can clear a stored value's dirty flag without reading or rewriting the value."""

    def mark_clean(self, key: bytes, *, version: int, expires_at: float) -> int | None:
        """Clears the dirty flag stored with `key` (and stores `version` and `expires_at` with it) where that
        needs no rewrite of the value; its size when done (or when nothing is stored: 0), None when the caller
        must rewrite the value to do it."""
        ...


@runtime_checkable
class ListableTier(Protocol):
    """A tier that can list what it holds by prefix (object storage)."""

    def list_page(self, prefix: bytes, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
        """Up to `limit` (key, size) pairs after `start_after` under `prefix`, and whether more remain."""


@dataclass(frozen=True, slots=True)
class ListedObject:
    """One object as a listing shows it (ListObjectsV2): no user metadata, so no checksum or version of ours."""

    name: str
    etag: str
    """As the server gives it, quotes taken off: a plain MD5 of the bytes for an object PUT whole, "<md5>-<parts>"
    for one uploaded in parts."""
    size: int
    modified: float
    """Last-modified time, Unix seconds (S3 lists it to the second)."""


@runtime_checkable
class NamedListingTier(Protocol):
    """Object storage that lists its objects by name, a page per request, with what a listing tells of each."""

    def object_name(self, key: bytes) -> str:
        """The name of the object that holds `key`."""

    def hashed_name(self, name: str) -> bool:
        """Whether object `name` is named by its key's digest (a listing cannot say which key it holds)."""

    def list_after(self, start_after: str, limit: int) -> tuple[list[ListedObject], bool]:
        """Up to `limit` objects named after `start_after` (in name order, under the tier's prefix), and
        whether more follow. One request.

        Raises:
            TierUnavailable: the tier cannot be reached.
        """


@runtime_checkable
class VersionedTier(Protocol):
    """Object storage that keeps each value's version in its metadata and can say it from one HEAD."""

    def head_version(self, key: bytes) -> int | None:
        """The version of the object of `key` (0: an object without one, written by others or before versions);
        None when there is no object.

        Raises:
            TierUnavailable: the tier cannot be reached.
        """

    def vouch(self, key: bytes, value: bytes, checksum: int) -> int | None:
        """The version of the object of `key` when its bytes are `value` (compared as `unchanged` does), from
        one HEAD; None when there is no object or it holds other bytes.

        Raises:
            TierUnavailable: the tier cannot be reached.
        """


@runtime_checkable
class RevalidatingTier(Protocol):
    """A tier that can tell whether the object behind a cached value changed (object storage)."""

    def unchanged(self, key: bytes, value: bytes, checksum: int) -> bool:
        """Whether the object of `key` is still the one whose bytes are `value`; a missing one changed.

        Raises:
            TierUnavailable: the tier cannot be reached.
        """


@runtime_checkable
class SharedTier(Protocol):
    """An L1 whose values co-located clients read without the server (`cachesvc.tiers.arena`): a value is
    published for them only while the engine would serve it as it is."""

    publisher: Callable[[bytes], float | None]
    """Asked under the engine lock when a value is stored or revealed: None when the engine would not serve it
    without a check; else the Unix time until when it may be (0: no limit)."""

    def conceal(self, keys: Sequence[bytes]) -> None:
        """Takes `keys` out of direct reads until revealed."""

    def conceal_all(self) -> None:
        """Takes every key out of direct reads."""

    def reveal(self, key: bytes) -> None:
        """Publishes `key` again if `publisher` allows it (the engine just served it)."""

    def take_hits(self) -> list[bytes]:
        """The keys co-located clients read since the last call."""
