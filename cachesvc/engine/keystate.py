"""Key state: the one owner of what the engine knows of a key beyond its bytes.

For each key the cache holds (or held), `KeyState` keeps:

- its lease and TTL (`Pins`): where the value is pinned and until when,
  and when it reads as a miss;
- whether it is *dirty*: the newest value is in the cache only, object
  storage still lacks it (write-back), so it must not be evicted from the
  last tier before it is uploaded;
- whether it is *hidden*: past its TTL while still dirty, so it reads as a
  miss until its upload, then goes;
- its freshness (`Freshness`): when it was last known to match its object;
- its version: the stamp of the cached value (`versions`), given by the
  node that accepted the write and carried by every copy;
- whether its copy is *unvouched*: read back from L2 at start-up, or cached
  before this node lost and regained the key, so the node cannot say it is
  the newest until it checked it against object storage (`ReadPath`).

Placement asks it which copies are held out of eviction and what expiry a
tier stores; write-back asks it which keys are dirty; the engine changes it.
It calls no one but `marks`, where the unvouched keys are written down for
readers outside the engine (L2's markers for co-located clients, which read
its file directly), told of each change as it is made: otherwise pure
bookkeeping, time from the injected clocks, every method called under the
engine lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from cachesvc.engine.freshness import Freshness
from cachesvc.engine.pins import Lease, Pins

__all__ = ["KeyState", "UnvouchedMarks"]

L = TypeVar("L")


class UnvouchedMarks(Protocol):
    """The unvouched keys written down for readers outside the engine (`LMDBTier.mark_unvouched`)."""

    def mark_unvouched(self, keys: Sequence[bytes]) -> None:
        """`keys` are unvouched: not to be read without the engine's check."""

    def unmark(self, key: bytes, *, now: bool = True) -> None:
        """`key` is vouched for (`now`), or its copy is being replaced or is gone (the mark goes with it)."""

    def unmark_many(self, keys: Sequence[bytes]) -> None:
        """`unmark` of each of `keys` (vouched for now), written at once."""


