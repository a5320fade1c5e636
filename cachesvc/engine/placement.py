"""Placement: which cache tier holds a value, and what is evicted to make room.

The cache tiers form a stack (L1 memory, then L2 local disk). A value goes
into the fastest tier it fits in; when that tier is full of values that may
not be evicted (leased, or dirty with nowhere below to go), it falls through
to the next tier instead of failing. An L1 victim is demoted into L2 unless L2
already holds it; an L2 victim is dropped (object storage has it, or it was
never to be stored there). A value that must not be evicted is *held*: it is
kept out of its tier's policy, so the policy never offers it as a victim.

Eviction decisions come from each tier's policy; only this module deletes
bytes to make room. Its bookkeeping runs under the engine lock; nothing here
touches object storage. The last tier may be marked as read outside the lock
(local disk: LMDB reads are lock-free snapshots): the engine reads it there,
registered in `reads` (`races.Reads`), which this module invalidates whenever
it removes or replaces a copy of the key; and a value can be written into it
outside the lock in the room `reserve` makes (`settle` then lets its policy
see it). It also carries out what the key state says ran out (`expire_due`:
leases end, keys past their TTL go).

Every key a tier takes in, and every key no tier holds any more, is reported
to the `KeyIndex` (the digests a client's local KV index follows).

A tier's policy may also decline a key (`admit`) and name keys to evict at
once (`excess`): tenants' priorities and quotas (`cachesvc.policy.tenants`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from cachesvc.engine.keyindex import KeyIndex
from cachesvc.engine.keystate import KeyState
from cachesvc.engine.races import Reads
from cachesvc.errors import CacheError, CorruptValue, TierFull
from cachesvc.policy.base import EvictionPolicy
from cachesvc.tiers.base import Entry, MarkableTier, Tier

__all__ = ["Level", "Placement"]

log = logging.getLogger(__name__)


class Level:
    """A cache tier with its eviction policy and counters.

    Args:
        tier: the tier.
        policy: its eviction policy.
        reads_unlocked: whether the tier's reads run outside the engine lock
            (safe from any thread while others write it); only the last tier.
    """

    def __init__(self, tier: Tier, policy: EvictionPolicy, *, reads_unlocked: bool = False) -> None:
        self.tier = tier
        self.policy = policy
        self.reads_unlocked = reads_unlocked
        self.hits = 0
        self.evictions = 0
        self.reserved = 0
        """Bytes set aside for values being written outside the engine lock (`Placement.reserve`)."""

    @property
    def name(self) -> str:
        return self.tier.name

    def fits_at_all(self, key: bytes, size: int) -> bool:
        capacity = self.tier.capacity_bytes
        return capacity is None or self.tier.cost(key, size) <= capacity


def _admitted(level: Level, key: bytes, needed: int, full: bool) -> bool:
    """Whether `level`'s policy lets `key` in (a tenant-aware one may not: `cachesvc.policy.tenants`)."""
    admit = getattr(level.policy, "admit", None)
    return admit is None or bool(admit(key, needed, full))


