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

The engine walks the chain outside its lock, registered with `races.Fills`
so a write to a key in flight keeps the fetched bytes out of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cachesvc.tiers.base import Entry, Tier

__all__ = ["FillChain", "FillSource", "Filled", "ObjectStorageFill"]


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
    """

    def __init__(self, sources: Sequence[FillSource]) -> None:
        self.sources = list(sources)

    def __bool__(self) -> bool:
        return bool(self.sources)

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Filled]:
        """The values found for `keys`, each with the source that had it; a key no source has is left out.

        Raises:
            TierUnavailable, CorruptValue: as the first source that raises (see `FillSource`).
        """
        found: dict[bytes, Filled] = {}
        wanted = list(keys)
        for source in self.sources:
            if not wanted:
                break
            for key, entry in source.fetch_many(wanted).items():
                found[key] = Filled(entry, source.name)
            wanted = [key for key in wanted if key not in found]
        return found

    def fetch(self, key: bytes) -> Filled | None:
        """`fetch_many` of one key."""
        return self.fetch_many([key]).get(key)

    def counters(self) -> dict[str, int]:
        """Every source's own counters, merged."""
        merged: dict[str, int] = {}
        for source in self.sources:
            merged.update(source.counters())
        return merged

    def close(self) -> None:
        for source in self.sources:
            source.close()
