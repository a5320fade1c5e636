"""Fill sources: where a read that misses every cache tier gets its bytes, asked in order.

A miss walks an explicit chain: first the sources that may hold a copy
(the key's previous owners in a cluster, `cachesvc.server.peers.PeerFill`),
then object storage (`ObjectStorageFill`), the source of truth. Each source
is asked only for the keys the ones before it did not have, and the chain
says which source answered each key.

Failure semantics: a source that only *may* hold a copy (a peer) treats its
own failures as misses, so the chain goes on to the next source; object
storage raises (`TierUnavailable` when it cannot be reached, `CorruptValue`
when its bytes fail their checksum) and the read fails with it, as a read of
object storage always has. Every value a source returns carries its xxh3-64
checksum, checked on the way in.

Consistency: a source before the last only *may* hold the newest value (a
previous owner keeps what it cached when the key moved away, and a delete or
an overwrite through the new owner does not reach it). With `verify`, each
value such a source returns is checked against object storage (one HEAD:
the object must hold those bytes) and refused otherwise, so the chain goes
on to object storage: a deleted key stays deleted and an overwritten one is
read new. A previous owner uploads a value it has not uploaded yet before it
answers (`Engine.get_cached`), so a moved write-back value passes the check
and the copy the new owner keeps is one object storage holds. When that
upload fails (object storage refuses writes), the peer says so
(`HoldsDirty`) and the new owner takes the value over as its own write-back
value (`adopt`), when object storage has no object of the key: it serves it,
reports it not uploaded, and uploads it.

The engine walks the chain outside its lock, registered with `races.Fills`
so a write to a key in flight keeps the fetched bytes out of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from cachesvc.tiers.base import Entry, Tier

__all__ = ["DropsCopies", "FillChain", "FillSource", "Filled", "HoldsDirty", "ObjectStorageFill"]


class FillSource(Protocol):
    """Somewhere a missed key's value may be read from (see the module docstring for failures)."""

    name: str
    """Short name in counters and logs ("peers", "l3")."""

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Entry]:
        """The values this source has among `keys`; a key it does not have is left out.

        Raises:
            TierUnavailable: an authoritative source (object storage) cannot be reached.
            CorruptValue: an authoritative source holds bytes that fail their checksum.
        """

    def counters(self) -> dict[str, int]:
        """What this source counts of its own (added to the engine's Stats counters)."""

    def close(self) -> None:
        """Releases connections; the source is not asked again."""


@runtime_checkable
class DropsCopies(Protocol):
    """A fill source that can be told a key was deleted, so the copies it may hold go (a peer's tombstone)."""

    def drop(self, key: bytes) -> None:
        """Makes the copies of `key` this source may hold go; best effort (a source that cannot be reached
        is counted and skipped)."""


@runtime_checkable
class HoldsDirty(Protocol):
    """A fill source that can say whether the copy it gave is one object storage lacks (not yet uploaded)."""

    def dirty_at_source(self, key: bytes) -> int | None:
        """The version of the copy of `key` this source just gave when, where it came from, it is not yet
        uploaded (0: a version not known); None when it is uploaded, or the source cannot say."""


@runtime_checkable
class KnowsNewer(Protocol):
    """A fill source that can say whether it holds a newer value of a key than a given version."""

    def newer_elsewhere(self, key: bytes, version: int) -> bool:
        """Whether a copy of `key` newer than `version` is held there (and is then what it gives first)."""


@dataclass(frozen=True, slots=True)
class Filled:
    """A value the chain found and the source that had it."""

    entry: Entry
    source: str


class ObjectStorageFill:
    """Object storage as the chain's last source: a miss there is a miss; its errors are the read's.

    Args:
        store: the object-storage tier (also the engine's L3 for writes).
    """

    def __init__(self, store: Tier) -> None:
        self.store = store
        self.name = store.name

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Entry]:
        found: dict[bytes, Entry] = {}
        for key in keys:
            entry = self.store.get(key)
            if entry is not None:
                found[key] = entry
        return found

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Nothing of its own: the engine closes its L3 tier."""


class FillChain:
    """Fill sources asked in order, each for the keys the ones before it lacked.

    Args:
        sources: the sources, the one to ask first first (object storage last).
        verify: checks a value a source before the last returned (see the module docstring): the entry to
            keep (with its version), or None to refuse it; its errors are the read's.
        adopt: for a value `verify` refused that its source (`HoldsDirty`) holds not yet uploaded, given the
            version it has there: the entry to keep as this node's own dirty value, or None to refuse it too.
    """

    def __init__(
        self,
        sources: Sequence[FillSource],
        verify: Callable[[bytes, Entry], Entry | None] | None = None,
        adopt: Callable[[bytes, Entry, int], Entry | None] | None = None,
    ) -> None:
        self.sources = list(sources)
        self._verify = verify
        self._adopt = adopt

    def __bool__(self) -> bool:
        return bool(self.sources)

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Filled]:
        """The values found for `keys`, each with the source that had it; a key no source has is left out.

        Raises:
            TierUnavailable, CorruptValue: as the first source that raises (see `FillSource`).
        """
        found: dict[bytes, Filled] = {}
        wanted = list(keys)
        last = len(self.sources) - 1
        for i, source in enumerate(self.sources):
            if not wanted:
                break
            for key, entry in source.fetch_many(wanted).items():
                checked = self._verify(key, entry) if self._verify is not None and i < last else entry
                if checked is None and self._adopt is not None and i < last:
                    checked = self._adopted(source, key, entry, self._adopt)
                if checked is not None:
                    found[key] = Filled(checked, source.name)
            wanted = [key for key in wanted if key not in found]
        return found

    @staticmethod
    def _adopted(
        source: FillSource, key: bytes, entry: Entry, adopt: Callable[[bytes, Entry, int], Entry | None]
    ) -> Entry | None:
        """A refused value its source holds not yet uploaded, as `adopt` takes it over; None otherwise."""
        if isinstance(source, HoldsDirty):
            version = source.dirty_at_source(key)
            if version is not None:
                return adopt(key, entry, version)
        return None

    def fetch(self, key: bytes) -> Filled | None:
        """`fetch_many` of one key."""
        return self.fetch_many([key]).get(key)

    def newer_elsewhere(self, key: bytes, version: int) -> bool:
        """Whether a source that can tell (`KnowsNewer`) holds a value of `key` newer than `version`."""
        return any(isinstance(s, KnowsNewer) and s.newer_elsewhere(key, version) for s in self.sources)

    def drop(self, key: bytes) -> None:
        """Tells every source that can be told (`DropsCopies`) that `key` was deleted."""
        for source in self.sources:
            if isinstance(source, DropsCopies):
                source.drop(key)

    def counters(self) -> dict[str, int]:
        """Every source's own counters, merged."""
        merged: dict[str, int] = {}
        for source in self.sources:
            merged.update(source.counters())
        return merged

    def close(self) -> None:
        for source in self.sources:
            source.close()
