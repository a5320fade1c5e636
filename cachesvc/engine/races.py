"""The races between tiers, as explicit objects.

`KeyLocks` orders the writes of one key (puts, deletes, uploads, and the
local-disk write of a fill). `Fills` is single-flight for misses: concurrent
misses on one key join one fetch from the fill sources. A put or delete of a
key while its fill is in flight *invalidates* the fill (the tombstone): the
fetched bytes are still handed to the readers that were already waiting
(their reads overlapped the write, so either order is linearizable), but they
are never installed in a tier, so a delete cannot be undone by a slow fill.
An invalidated fill leaves the table at once, so readers that arrive after
the write start a fresh one. A fill stays in the table until its bytes are
cached (its local-disk write included), so a write that comes meanwhile
still invalidates it.

`Reads` registers the reads of a cache tier that run outside the engine lock
(local disk): a copy of a key removed or replaced meanwhile (a delete, a put,
an eviction) invalidates them, so a reader never counts a hit on, promotes,
or answers "missing" from a copy that changed under it; it reads again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cachesvc.tiers.base import Entry

__all__ = ["Fill", "Fills", "KeyLocks", "Read", "Reads"]


@dataclass(eq=False)
class Fill:
    """One fetch in flight and the readers waiting on it."""

    key: bytes
    invalidated: bool = False
    waiters: int = 0
    behind: bool = False
    """Fetched and answered; only its L2 write, behind the read (`behind.Behind`), is left."""
    _done: threading.Event = field(default_factory=threading.Event)
    _result: Entry | None = None
    _error: BaseException | None = None

    def resolve(self, entry: Entry | None) -> None:
        self._result = entry
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float) -> Entry | None:
        """The fetched entry (None: the key is not in object storage).

        Raises:
            TimeoutError: the fetch did not finish within `timeout` seconds.
            Exception: whatever the fetch raised.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"fill of key {self.key[:64]!r} did not finish within {timeout:.1f}s")
        if self._error is not None:
            raise self._error
        return self._result


class Fills:
    """The table of fills in flight. Callers hold the engine lock around every method."""

    def __init__(self) -> None:
        self._flights: dict[bytes, Fill] = {}

    def join(self, key: bytes) -> tuple[Fill, bool]:
        """The fill for `key` and whether the caller leads it (must fetch)."""
        fill = self._flights.get(key)
        if fill is not None:
            fill.waiters += 1
            return fill, False
        fill = self._flights[key] = Fill(key)
        return fill, True

    def finish(self, fill: Fill) -> None:
        """Removes a finished fill from the table (if it is still the current one)."""
        if self._flights.get(fill.key) is fill:
            del self._flights[fill.key]

    def invalidate(self, key: bytes) -> None:
        """A write to `key` happened: the fill in flight, if any, must not install."""
        fill = self._flights.pop(key, None)
        if fill is not None:
            fill.invalidated = True

    def invalidate_where(self, pick: Callable[[bytes], bool] | None = None) -> None:
        """`invalidate` every fill whose key `pick` picks (None: every fill)."""
        for key in [k for k in self._flights if pick is None or pick(k)]:
            self.invalidate(key)

    def __len__(self) -> int:
        return len(self._flights)

    def fetching(self) -> int:
        """The fills still fetching (not those with only their L2 write left)."""
        return sum(1 for fill in self._flights.values() if not fill.behind)


@dataclass(eq=False)
class Read:
    """One read of a cache tier in flight outside the engine lock."""

    key: bytes
    invalidated: bool = False


class Reads:
    """The reads of cache tiers in flight outside the engine lock. Callers hold the engine lock around every method."""

    def __init__(self) -> None:
        self._reads: dict[bytes, list[Read]] = {}

    def begin(self, key: bytes) -> Read:
        read = Read(key)
        self._reads.setdefault(key, []).append(read)
        return read

    def end(self, read: Read) -> bool:
        """Ends `read`; returns whether every copy of its key stayed as it was meanwhile."""
        reads = self._reads.get(read.key)
        if reads is not None and read in reads:
            reads.remove(read)
            if not reads:
                del self._reads[read.key]
        return not read.invalidated

    def invalidate(self, key: bytes) -> None:
        """A copy of `key` was removed or replaced: the reads in flight must read again."""
        for read in self._reads.pop(key, ()):
            read.invalidated = True

    def __len__(self) -> int:
        return len(self._reads)


class KeyLocks:
    """Striped per-key locks: writes, deletes and uploads of one key happen one at a time, in order.

    Object-storage I/O runs under a key's stripe and outside the engine lock,
    so a slow upload stalls only the keys that share its stripe.
    """

    def __init__(self, stripes: int = 64) -> None:
        self._stripes = [threading.Lock() for _ in range(stripes)]

    def __call__(self, key: bytes) -> threading.Lock:
        """The lock that orders every write of `key`."""
        return self._stripes[hash(key) % len(self._stripes)]
