"""Direct reads: what co-located clients may read from a shared L1 without the engine, and what their reads
tell it (`cachesvc.tiers.arena`, `cacheclient.colocated`).

The engine stays the judge of every copy. `publishable` is the shared L1's
`publisher`: a value is published for direct reads only while the engine
would serve it as it is (not a copy it cannot vouch for yet, nor one checked
against object storage from time to time, nor, on a cluster node, a key it
does not own; its TTL ends its direct reads). The engine conceals keys when
it stops being sure of them (`conceal`, `conceal_all`). The reads co-located
clients made are swept from the arena's hit counters (`note_hits`) and
reach L1's eviction policy and the demand-read feed the prefetcher's open
plans follow, as reads through the engine do.

Co-located clients read L2's file directly too (`cacheclient._lmdb_reader`).
There the engine cannot publish key by key; it writes down what it would
not serve as it is instead (`DiskMarks`): a marker beside each unvouched
value, and one key that turns every direct read off while a cluster node
doubts its lease. A copy the engine keeps in its own revalidation schedule
(`s3.revalidate_seconds`) is not offered at all: the server then does not
name its L2 to clients.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from cachesvc.engine.events import ReadFeed
from cachesvc.engine.keystate import KeyState
from cachesvc.errors import CacheError
from cachesvc.policy.base import EvictionPolicy
from cachesvc.tiers.base import SharedTier
from cachesvc.tiers.lmdb_tier import LMDBTier

__all__ = ["DirectReads", "DiskMarks"]

log = logging.getLogger(__name__)


class DiskMarks:
    """What co-located clients must not read from L2's file directly, written into it (`KeyState.marks`).

    A write the map has no room for is logged and counted
    ("direct_marks_failed"): the engine's own reads still check the copy.
    """

    LEASE, FENCE = "lease", "fence"
    """Why every direct read is off (`in_doubt`): the node's lease may have run out; a peer fenced it with a
    newer map it has not followed yet."""

    def __init__(self, tier: LMDBTier, counters: Counter[str]) -> None:
        self.tier = tier
        self._counters = counters
        self._doubts: set[str] = set()
        self._doubts_lock = threading.Lock()

    def mark_unvouched(self, keys: Sequence[bytes]) -> None:
        self._write(lambda: self.tier.mark_unvouched(keys))

    def unmark(self, key: bytes, *, now: bool = True) -> None:
        self._write(lambda: self.tier.unmark(key, now=now))

    def unmark_many(self, keys: Sequence[bytes]) -> None:
        self._write(lambda: self.tier.unmark_many(keys))

    def in_doubt(self, doubt: bool, reason: str = LEASE) -> None:
        """Every direct read off while any reason holds. A lease's clear is always written (the key a node
        killed in doubt left, at start-up); a fence's only when it changes (it is cleared at every map)."""
        with self._doubts_lock:
            if reason == self.FENCE and doubt == (reason in self._doubts):
                return
            if doubt:
                self._doubts.add(reason)
            else:
                self._doubts.discard(reason)
            off = bool(self._doubts)
            self._write(lambda: self.tier.in_doubt(off))

    def mark_unreadable(self) -> None:
        self._write(self.tier.mark_unreadable)

    def hide(self, key: bytes) -> None:
        self._write(lambda: self.tier.hide(key))

    def _write(self, write: Callable[[], object]) -> None:
        try:
            write()
        except CacheError as exc:
            self._counters["direct_marks_failed"] += 1
            log.error("co-located readers of L2 may read a copy this server would check first: %s", exc)


class DirectReads:
    """The engine's side of a shared L1 (see the module docstring).

    Args:
        tier: the shared L1.
        state: the key state (engine lock held by every caller but `note_hits`).
        lock: the engine lock.
        policy: L1's eviction policy.
        feed: the demand-read feed.
        counters: the engine's counters ("direct_hit_keys").
    """

    def __init__(
        self,
        tier: SharedTier,
        state: KeyState[Any],
        lock: AbstractContextManager[Any],
        policy: EvictionPolicy,
        feed: ReadFeed,
        counters: Counter[str],
    ) -> None:
        self.tier = tier
        self._state = state
        self._lock = lock
        self._policy = policy
        self._feed = feed
        self._counters = counters
        self.owned: Callable[[bytes], bool] | None = None
        """Which keys may be read directly (a cluster node's: the keys it owns); None: any."""
        self.held = False
        """No key may be published while set (`Engine.hold_direct_reads`)."""
        tier.publisher = self.publishable

    def publishable(self, key: bytes) -> float | None:
        """Until when (Unix seconds, 0: no limit) co-located clients may read `key` as it is; None when a read
        must go through the engine (engine lock held)."""
        state = self._state
        if self.held or state.unvouched(key) or state.hidden(key) or state.checks_freshness:
            return None
        if self.owned is not None and not self.owned(key):
            return None
        return float(state.expires_at(key))

    def conceal(self, keys: Sequence[bytes]) -> None:
        """`keys` are read through the engine until it serves them again (engine lock held)."""
        self.tier.conceal(keys)

    def conceal_all(self) -> None:
        """Every key is read through the engine until it serves it again (engine lock held)."""
        self.tier.conceal_all()

    def note_hits(self) -> int:
        """Tells L1's policy and the demand-read feed of the keys read directly since the last call (each as
        one reference); returns how many."""
        with self._lock:
            keys = self.tier.take_hits()
            for key in keys:
                self._policy.on_access(key)
            self._counters["direct_hit_keys"] += len(keys)
        if keys:
            self._feed.publish(keys)
        return len(keys)