class Placement:
    """The cache tiers, fastest first, and the moves between them. Callers hold the engine lock.

    Args:
        levels: the cache tiers, fastest first.
        state: what is known of each key beyond its bytes (leases, dirty flags,
            expiry): placement reads it, and tells it when a key left every tier.
        counters: the engine's counters (evictions, demotions, promotions).
        index: told of every key the tiers take in and every key they no longer hold.
    """

    def __init__(
        self,
        levels: Sequence[Level],
        state: KeyState[Level],
        counters: Counter[str],
        index: KeyIndex | None = None,
    ) -> None:
        self.levels = list(levels)
        if any(level.reads_unlocked for level in self.levels[:-1]):
            raise ValueError("only the last cache tier may be read outside the engine lock")
        self.locked = [level for level in self.levels if not level.reads_unlocked]
        """The tiers read under the engine lock, fastest first."""
        self.unlocked = self.levels[-1] if self.levels[-1].reads_unlocked else None
        """The tier read outside the engine lock, if any (the last)."""
        self.reads = Reads()
        """The reads of the last tier in flight outside the engine lock (see the module docstring)."""
        self._state = state
        self._counters = counters
        self._index = index if index is not None else KeyIndex([])
        self.refused: list[str] = []
        """Why each tier refused the value the last `place` found no room for (under the engine lock)."""

    def below(self, level: Level) -> Level | None:
        index = self.levels.index(level)
        return self.levels[index + 1] if index + 1 < len(self.levels) else None

    def is_last(self, level: Level) -> bool:
        return level is self.levels[-1]

    def held(self, level: Level, key: bytes) -> bool:
        """Whether `key` in `level` stays out of the policy: leased there, or dirty in the last tier
        (it has nowhere else to go before its upload)."""
        return self._state.leased_in(key, level) or (self.is_last(level) and self._state.dirty(key))

    def fits_anywhere(self, key: bytes, size: int) -> bool:
        return any(level.fits_at_all(key, size) for level in self.levels)

    def holder(self, key: bytes, levels: Sequence[Level] | None = None) -> Level | None:
        """The fastest tier (of `levels`, default all) holding `key`."""
        for level in self.levels if levels is None else levels:
            if level.tier.contains(key):
                return level
        return None

    # -- reads -------------------------------------------------------------

    def read(self, key: bytes, levels: Sequence[Level]) -> tuple[Level, Entry] | None:
        """The value from the fastest of `levels` that holds a readable copy; corrupt copies are dropped."""
        for level in levels:
            try:
                entry = level.tier.get(key)
            except CorruptValue:
                self.drop_corrupt(level, key)
                continue
            if entry is not None:
                return level, entry
        return None

    def drop_corrupt(self, level: Level, key: bytes) -> None:
        """Drops the copy of `key` in `level` that failed its checksum."""
        self._counters["checksum_failures"] += 1
        log.warning("%s: dropped a value that failed its checksum", level.name)
        self.reads.invalidate(key)
        level.tier.delete(key)
        level.policy.on_delete(key)
        if self.holder(key) is None:
            self._index.removed(key)

    def promote(self, key: bytes, entry: Entry) -> None:
        """Copies a value found below L1 into L1 (best effort: skipped when L1 has no room)."""
        top = self.levels[0]
        if not top.fits_at_all(key, len(entry.value)):
            return
        try:
            self.install(top, key, entry.value, entry.checksum)
            self._counters["promotions"] += 1
        except CacheError as exc:
            log.debug("promotion of a key skipped: %s", exc)

    # -- writes ------------------------------------------------------------

    def place(self, key: bytes, value: bytes, checksum: int, levels: Sequence[Level] | None = None) -> Level | None:
        """Puts a value in the fastest tier (of `levels`, default all) with room; None when none has any.

        A tier whose resident values cannot be evicted (all held) is skipped
        for the next one down.
        """
        self.refused = []
        for level in self.levels if levels is None else levels:
            if not level.fits_at_all(key, len(value)):
                self.refused.append(f"{level.name}: larger than the tier")
                continue
            try:
                self.install(level, key, value, checksum)
                return level
            except TierFull as exc:
                self._counters[f"placement_fell_through_{level.name}"] += 1
                self.refused.append(str(exc))
                log.debug("%s full of held values, trying the next tier: %s", level.name, exc)
        return None

    def install(self, level: Level, key: bytes, value: bytes, checksum: int) -> None:
        """Stores a value in `level`, evicting its policy's victims to make room.

        Raises:
            TierFull: what is left in the tier cannot be evicted (held values,
                or dirty victims that have nowhere to go).
        """
        tier = level.tier
        # A replaced value frees its space first; on_insert below counts the
        # new one as a reference to the key. A dirty key's copy in the last
        # tier is overwritten in place instead (the tier's put replaces it in
        # one step): deleted first, a kill between the two would lose the
        # acknowledged value it holds, which object storage lacks.
        overwrite = self.is_last(level) and self._state.dirty(key) and tier.contains(key)
        if overwrite or tier.delete(key):
            self.reads.invalidate(key)
            level.policy.on_evict(key)
        needed = tier.cost(key, len(value))
        capacity = tier.capacity_bytes
        assert capacity is not None
        if not _admitted(level, key, needed, tier.used_bytes + level.reserved + needed > capacity):
            raise TierFull(f"{tier.name}: not admitted: it would evict keys of a higher priority, or exceed its quota")
        refused: TierFull | None = None
        for _ in range(3):
            capacity = tier.capacity_bytes  # the tier may lower it (L2's headroom): read it on every try
            assert capacity is not None
            while tier.used_bytes + level.reserved + needed > capacity:
                if overwrite and level.policy.victim() is None:
                    # Room only the old copy takes (counted twice above): it goes first after all.
                    tier.delete(key)
                    overwrite = False
                    continue
                self._evict_for_room(level, needed)
            try:
                tier.put(
                    key,
                    value,
                    checksum,
                    dirty=self._state.dirty(key),
                    expires_at=self._state.expires_at(key),
                    version=self._state.version(key),
                )
            except TierFull as exc:
                # The tier's own limit (LMDB's map) is tighter than the estimate:
                # evict one more and try again.
                refused = exc
                self._evict_for_room(level, needed)
                continue
            if not self.held(level, key):
                level.policy.on_insert(key, needed)
            self._index.admitted(key)
            self._trim(level)
            return
        raise TierFull(f"{tier.name}: could not make room for a {needed}-byte entry ({refused})")

    def reserve(self, level: Level, key: bytes, size: int) -> int:
        """Makes room in `level` for a value of `size` bytes written outside the engine lock; returns the
        bytes set aside, which `settle` gives back.

        Raises:
            TierFull: what is left in the tier cannot be evicted.
        """
        needed = level.tier.cost(key, size)
        while True:
            capacity = level.tier.capacity_bytes  # read on every pass: the tier may lower it as it evicts
            assert capacity is not None
            if level.tier.used_bytes + level.reserved + needed <= capacity:
                break
            self._evict_for_room(level, needed)
        level.reserved += needed
        return needed

    def settle(self, level: Level, key: bytes, reserved: int, *, written: bool) -> None:
        """Gives back the room `reserve` set aside; with `written` (the value is in the tier now), the policy
        and the key index learn of it."""
        level.reserved -= reserved
        if written:
            if not self.held(level, key):
                level.policy.on_insert(key, reserved)
            self._index.admitted(key)
            self._trim(level)

    def _trim(self, level: Level) -> None:
        """Evicts the keys of tenants over their quota in `level` (`cachesvc.policy.tenants`), right away."""
        excess = getattr(level.policy, "excess", None)
        while excess is not None and (victim := excess()) is not None:
            try:
                self.evict(level, victim)
            except TierFull as exc:  # a dirty key with nowhere to go: it stays, over the quota, until uploaded
                log.warning("%s: a tenant stays over its quota: %s", level.name, exc)
                return

    def make_room(self, level: Level, needed: int) -> None:
        """Evicts one more of `level`'s victims (the tier's own limit is tighter than its budget said).

        Raises:
            TierFull: nothing is left to evict.
        """
        self._evict_for_room(level, needed)

    def _evict_for_room(self, level: Level, needed: int) -> None:
        victim = level.policy.victim()
        if victim is None:
            raise TierFull(f"{level.name}: nothing left to evict for a {needed}-byte entry (every value is held)")
        self.evict(level, victim)

    def evict(self, level: Level, victim: bytes) -> None:
        """Removes `victim` from `level`, demoting it into the tier below first when that one lacks it.

        Raises:
            TierFull: the victim is dirty and the tier below has no room for
                it; it stays where it is (an acknowledged write is never dropped).
        """
        below = self.below(level)
        if below is not None and not below.tier.contains(victim):
            entry: Entry | None = None
            try:
                entry = level.tier.get(victim)
            except CorruptValue:
                self._counters["checksum_failures"] += 1
            if entry is not None and below.fits_at_all(victim, len(entry.value)):
                try:
                    self.install(below, victim, entry.value, entry.checksum)
                    self._counters["demotions"] += 1
                except CacheError as exc:
                    if self._state.dirty(victim):
                        raise TierFull(f"cannot demote a dirty value out of {level.name}: {exc}") from exc
            elif entry is not None and self._state.dirty(victim):
                raise TierFull(f"a dirty value in {level.name} fits in no tier below")
        self.reads.invalidate(victim)
        level.tier.delete(victim)
        level.policy.on_evict(victim)
        level.evictions += 1
        self._counters[f"evictions_{level.name}"] += 1
        if self.holder(victim) is None:
            self._state.evicted(victim)
            self._index.removed(victim)

    def drop(self, key: bytes, *, forget: bool = True, keep: Level | None = None) -> bool:
        """Removes every cached copy of `key` (but the one in `keep`); returns whether any tier held one.

        With `forget=False` (a put replacing the value) the policies keep the
        key's history, so the put that follows counts as one more reference.
        """
        existed = False
        self.reads.invalidate(key)
        for level in self.levels:
            if level is not keep and level.tier.delete(key):
                existed = True
                if not forget:
                    level.policy.on_evict(key)
            if forget:
                level.policy.on_delete(key)
        if existed and (keep is None or not keep.tier.contains(key)):
            self._index.removed(key)
        return existed

    def drop_from(self, level: Level, key: bytes) -> None:
        """Removes the copy of `key` in `level` alone (the policy keeps its history)."""
        if level.tier.delete(key):
            self.reads.invalidate(key)
            level.policy.on_evict(key)
            if self.holder(key) is None:
                self._index.removed(key)

    # -- holds -------------------------------------------------------------

    def hold(self, level: Level, key: bytes) -> None:
        """Takes `key` out of `level`'s policy: it is not a victim until `unhold`."""
        level.policy.on_delete(key)

    def unhold(self, key: bytes, *, uploaded: bool = False) -> None:
        """Makes every resident copy of `key` evictable again (unless it is still held).

        With `uploaded` (object storage has the value now), also clears the
        dirty flag each tier stored with it: a persistent tier re-queues
        flagged values when it is reopened, so a restart would upload them
        again. Best effort: a tier that cannot rewrite the entry keeps the
        flag, which costs one needless upload after a restart, never a value.
        Each copy is read once, and only when there is something to do.
        """
        for level in self.levels:
            evictable = key not in level.policy and not self.held(level, key)
            if not (evictable or uploaded):
                continue
            if uploaded and isinstance(level.tier, MarkableTier):
                # A large value's flag is in its index entry: cleared there, its bytes neither read nor rewritten.
                version, expires_at = self._state.version(key), self._state.expires_at(key)
                try:
                    size = level.tier.mark_clean(key, version=version, expires_at=expires_at)
                except CacheError as exc:
                    log.debug("%s: the dirty flag of an uploaded value stays: %s", level.name, exc)
                    size = None
                if size is not None:
                    if evictable and size:
                        level.policy.on_insert(key, level.tier.cost(key, size))
                    continue
            try:
                entry = level.tier.get(key)
            except CorruptValue:
                continue
            if entry is None:
                continue
            if uploaded and entry.dirty:
                try:
                    level.tier.put(
                        key,
                        entry.value,
                        entry.checksum,
                        dirty=False,
                        expires_at=self._state.expires_at(key),
                        # The object's version when the upload found it holding these bytes (`WriteBack`).
                        version=self._state.version(key) or entry.version,
                    )
                except CacheError as exc:
                    log.debug("%s: the dirty flag of an uploaded value stays: %s", level.name, exc)
            if evictable:
                level.policy.on_insert(key, level.tier.cost(key, len(entry.value)))

    # -- time limits -------------------------------------------------------

    def expire_due(self) -> None:
        """Carries out what the key state says ran out: leases end (their copies become evictable), keys past
        their TTL go (`expire_key`)."""
        leases, expired = self._state.due()
        for key in leases:
            self.unhold(key)
            self._counters["leases_expired"] += 1
        for key in expired:
            self.expire_key(key)

    def expire_key(self, key: bytes) -> None:
        """`key` passed its TTL: drop it, or (dirty) hide it until its upload, then drop it."""
        self._counters["ttl_expired"] += 1
        if self._state.dirty(key):
            self._state.hide(key)
            self._index.removed(key)  # it reads as a miss from now on
            return
        self._state.evicted(key)
        self.drop(key)

    # -- shutdown ----------------------------------------------------------

    def demote_all(self) -> tuple[int, int]:
        """Copies what L1 holds into L2 within L2's budget, dirty values first; returns (kept, lost).

        Run on a clean stop, so a restart keeps the warm set (L1 is memory).
        A clean value that does not fit is not a loss (object storage or a
        recompute has it); a dirty one is.
        """
        if len(self.levels) < 2:
            return 0, 0
        top, below = self.levels[0], self.levels[1]
        resident = [r.key for r in top.tier.scan()]
        dirty = [key for key in resident if self._state.dirty(key)]
        clean = [key for key in resident if not self._state.dirty(key)]
        kept = lost = 0
        for key in dirty + clean:
            if below.tier.contains(key):
                continue
            entry = top.tier.get(key)
            if entry is None or not below.fits_at_all(key, len(entry.value)):
                lost += key in dirty
                continue
            try:
                self.install(below, key, entry.value, entry.checksum)
                kept += 1
            except CacheError as exc:
                if self._state.dirty(key):
                    lost += 1
                    log.error("lost an unflushed write-back value at shutdown: %s", exc)
        return kept, lost