class KeyState(Generic[L]):
    """Leases, TTLs, dirty and hidden flags, freshness and versions of keys (engine lock held).

    Args:
        max_lease_seconds: the longest lease a put may ask for (see `Pins`).
        revalidate_seconds: how long a value is taken as current (see `Freshness`).
        clock: monotonic seconds (leases, TTLs, freshness).
        wall_clock: Unix seconds (the expiry tiers persist).
    """

    def __init__(
        self,
        max_lease_seconds: float,
        revalidate_seconds: float,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self._pins: Pins[L] = Pins(max_lease_seconds)
        self._freshness = Freshness(revalidate_seconds)
        self._dirty: set[bytes] = set()
        self._hidden: set[bytes] = set()
        self._versions: dict[bytes, int] = {}
        self._unvouched: set[bytes] = set()
        self.marks: UnvouchedMarks | None = None
        """Told of every change to the unvouched keys (None: nobody outside reads the copies)."""
        self._clock = clock
        self._wall_clock = wall_clock

    # -- leases ------------------------------------------------------------

    def check(self, lease: float | None, ttl: float | None) -> None:
        """Raises InvalidKey when a requested lease or TTL is out of bounds."""
        self._pins.check(lease, ttl)

    def lease(self, key: bytes, level: L, seconds: float) -> None:
        """Pins `key` in `level` for `seconds` (one more holder if it is already leased)."""
        self._pins.lease(key, level, seconds, self._clock())

    def leased(self, key: bytes) -> Lease[L] | None:
        return self._pins.leased(key)

    def leased_in(self, key: bytes, level: L) -> bool:
        lease = self._pins.leased(key)
        return lease is not None and lease.level is level

    def release(self, key: bytes) -> Lease[L] | None:
        """Ends one holder's lease; returns the lease to unpin when it was the last holder."""
        return self._pins.release(key)

    def drop_lease(self, key: bytes) -> None:
        self._pins.drop_lease(key)

    # -- TTLs --------------------------------------------------------------

    def expire_after(self, key: bytes, seconds: float) -> None:
        """`key` reads as a miss `seconds` from now."""
        self._pins.expire_at(key, self._clock() + seconds)

    def expired(self, key: bytes) -> bool:
        """Whether `key` passed its TTL (and is not yet dropped)."""
        return self._pins.expired(key, self._clock())

    def expires_at(self, key: bytes) -> float:
        """The wall-clock expiry a tier stores with `key` (0: none)."""
        return self._pins.wall_expiry(key, self._clock(), self._wall_clock())

    def due(self) -> tuple[list[bytes], list[bytes]]:
        """Removes and returns the keys whose lease ran out and those whose TTL passed."""
        leases, expired = self._pins.due(self._clock())
        return [key for key, _ in leases], expired

    # -- dirty and hidden --------------------------------------------------

    def dirty(self, key: bytes) -> bool:
        """Whether object storage lacks the newest value of `key`."""
        return key in self._dirty

    def mark_dirty(self, key: bytes) -> None:
        self._dirty.add(key)

    def clean(self, key: bytes) -> bool:
        """Object storage has the newest value of `key` now; returns whether it was hidden (it goes now)."""
        self._dirty.discard(key)
        if key in self._hidden:
            self._hidden.discard(key)
            self._pins.forget(key)
            return True
        return False

    def hide(self, key: bytes) -> None:
        """`key` passed its TTL while dirty: it reads as a miss until `clean`."""
        self._pins.forget(key)
        self._hidden.add(key)

    def hidden(self, key: bytes) -> bool:
        return key in self._hidden

    def dirty_count(self) -> int:
        return len(self._dirty)

    # -- freshness ---------------------------------------------------------

    @property
    def checks_freshness(self) -> bool:
        """Whether any hit may have to check its object first."""
        return self._freshness.enabled

    def known_current(self, key: bytes) -> None:
        """`key`'s cached value matches its object now (filled, put, or checked)."""
        self._freshness.known(key, self._clock())

    def check_due(self, key: bytes) -> bool:
        """Whether a hit on `key` must check its object first."""
        return self._freshness.due(key, self._clock())

    def unknown(self, key: bytes) -> None:
        """The last check of `key` failed: its next hit checks again."""
        self._freshness.forget(key)

    def suspect_all(self) -> None:
        """Every value not known current after now is checked at its next hit (once)."""
        self._freshness.suspect_all(self._clock())

    # -- versions ----------------------------------------------------------

    def version(self, key: bytes) -> int:
        """The version of the cached value of `key` (0: none recorded)."""
        return self._versions.get(key, 0)

    def set_version(self, key: bytes, version: int) -> None:
        if version:
            self._versions[key] = version
        else:
            self._versions.pop(key, None)

    # -- vouching ----------------------------------------------------------

    @property
    def any_unvouched(self) -> bool:
        """Whether any cached copy must be checked before it is served (one attribute test per read)."""
        return bool(self._unvouched)

    def unvouched(self, key: bytes) -> bool:
        """Whether the cached copy of `key` must be checked against its source before it is served."""
        return key in self._unvouched

    def unvouch(self, keys: list[bytes]) -> None:
        """The cached copies of `keys` are not known to be the newest any more (a restart, a regained slot)."""
        self._unvouched.update(keys)
        if self.marks is not None and keys:
            self.marks.mark_unvouched(keys)

    def vouch(self, key: bytes) -> None:
        """The cached copy of `key` was checked (or replaced by a write or fill this node made)."""
        if key in self._unvouched:
            self._unvouched.discard(key)
            if self.marks is not None:
                self.marks.unmark(key)

    def vouch_many(self, keys: Sequence[bytes]) -> None:
        """`vouch` of each of `keys`, their marks written down at once (a listing page's worth)."""
        found = [key for key in keys if key in self._unvouched]
        self._unvouched.difference_update(found)
        if self.marks is not None and found:
            self.marks.unmark_many(found)

    def unvouched_keys(self) -> list[bytes]:
        """The keys whose cached copies must be checked before they are served."""
        return list(self._unvouched)

    def unvouched_count(self) -> int:
        return len(self._unvouched)

    # -- whole keys --------------------------------------------------------

    def restore(self, key: bytes, dirty: bool, expires_at: float) -> None:
        """Re-arms what a persistent tier kept of `key` at start-up (its dirty flag, its wall-clock expiry)."""
        if dirty:
            self._dirty.add(key)
        if expires_at:
            self._pins.restore(key, expires_at, self._clock(), self._wall_clock())

    def replaced(self, key: bytes, *, keep_lease: bool) -> None:
        """A put replaces the value of `key`: its TTL, hidden flag and (unless `keep_lease`) lease go."""
        self._hidden.discard(key)
        self._pins.drop_ttl(key)
        if not keep_lease:
            self._pins.drop_lease(key)
        self._versions.pop(key, None)
        self._unvouch_gone(key)

    def _unvouch_gone(self, key: bytes) -> None:
        """The copy of `key` is replaced or gone: it is no longer unvouched (nor marked, once written)."""
        if key in self._unvouched:
            self._unvouched.discard(key)
            if self.marks is not None:
                self.marks.unmark(key, now=False)

    def evicted(self, key: bytes) -> None:
        """No cache tier holds `key` any more (evicted): its time limits, freshness and version go."""
        self._pins.forget(key)
        self._freshness.forget(key)
        self._versions.pop(key, None)
        self._unvouch_gone(key)

    def forget(self, key: bytes) -> None:
        """`key` was deleted or dropped: every record of it goes, the dirty flag included."""
        self.evicted(key)
        self._dirty.discard(key)
        self._hidden.discard(key)

    def counts(self) -> tuple[int, int]:
        """(leased keys, keys with a TTL)."""
        return self._pins.counts()
