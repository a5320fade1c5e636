"""When a cached value is checked against its object in storage again (`s3.revalidate_seconds`).

Object storage holds the truth for the values the cache reads from it, and
an object can be replaced there behind the cache's back. `Freshness` keeps,
for each cached key, when it was last known to match its object (its fill,
its put, its last check), and says which hits are due for a check. The
engine does the check (one HEAD, `RevalidatingTier.unchanged`, outside its
lock) and drops the cached copy of an object that changed, so the read
fills it again: no value is served
longer than `revalidate_seconds` after it was last known current, while
object storage answers. A key with no record (read from L2 after a restart,
copied from a peer) is due at its first hit.

With `revalidate_seconds = 0` (the default) nothing is recorded or checked:
cached values are taken to be immutable, the usual case for datasets and
model shards, and a hit never waits on object storage. Except after
`suspect_all(now)` (a cluster node that lost its lease and came back:
others may have written its keys meanwhile): every value not known current
after `now` is due once, at its next hit, and records are kept from then on.
"""

from __future__ import annotations

__all__ = ["Freshness"]


class Freshness:
    """When each cached key was last known to match its object, in the engine's clock (owned by `KeyState`,
    engine lock held)."""

    def __init__(self, revalidate_seconds: float) -> None:
        if revalidate_seconds < 0:
            raise ValueError(f"revalidate_seconds must be >= 0, got {revalidate_seconds}")
        self.revalidate_seconds = revalidate_seconds
        self._known: dict[bytes, float] = {}
        self._suspect_before: float | None = None

    @property
    def enabled(self) -> bool:
        return self.revalidate_seconds > 0 or self._suspect_before is not None

    def suspect_all(self, now: float) -> None:
        """Every cached value not known to match its object after `now` is due at its next hit."""
        self._suspect_before = now

    def known(self, key: bytes, now: float) -> None:
        """`key`'s cached value matches its object as of `now` (filled, put, or checked)."""
        if self.enabled:
            self._known[key] = now

    def due(self, key: bytes, now: float) -> bool:
        """Whether a hit on `key` must check its object first."""
        if not self.enabled:
            return False
        known = self._known.get(key)
        if known is None or (self._suspect_before is not None and known < self._suspect_before):
            return True
        return self.revalidate_seconds > 0 and now - known >= self.revalidate_seconds

    def forget(self, key: bytes) -> None:
        """`key` left the cache, or its last check failed: its next hit checks."""
        self._known.pop(key, None)

    def __len__(self) -> int:
        return len(self._known)
