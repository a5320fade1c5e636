"""Leases and TTLs: the one owner of per-key time limits.

A *lease* pins a value in the tier it lands in: the tier's policy stops
seeing the key, so it is never a victim, until a read with `release=True`
ends the lease or the lease runs out. Several puts of one value (a KV block
that two prompts share) hold one lease each; the value is unpinned when the
last holder releases it.

A *TTL* makes a value read as a miss once its deadline passes. Deadlines run
on the engine's monotonic clock; `wall_expiry` converts them to the wall-clock
time tiers persist, so a TTL survives a restart (`restore`).

The bookkeeping is pure: time is passed in, and nothing here touches a tier
or a policy. `KeyState` owns the one instance and calls it under the engine
lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from cachesvc.engine.deadlines import Deadlines
from cachesvc.errors import InvalidKey

__all__ = ["Lease", "Pins"]

L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class Lease(Generic[L]):
    """A pinned value: where it is pinned (the engine's tier handle) and how many puts hold it."""

    level: L
    holders: int


class Pins(Generic[L]):
    """Leases and TTLs of the keys the cache holds.

    Args:
        max_lease_seconds: the longest lease a put may ask for; longer ones
            (and negative, NaN or infinite ones) are refused, so no client can
            pin a value forever.
        max_ttl_seconds: the same bound for TTLs (0: unbounded but finite).
    """

    def __init__(self, max_lease_seconds: float = 3600.0, max_ttl_seconds: float = 0.0) -> None:
        self.max_lease_seconds = max_lease_seconds
        self.max_ttl_seconds = max_ttl_seconds
        self._leases: Deadlines[Lease[L]] = Deadlines()
        self._ttls: Deadlines[None] = Deadlines()

    # -- validation ------------------------------------------------------

    def check(self, lease: float | None, ttl: float | None) -> None:
        """Raises InvalidKey when a requested lease or TTL is out of bounds."""
        if lease is not None and not (math.isfinite(lease) and 0 <= lease <= self.max_lease_seconds):
            raise InvalidKey(
                f"lease_seconds must be within 0..{self.max_lease_seconds:g} (max_lease_seconds), got {lease}"
            )
        if ttl is not None and not (math.isfinite(ttl) and ttl >= 0):
            raise InvalidKey(f"ttl_seconds must be a finite number >= 0, got {ttl}")
        if ttl is not None and self.max_ttl_seconds and ttl > self.max_ttl_seconds:
            raise InvalidKey(f"ttl_seconds must be at most {self.max_ttl_seconds:g} (max_ttl_seconds), got {ttl}")

    # -- leases ----------------------------------------------------------

    def lease(self, key: bytes, level: L, seconds: float, now: float) -> None:
        """Pins `key` in `level` (where its value now is) for `seconds`, adding a holder if it is already leased.

        A second holder keeps the later of the two deadlines.
        """
        held = self._leases.get(key)
        deadline = now + seconds
        holders = 1
        if held is not None:
            deadline = max(deadline, held[0])
            holders = held[1].holders + 1
        self._leases.set(key, deadline, Lease(level, holders))

    def leased(self, key: bytes) -> Lease[L] | None:
        found = self._leases.get(key)
        return None if found is None else found[1]

    def release(self, key: bytes) -> Lease[L] | None:
        """Ends one holder's lease; returns the lease to unpin when it was the last holder."""
        found = self._leases.get(key)
        if found is None:
            return None
        deadline, lease = found
        if lease.holders > 1:
            self._leases.set(key, deadline, Lease(lease.level, lease.holders - 1))
            return None
        self._leases.pop(key)
        return lease

    # -- TTLs ------------------------------------------------------------

    def expire_at(self, key: bytes, deadline: float) -> None:
        """`key` reads as a miss from `deadline` (engine clock) on."""
        self._ttls.set(key, deadline, None)

    def expired(self, key: bytes, now: float) -> bool:
        found = self._ttls.get(key)
        return found is not None and found[0] <= now

    def deadline(self, key: bytes) -> float | None:
        """The TTL deadline of `key` on the engine clock, or None."""
        found = self._ttls.get(key)
        return None if found is None else found[0]

    def wall_expiry(self, key: bytes, now: float, wall_now: float) -> float:
        """The wall-clock expiry tiers persist for `key` (0: none)."""
        deadline = self.deadline(key)
        return 0.0 if deadline is None else wall_now + (deadline - now)

    def restore(self, key: bytes, expires_at: float, now: float, wall_now: float) -> None:
        """Re-arms the TTL of a value found on disk at start-up (`expires_at` is wall-clock; 0: none)."""
        if expires_at > 0:
            self._ttls.set(key, now + (expires_at - wall_now), None)

    # -- both ------------------------------------------------------------

    def due(self, now: float) -> tuple[list[tuple[bytes, Lease[L]]], list[bytes]]:
        """Removes and returns the leases that ran out and the keys whose TTL passed."""
        leases = self._leases.due(now)
        expired = [key for key, _ in self._ttls.due(now)]
        return leases, expired

    def drop_ttl(self, key: bytes) -> None:
        self._ttls.pop(key)

    def drop_lease(self, key: bytes) -> Lease[L] | None:
        """Ends every holder's lease of `key` at once (a put without a lease replaced the value)."""
        return self._leases.pop(key)

    def forget(self, key: bytes) -> Lease[L] | None:
        """Drops every time limit of `key` (it left the cache); returns its lease if it had one."""
        self._ttls.pop(key)
        return self._leases.pop(key)

    def counts(self) -> tuple[int, int]:
        """(leased keys, keys with a TTL)."""
        return len(self._leases), len(self._ttls)
