"""The read path: what a get does below the engine's checks, from the cache tiers to the fill chain.

A read looks in the cache tiers first (`look`): L1 under the engine lock,
L2 (local disk) outside it, each such read registered in `Placement.reads`,
so a copy removed or replaced meanwhile is read again and a value read while
the key was written is answered but never counted or promoted. A hit below
L1 is promoted. A miss to fill joins the key's fill (`races.Fills`) in the
critical section that saw the miss, so a write after it invalidates the
fill; the leader reads the fill chain (`fillchain`: peers, then object
storage) outside the lock and caches the value: in L1 under the lock, in L2
outside it (`_fill_disk`: room reserved under the lock, the key's `KeyLocks`
stripe held so no put or delete of the key interleaves). With revalidation
(`KeyState` freshness), a due hit first checks its object (one HEAD, outside
the lock) and drops a copy whose object changed.

`ReadPath` is handed the key state, the placement, the races and the chain it
acts on; it never calls the engine that built it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheclient.wire.ranges import is_range_key
from cachesvc.engine.behind import Behind
from cachesvc.engine.fillchain import FillChain
from cachesvc.engine.keystate import KeyState
from cachesvc.engine.namespaces import Hit, Namespaces, WriteMode
from cachesvc.engine.placement import Level, Placement
from cachesvc.engine.races import Fill, Fills, KeyLocks, Read
from cachesvc.engine.versions import VersionClock
from cachesvc.engine.writeback import WriteBack, against_store
from cachesvc.errors import CacheError, CorruptValue, TierFull, TierUnavailable
from cachesvc.tiers.base import Entry, RevalidatingTier, SharedTier, Tier, VersionedTier

__all__ = ["AroundVouching", "Looked", "ReadPath", "ToFill"]

log = logging.getLogger(__name__)


class AroundVouching(Protocol):
    """Vouches copies in bulk (`cachesvc.engine.vouching.BulkVouching`)."""

    def vouch_around(self, key: bytes) -> None:
        """Vouches (or drops) the copy of `key` and its neighbours from one listing, when a listing can tell."""


@dataclass(slots=True)
class ToFill:
    """A miss to fill; `fill` is the fill it joined, in the critical section that saw the miss (None: not joined)."""

    fill: Fill | None = None
    leads: bool = False


Looked = Hit | ToFill | None
"""What the cache tiers answered for one key: a hit, a miss to fill, or a miss not to fill (expired, cache-only)."""


class ReadPath:
    """Reads through the cache tiers and, on a miss, the fill chain (see the module docstring).

    Args:
        placement: the cache tiers.
        state: the key state.
        lock: the engine lock, which guards `placement` and `state`.
        locks: the per-key locks that order a key's writes (a fill's disk write takes its key's).
        fills: the fills in flight.
        chain: where a miss is read from; empty for a cache with nothing below it.
        l3: object storage (what a revalidation asks), or None.
        namespaces: which keys are cache-only (never filled).
        counters: the engine's counters.
        fill_l2: whether a value filled into L1 is also written to L2.
        io_timeout: seconds a reader waits for a fill another reader leads.
        versions: the node's version clock (moved past every filled value's version).
        writeback: the upload queue (an unvouched dirty copy found stale leaves it), or None.
        behind: where a fill's L2 write goes once its value is in L1 (`behind.Behind`), or None: the
            reader that led the fill writes it.
    """

    def __init__(
        self,
        *,
        placement: Placement,
        state: KeyState[Level],
        lock: threading.RLock,
        locks: KeyLocks,
        fills: Fills,
        chain: FillChain,
        l3: Tier | None,
        namespaces: Namespaces,
        counters: Counter[str],
        fill_l2: bool,
        io_timeout: float,
        versions: VersionClock,
        writeback: WriteBack | None = None,
        behind: Behind | None = None,
    ) -> None:
        self._placement = placement
        self._state = state
        self._lock = lock
        self._locks = locks
        self._fills = fills
        self._chain = chain
        self._l3 = l3
        self._namespaces = namespaces
        self._counters = counters
        self._fill_l2 = fill_l2
        self._io_timeout = io_timeout
        self._versions = versions
        self._writeback = writeback
        self._behind = behind
        self.bulk: AroundVouching | None = None
        """Vouches a copy's listing page before its read checks it alone (`cachesvc.engine.vouching`); None: none."""
        top = placement.levels[0] if placement.levels else None
        self._shared = top.tier if top is not None and isinstance(top.tier, SharedTier) else None
        """L1 when co-located clients read it (`cachesvc.tiers.arena`): a hit served here publishes its key."""

    def _fillable(self, key: bytes) -> bool:
        return self._l3 is not None and self._namespaces.of(key).write_mode is not WriteMode.CACHE_ONLY

    def read(self, key: bytes, release: bool = False) -> Hit | None:
        """`Engine.get` after validation: the cache tiers, then (a miss) the fill chain."""
        if self._state.any_unvouched:
            self._vouch(key)
        if self._state.checks_freshness:
            self._revalidate(key)
        [found] = self.look([key], release, join=True, count="gets")
        if isinstance(found, Hit):
            return found
        entry = self._fill(key, found) if found is not None else None
        with self._lock:
            if entry is None:
                self._counters["misses"] += 1
            else:
                self._counters["hits_l3"] += 1
                self._counters["hit_bytes_l3"] += len(entry.value)
        return Hit(entry.value, entry.checksum, "l3") if entry is not None else None

    def look(self, keys: Sequence[bytes], release: bool, *, join: bool, count: str = "") -> list[Looked]:
        """What the cache tiers hold of `keys` (see `Looked`), each counted under `count` when given.

        L1 is read under the engine lock; L2 outside it, each read registered
        in `Placement.reads`: a copy removed or replaced meanwhile is read
        again, and a value read while the key was written is answered but
        not counted as a hit or promoted. With `join`, a miss to fill joins
        the key's fill in the critical section that saw the miss, so a write
        that comes after it invalidates the fill.
        """
        looked: list[Looked] = [None] * len(keys)
        todo: Sequence[int] = range(len(keys))
        below = self._placement.unlocked
        first = True
        while todo:
            reading: list[tuple[int, Read]] = []
            with self._lock:
                if first:
                    first = False
                    self._placement.expire_due()
                    if count:
                        self._counters[count] += len(keys)
                for i in todo:
                    key = keys[i]
                    if self._state.hidden(key):
                        continue
                    if self._state.expired(key):
                        self._placement.expire_key(key)
                        continue
                    found = self._placement.read(key, self._placement.locked)
                    if found is not None:
                        looked[i] = self._hit(key, *found, release)
                    elif below is not None:
                        reading.append((i, self._placement.reads.begin(key)))
                    else:
                        looked[i] = self._to_fill(key, join)
            if not reading:
                break
            assert below is not None
            read = [(i, ticket, *self._read_below(below, keys[i])) for i, ticket in reading]
            again: list[int] = []
            with self._lock:
                for i, ticket, entry, corrupt in read:
                    key = keys[i]
                    unchanged = self._placement.reads.end(ticket)
                    if corrupt or (entry is None and not unchanged):
                        if corrupt and unchanged:
                            self._placement.drop_corrupt(below, key)
                        again.append(i)
                    elif entry is None:
                        looked[i] = self._to_fill(key, join)
                    elif unchanged:
                        looked[i] = self._hit(key, below, entry, release)
                    else:
                        looked[i] = Hit(entry.value, entry.checksum, below.name)  # overlapped a write
            todo = again
        return looked

    @staticmethod
    def _read_below(level: Level, key: bytes) -> tuple[Entry | None, bool]:
        """`key` read from `level` outside the engine lock, and whether its copy failed its checksum."""
        try:
            return level.tier.get(key), False
        except CorruptValue:
            return None, True

    def _hit(self, key: bytes, level: Level, entry: Entry, release: bool) -> Hit:
        """Counts a hit in `level`, promotes it to L1, and ends its lease when asked (engine lock held)."""
        level.hits += 1
        self._counters[f"hits_{level.name}"] += 1
        self._counters[f"hit_bytes_{level.name}"] += len(entry.value)
        level.policy.on_access(key)
        if level is not self._placement.levels[0]:
            self._placement.promote(key, entry)
        elif self._shared is not None:
            self._shared.reveal(key)  # served as it is: co-located readers may take it too
        if release and self._state.leased(key) is not None:
            self._counters["leases_released"] += 1
            if self._state.release(key) is not None:
                self._placement.unhold(key)
        return Hit(entry.value, entry.checksum, level.name)

    def _to_fill(self, key: bytes, join: bool) -> ToFill | None:
        """A cache miss on `key`: None when it is not filled (cache-only), else the fill (joined with `join`)."""
        if not self._fillable(key):
            return None
        if not join:
            return ToFill()
        fill, leads = self._fills.join(key)
        if not leads:
            self._counters["fills_joined"] += 1
        return ToFill(fill, leads)

    def peek(self, key: bytes) -> tuple[Entry, Read] | None:
        """`_peek`: the cached value of `key` and a read registered before it was taken (for `BulkVouching`)."""
        return self._peek(key)

    def _peek(self, key: bytes) -> tuple[Entry, Read] | None:
        """The cached value of `key`, not counted as an access, and a read registered before it was taken:
        ended under the lock, it says whether any copy of the key changed since."""
        while True:
            with self._lock:
                ticket = self._placement.reads.begin(key)
                found = self._placement.read(key, self._placement.locked)
                below = self._placement.unlocked
                if found is not None:
                    return found[1], ticket
                if below is None:
                    self._placement.reads.end(ticket)
                    return None
            entry, corrupt = self._read_below(below, key)
            if entry is not None:
                return entry, ticket
            with self._lock:
                unchanged = self._placement.reads.end(ticket)
                if corrupt and unchanged:
                    self._placement.drop_corrupt(below, key)
                elif unchanged:
                    return None

    def _revalidate(self, key: bytes) -> None:
        """Drops the cached copy of `key` when it is due for a check and its object changed (`KeyState` freshness).

        The check (a HEAD) runs outside the engine lock, and only one reader
        per interval makes it: the key counts as checked once one starts.
        When object storage cannot answer, the cached value is served (hits
        are served while it is down) and the next hit checks again.
        """
        with self._lock:
            if not self._state.check_due(key) or not self._fillable(key) or is_range_key(key):
                return
            if self._state.dirty(key) or self._state.leased(key) is not None:
                return  # newer in the cache than in object storage, or promised to stay
            self._state.known_current(key)  # the other readers of this interval need not check
        peeked = self._peek(key)
        if peeked is None:
            return
        entry, ticket = peeked
        assert isinstance(self._l3, RevalidatingTier)
        try:
            unchanged = self._l3.unchanged(key, entry.value, entry.checksum)
        except Exception as exc:
            with self._lock:
                self._placement.reads.end(ticket)
                self._counters["revalidation_errors"] += 1
                self._state.unknown(key)
            level = logging.DEBUG if isinstance(exc, TierUnavailable) else logging.WARNING
            log.log(level, "checking %r against object storage failed; serving the cached value: %s", key[:64], exc)
            return
        with self._lock:
            cached_unchanged = self._placement.reads.end(ticket)
            self._counters["revalidations"] += 1
            if unchanged or not cached_unchanged or self._state.dirty(key):
                return  # current, or replaced through the cache meanwhile
            self._counters["revalidation_refills"] += 1
            self._fills.invalidate(key)
            self._state.forget(key)
            self._placement.drop(key)

    def vouch(self, key: bytes) -> None:
        """Checks an unvouched copy of `key` against object storage now (`_vouch`); nothing when it is vouched."""
        self._vouch(key)

    def _vouch(self, key: bytes) -> None:
        """Checks an unvouched copy of `key` against object storage before it is served (`KeyState`).

        First its listing page (`bulk`, one request for it and up to 999
        neighbours), which vouches or drops most copies; what is left: one
        HEAD, outside the engine lock. A clean copy is kept when the
        object holds its bytes (it takes the object's version); a dirty one
        when the object is missing or not newer than it (it is then uploaded
        as usual). Then the fill chain's peers are asked whether one holds a
        newer value (`FillChain.newer_elsewhere`: the node that stood in for
        this one may have taken a write-back value S3 does not have yet).
        Otherwise the copy goes and the read fills the key anew (from that
        peer first).
        A cache-only key has nothing to check against and is kept. When
        object storage cannot answer, the read fails (`TierUnavailable`):
        an unvouched copy is never served.
        """
        with self._lock:
            if not self._state.unvouched(key):
                return
            if not self._fillable(key) or is_range_key(key) or not isinstance(self._l3, VersionedTier):
                self._state.vouch(key)
                return
        if self.bulk is not None:
            self.bulk.vouch_around(key)  # one listing for this copy and its neighbours, not a HEAD for it alone
        with self._lock:
            if not self._state.unvouched(key):
                return
            dirty, ours = self._state.dirty(key), self._state.version(key)
        peeked = self._peek(key)
        if peeked is None:
            with self._lock:
                self._state.vouch(key)
            return
        entry, ticket = peeked
        assert isinstance(self._l3, VersionedTier)
        try:
            if dirty:
                # A newer object holding these bytes keeps the copy, dirty at its own version: its upload finds
                # the same match and marks it clean (`WriteBack.upload`), with no second PUT.
                checked = against_store(self._l3, key, entry, ours)
                keep, version, seen = not checked.superseded, ours, checked.seen
            else:
                found = self._l3.vouch(key, entry.value, entry.checksum)
                keep, version = found is not None, found or 0
                seen = version  # the newest version this check read (the clock observes it)
            # The node that held the key meanwhile may have taken a newer value S3 lacks (write-back).
            newer = keep and self._chain.newer_elsewhere(key, max(version, seen))
            keep = keep and not newer
        except Exception as exc:
            with self._lock:
                self._placement.reads.end(ticket)
                self._counters["vouch_errors"] += 1
            if isinstance(exc, TierUnavailable):
                raise
            raise TierUnavailable(
                f"cannot check the cached copy of {key[:64]!r} against object storage: {exc}"
            ) from exc
        with self._lock:
            unchanged = self._placement.reads.end(ticket)
            if not unchanged or not self._state.unvouched(key):
                return  # replaced meanwhile (a put or a fill vouches for its own copy)
            self._counters["vouch_checks"] += 1
            if seen:
                self._versions.observe(seen)
            if keep:
                self._state.vouch(key)
                if not dirty:
                    self._state.known_current(key)  # just checked: a revalidation is not due
                if version:
                    self._state.set_version(key, version)
                    self._versions.observe(version)
                return
            self._counters["vouch_drops"] += 1
            if newer:
                self._counters["vouch_newer_at_peer"] += 1
            self.drop_stale(key)

    def drop_stale(self, key: bytes) -> None:
        """Drops an unvouched copy of `key` found stale (engine lock held).

        Raises:
            CacheError: a tier kept its copy (LMDB's map full even for a delete): it stays unvouched.
        """
        # Not vouched first: that would take its marker out of L2's file, and a co-located reader of the
        # file could read the stale copy before the drop below (the Jepsen runs read one, after a drain
        # was undone). `forget` leaves the marker to go with the copy.
        self._fills.invalidate(key)
        self._state.forget(key)
        if self._writeback is not None:
            self._writeback.dequeue(key)
        try:
            self._placement.drop(key)
        except CacheError:
            # Checked again at its next read, not served as it is (its marker in L2's file is still there).
            self._state.unvouch([key])
            raise

    def _fill(self, key: bytes, miss: ToFill) -> Entry | None:
        """Reads `key` through the fill chain into the cache, once however many callers miss at once.

        The fill is resolved whatever happens after the fetch, so readers
        waiting on it never hang on a failed placement.
        """
        fill = miss.fill
        assert fill is not None
        if not miss.leads:
            return fill.wait(self._io_timeout)
        began = time.perf_counter()
        try:
            filled = self._chain.fetch(key)
        except BaseException as exc:
            with self._lock:
                self._count_fetch(began)
                self._fills.finish(fill)
                if isinstance(exc, CorruptValue):
                    self._counters["checksum_failures"] += 1
                elif isinstance(exc, TierUnavailable):
                    self._counters["l3_errors"] += 1
            fill.fail(exc)
            raise
        entry = filled.entry if filled is not None else None
        handed = False
        try:
            handed = self._cache_fill(key, fill, entry, began)
        finally:
            fill.resolve(entry)
            if not handed:
                with self._lock:
                    self._fills.finish(fill)
        return entry

    def _count_fetch(self, began: float) -> None:
        """One fill-chain read and its time (engine lock held), for the S3 latency metric."""
        self._counters["l3_fetches"] += 1
        self._counters["l3_fetch_micros"] += int((time.perf_counter() - began) * 1e6)

    def _cache_fill(self, key: bytes, fill: Fill, entry: Entry | None, began: float) -> bool:
        """Caches a filled value: in L1 under the engine lock, in L2 outside it (`_fill_disk`); a full
        cache only skips it. Nothing is cached once a write invalidated the fill.

        Returns True when the L2 write was handed to `behind` (the value is in L1): the fill stays in the
        table, so a write of the key invalidates it, until that write finishes it.
        """
        below = self._placement.unlocked
        with self._lock:
            self._count_fetch(began)
            if entry is None or fill.invalidated:
                return False
            self._counters["fills"] += 1
            self._counters["fill_bytes"] += len(entry.value)
            self._state.set_version(key, entry.version)
            self._state.vouch(key)
            self._versions.observe(entry.version)
            if entry.dirty and self._writeback is not None and not self._state.dirty(key):
                # A peer's value it could not upload, taken over (`FillChain`): uploaded from here.
                self._state.mark_dirty(key)
                self._writeback.queue(key)
            try:
                level = self._placement.place(key, entry.value, entry.checksum, self._placement.locked)
            except CacheError as exc:
                level = None
                log.debug("a filled value was not cached in memory: %s", exc)
            if level is not None:
                self._state.known_current(key)
            to_disk = (
                below is not None and below.fits_at_all(key, len(entry.value)) and (level is None or self._fill_l2)
            )
            if not to_disk:
                if level is None:
                    self._counters["fills_not_cached"] += 1
                return False
            dirty, expires_at = self._state.dirty(key), self._state.expires_at(key)
            # A dirty value (a peer's, not uploaded) is on disk before the read is answered, as a put's is.
            behind = self._behind if level is not None and not dirty else None
            later = behind is not None and self._roomy(level)
            if behind is not None and not later:
                behind.hurry()
            fill.behind = behind is not None
        fill.resolve(entry)  # the readers waiting on it need not wait for the disk
        assert below is not None
        if behind is not None:
            if later and behind.defer(self._fill_later(key, entry.version, below)):
                return False  # the fill leaves the table now: the deferred copy checks the key's version

            def write() -> None:
                try:
                    self._fill_disk(key, fill, entry, below, dirty, expires_at)
                finally:
                    with self._lock:
                        self._fills.finish(fill)

            if behind.submit(write, len(entry.value)):
                return True
            fill.behind = False
        written = self._fill_disk(key, fill, entry, below, dirty, expires_at)
        with self._lock:
            if level is None and written:
                self._state.known_current(key)
            elif level is None:
                self._counters["fills_not_cached"] += 1
        return False

    def _roomy(self, level: Level | None) -> bool:
        """Whether `level` is L1, shared with co-located readers (who read it, not L2), and at most half full:
        a fill's L2 copy can wait for a quiet server (`Behind.defer`), since L1 is not about to evict it.
        Engine lock held."""
        if self._shared is None:
            return False
        top = self._placement.levels[0]
        capacity = top.tier.capacity_bytes
        return level is top and capacity is not None and 2 * (top.tier.used_bytes + top.reserved) <= capacity

    def _fill_later(self, key: bytes, version: int, level: Level) -> Callable[[], None]:
        """The deferred L2 write of a value filled into L1 at `version`: run once the server is quiet, it copies
        L1's copy into `level` if L1 still holds that version, clean and vouched for, and `level` does not."""

        def write() -> None:
            with self._locks(key):  # no put or delete of the key until it is done
                top = self._placement.levels[0]
                with self._lock:
                    state = self._state
                    if state.version(key) != version or state.dirty(key) or state.unvouched(key) or state.hidden(key):
                        return  # written over, or no longer a copy this node vouches for (a move): not copied
                    if not top.tier.contains(key):
                        return
                    try:
                        entry = top.tier.get(key)
                    except CorruptValue:
                        self._counters["checksum_failures"] += 1
                        return
                    if entry is None or not level.fits_at_all(key, len(entry.value)):
                        return
                    ticket = self._placement.reads.begin(key)  # an eviction or drop of the key meanwhile ends it
                    expires_at = state.expires_at(key)
                entry = Entry(entry.value, entry.checksum, False, version)  # as filled (L1 may keep no version)
                try:
                    written = self._write_disk(key, entry, level, False, expires_at, lambda: ticket.invalidated)
                finally:
                    with self._lock:
                        self._placement.reads.end(ticket)
                if written:
                    with self._lock:
                        self._counters["l2_fills_later"] += 1

        return write

    def _fill_disk(self, key: bytes, fill: Fill, entry: Entry, level: Level, dirty: bool, expires_at: float) -> bool:
        """Writes a filled value into `level` (local disk) outside the engine lock; returns whether it is there.

        The key's `KeyLocks` stripe is held throughout, so no put or delete of
        the key interleaves; the room is reserved under the engine lock; a
        drop that invalidated the fill meanwhile (a revalidation) undoes it.
        """
        with self._locks(key):
            return self._write_disk(key, entry, level, dirty, expires_at, lambda: fill.invalidated)

    def _write_disk(
        self, key: bytes, entry: Entry, level: Level, dirty: bool, expires_at: float, stale: Callable[[], bool]
    ) -> bool:
        """`_fill_disk`'s write, its key's stripe held; `stale` (asked under the engine lock) says the copy was
        removed or replaced meanwhile: nothing is written, or what was is dropped."""
        with self._lock:
            if stale():
                return False
            try:
                reserved = self._placement.reserve(level, key, len(entry.value))
            except CacheError as exc:
                log.debug("fill into %s skipped: %s", level.name, exc)
                return False
        written = False
        try:
            if level.tier.contains(key):
                return False  # demoted there meanwhile
            for _ in range(3):
                try:
                    level.tier.put(
                        key, entry.value, entry.checksum, dirty=dirty, expires_at=expires_at, version=entry.version
                    )
                    written = True
                    break
                except TierFull:
                    # The tier's own limit (LMDB's map) is tighter than its budget said.
                    with self._lock:
                        self._placement.make_room(level, reserved)
        except CacheError as exc:
            log.debug("fill into %s skipped: %s", level.name, exc)
        finally:
            with self._lock:
                self._placement.settle(level, key, reserved, written=written)
                if written and stale():
                    self._placement.drop(key)
                    written = False
        return written

    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` into the cache ahead of a read, without counting as one.

        Returns the bytes fetched from object storage: 0 when the key was
        already cached, None when object storage does not have it.
        """
        below = self._placement.unlocked
        with self._lock:
            self._counters["prefetches"] += 1
        miss: ToFill | None = None
        while miss is None:
            with self._lock:
                if self._placement.holder(key, self._placement.locked) is not None:
                    return 0
                ticket = self._placement.reads.begin(key)
            there = below is not None and below.tier.contains(key)
            with self._lock:
                if not self._placement.reads.end(ticket):
                    continue  # a copy changed meanwhile: look again
                if there:
                    return 0
                if self._state.hidden(key) or not self._fillable(key):
                    return None
                miss = self._to_fill(key, join=True)
        entry = self._fill(key, miss)
        if entry is None:
            return None
        with self._lock:
            self._counters["prefetched_bytes"] += len(entry.value)
        return len(entry.value)

    def cached_tier(self, key: bytes) -> Level | None:
        """The fastest cache tier holding `key`, or None (expired and hidden keys are not held). Not an access."""
        with self._lock:
            if self._state.hidden(key) or self._state.expired(key):
                return None
            level = self._placement.holder(key, self._placement.locked)
        if level is None:
            below = self._placement.unlocked
            level = below if below is not None and below.tier.contains(key) else None
        return level
