"""The write path: what a put, a delete and an eviction do below the engine's checks.

A put is ordered per key by `KeyLocks`: two writes of one key reach object
storage and the cache tiers in the order their stripes were taken, and a
delete is never followed by a stale upload. By write mode (`namespaces`):

- write-through: object storage first, outside the engine lock, then the
  cache; a failed upload drops the cached copy (`_drop_unknown`), since the
  object may hold either value now;
- write-back: the value is cached (L1, and L2 too so a kill does not lose
  it) and queued for `WriteBack`; with nowhere to keep it, it is uploaded
  before the put returns;
- cache-only: cached, never uploaded; no room is `TierFull`.

A durable put (`durable=True`) returns once the value would survive the
machine losing power: in object storage, or written to L2 and synced there
(`SyncedTier.sync_keys`: a large value's file `fdatasync`ed, the index
commit synced; one sync per batch, outside the engine lock). A put that is
not durable and lands in L2 survives the process being killed, not the
machine.

`WritePath` is handed the key state, the placement, the races and the
write-back queue it acts on; it never calls the engine that built it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from cacheclient.wire import MAX_KEY_BYTES
from cacheclient.wire import checksum as xxh3
from cacheclient.wire.ranges import RangeKeyError, is_range_key, parse_range_key
from cachesvc.engine.direct import DiskMarks
from cachesvc.engine.fillchain import FillChain
from cachesvc.engine.keystate import KeyState
from cachesvc.engine.namespaces import Namespaces, WriteMode
from cachesvc.engine.placement import Level, Placement
from cachesvc.engine.races import Fills, KeyLocks
from cachesvc.engine.versions import VersionClock
from cachesvc.engine.writeback import WriteBack, WriteBackGate
from cachesvc.errors import (
    CacheError,
    ChecksumMismatch,
    InvalidKey,
    NotConfigured,
    TierFull,
    TierUnavailable,
    ValueTooLarge,
)
from cachesvc.tiers.base import PlacedFile, SyncedTier, Tier

__all__ = ["Limits", "WritePath"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may name: keys of 1..MAX_KEY_BYTES, values up to `max_value_bytes`."""

    max_value_bytes: int

    def check_key(self, key: bytes) -> None:
        """Raises InvalidKey unless 1 <= len(key) <= MAX_KEY_BYTES and a range key (`cacheclient.wire.ranges`)
        names a valid range; ValueTooLarge when the range is over max_value_bytes."""
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidKey(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        try:
            ranged = parse_range_key(key)
        except RangeKeyError as exc:
            raise InvalidKey(str(exc)) from None
        if ranged is not None:
            self.check_size(ranged.length)

    def check_size(self, size: int) -> None:
        """Raises ValueTooLarge when `size` is over max_value_bytes."""
        if size > self.max_value_bytes:
            raise ValueTooLarge(f"value of {size} bytes is over the limit of max_value_bytes={self.max_value_bytes}")

    def checked_checksum(self, key: bytes, value: bytes, checksum: int | None) -> int:
        """The value's xxh3 after checking key, size and the sender's checksum (a range key is not writable)."""
        self.check_key(key)
        if is_range_key(key):
            raise InvalidKey(f"key {key[:64]!r} names a byte range of an object (reserved, read-only): not writable")
        self.check_size(len(value))
        actual = xxh3(value)
        if checksum is not None and checksum != actual:
            raise ChecksumMismatch(
                f"value of {len(value)} bytes for key {key[:64]!r} does not match its checksum {checksum:016x}"
            )
        return actual


class WritePath:
    """Puts, deletes and evictions across the cache tiers and object storage (see the module docstring).

    Args:
        placement: the cache tiers.
        state: the key state.
        lock: the engine lock, which guards `placement` and `state`.
        locks: the per-key locks that order a key's writes.
        fills: the fills in flight (a write invalidates its key's).
        chain: the fill chain (a delete tells a previous owner first).
        l3: object storage, or None.
        namespaces: each key's write mode, lease and TTL.
        counters: the engine's counters.
        versions: the node's version clock (every write takes the next version).
        limits: what a request may name.
        writeback: the upload queue, or None without object storage.
        marks: what co-located clients must not read from L2's file, or None.
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
        versions: VersionClock,
        limits: Limits,
        writeback: WriteBack | None = None,
        marks: DiskMarks | None = None,
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
        self._versions = versions
        self._limits = limits
        self._writeback = writeback
        self._marks = marks
        self._l2 = next((level for level in placement.levels if level.reads_unlocked), None)
        self.gate: WriteBackGate | None = None
        """Passed by every write-back value before it is acknowledged (a cluster node's; None: none)."""
        self.written: Callable[[bytes], None] | None = None
        """Told of each key once a put or a delete of it is done with object storage (`ListedPages.wrote`)."""

    # -- puts ---------------------------------------------------------------

    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes | PlacedFile, int | None]],
        *,
        lease: float | None,
        ttl: float | None,
        durable: bool,
    ) -> None:
        """`Engine.put_many`: every (key, value, checksum) is validated before any is written.

        A `PlacedFile` is checked from the page cache (its checksum computed
        over the mapped file) and read as bytes by every tier but the one
        that holds the file, which indexes it where it lies.
        """
        self._state.check(lease, ttl)
        if durable:
            self._check_durable([key for key, _, _ in items])
        values = [cast(bytes, value) for _, value, _ in items]  # a PlacedFile has the buffer protocol
        verified = [
            self._limits.checked_checksum(key, value, checksum)
            for (key, _, checksum), value in zip(items, values, strict=True)
        ]
        for (key, _, _), value, actual in zip(items, values, verified, strict=True):
            self._put(key, value, actual, lease, ttl, durable)
        if durable:
            self._sync([key for key, _, _ in items])

    def _sync(self, keys: Sequence[bytes]) -> None:
        """Syncs what a durable put of `keys` left in L2 (its object storage writes need nothing more): the
        values whose mode writes object storage first are durable there already."""
        tier = self._l2.tier if self._l2 is not None else None
        if not isinstance(tier, SyncedTier):
            return
        kept = [key for key in keys if not self._in_object_storage_first(self._namespaces.of(key).write_mode)]
        if kept:
            tier.sync_keys(kept)
            with self._lock:
                self._counters["l2_syncs"] += 1
                self._counters["l2_synced_keys"] += len(kept)

    def _check_durable(self, keys: Sequence[bytes]) -> None:
        """Raises NotConfigured when nothing here can keep a durable put of one of `keys` past a kill."""
        if self._l2 is not None:
            return
        for key in keys:
            if self._l3 is None or self._namespaces.of(key).write_mode is WriteMode.CACHE_ONLY:
                raise NotConfigured(
                    f"key {key[:64]!r} cannot be stored durably here: this server has no local disk tier (l2) "
                    "and its namespace does not write to object storage"
                )

    def _put(
        self, key: bytes, value: bytes, actual: int, lease: float | None, ttl: float | None, durable: bool = False
    ) -> None:
        namespace = self._namespaces.of(key)
        mode = namespace.write_mode
        lease = namespace.lease_seconds if lease is None else lease
        ttl = namespace.ttl_seconds if ttl is None else ttl
        fits = self._placement.fits_anywhere(key, len(value))
        if mode is WriteMode.WRITE_BACK and not fits:
            mode = WriteMode.WRITE_THROUGH
        if mode is WriteMode.CACHE_ONLY and not fits:
            raise TierFull(f"value of {len(value)} bytes fits in no cache tier and key {key[:64]!r} is cache-only")
        gate = self.gate if mode is WriteMode.WRITE_BACK else None
        if gate is not None and not gate.enter():
            # The cluster cannot be told that this node holds a value object storage lacks: write it through.
            mode, gate = WriteMode.WRITE_THROUGH, None
            with self._lock:
                self._counters["write_back_written_through"] += 1
        try:
            self._put_as(key, value, actual, mode, lease, ttl, fits, durable)
        finally:
            if gate is not None:
                gate.leave()

    def _put_as(
        self,
        key: bytes,
        value: bytes,
        actual: int,
        mode: WriteMode,
        lease: float,
        ttl: float,
        fits: bool,
        durable: bool = False,
    ) -> None:
        write_back = self._writeback if mode is WriteMode.WRITE_BACK else None
        with self._locks(key):
            version = self._versions.next()
            if mode is WriteMode.WRITE_THROUGH and self._l3 is not None:
                try:
                    self._l3.put(key, value, actual, version=version)
                except BaseException:
                    self._drop_unknown(key)
                    raise
            reserved = write_back.reserve(key) if write_back is not None else False
            if write_back is not None and self._marks is not None:
                # The old copy kept in L2 (below) must not be read from the file by co-located clients once the
                # new value is served from L1: hidden now (outside the engine lock; the key's stripe is held),
                # it is overwritten with its marker gone in one transaction.
                self._marks.hide(key)
            try:
                with self._lock:
                    # A write-back value keeps the copy on disk until the new one overwrites it in place:
                    # dropped first, a kill in between would lose the acknowledged value before it.
                    self._replace(key, lease, ttl, keep=self._l2 if write_back is not None else None)
                    self._state.set_version(key, version)
                    if write_back is not None:
                        self._state.mark_dirty(key)
                        write_back.queue(key, reserved)
                        reserved = False
                    level = self._cache_put(key, value, actual, mode, lease, fits, durable)
                    on_disk = not durable or self._durable_after_put(key, value, actual, mode, level)
            except BaseException:
                if write_back is not None:
                    write_back.release(reserved)
                raise
            if write_back is not None and (level is None or not on_disk):
                # Nowhere to keep it until the flusher runs: upload it now.
                assert self._l3 is not None
                try:
                    self._l3.put(key, value, actual, version=version)
                finally:
                    with self._lock:
                        self._state.clean(key)
                    write_back.dequeue(key)

    def _in_object_storage_first(self, mode: WriteMode) -> bool:
        """Whether a put in `mode` reaches object storage before the cache (and so is durable there)."""
        return mode is WriteMode.WRITE_THROUGH and self._l3 is not None

    def _durable_after_put(self, key: bytes, value: bytes, actual: int, mode: WriteMode, level: Level | None) -> bool:
        """After a durable put placed its value at `level` (engine lock held): whether it is durable now, written
        to L2 when the mode left it in memory only. False: a write-back value to upload before the put returns.

        Raises:
            NotConfigured: a value nothing can make durable (no room on disk, and no object storage for it).
        """
        if self._in_object_storage_first(mode):
            return True  # in object storage already
        l2 = self._l2
        if level is not None and l2 is not None and (level is l2 or l2.tier.contains(key)):
            return True  # placed there, or kept there too (a write-back value)
        if level is not None and self._keep_on_disk(key, value, actual):
            self._counters["durable_puts_to_disk"] += 1
            return True
        if mode is WriteMode.WRITE_BACK and self._l3 is not None:
            return False
        raise NotConfigured(
            f"value of {len(value)} bytes under key {key[:64]!r} is cached but not durable: "
            "the local disk tier (l2) has no room for it and its namespace does not write to object storage"
        )

    def _replace(self, key: bytes, lease: float, ttl: float, keep: Level | None = None) -> None:
        """Forgets the old value of `key` before a put caches the new one (engine lock held); its copy in
        `keep` stays for the put to overwrite (`_cache_put` drops it if the put does not)."""
        self._counters["puts"] += 1
        self._placement.expire_due()
        self._fills.invalidate(key)
        if self.written is not None:
            self.written(key)
        self._state.replaced(key, keep_lease=lease > 0)
        self._placement.drop(key, forget=False, keep=keep)
        if ttl > 0:
            self._state.expire_after(key, ttl)

    def _cache_put(
        self, key: bytes, value: bytes, actual: int, mode: WriteMode, lease: float, fits: bool, durable: bool = False
    ) -> Level | None:
        """Puts a written value in the cache tiers (engine lock held); returns where it went.

        A durable put whose mode does not write object storage first (a
        checkpoint chunk, say) goes to local disk and not to memory: it must
        be written there before the put returns anyway, and a copy in L1 as
        well took a second copy of every chunk and evicted the hot values
        L1 held (a 264 MiB save through a 64 MiB L1 left nothing else in
        it) for chunks read once, at a restore. It goes to memory only when
        L2 cannot take it. So does a value a co-located client wrote in
        place in L2 (a `PlacedFile`), whatever its durability.

        Raises:
            TierFull: no cache tier has room and nothing below keeps the value.
        """
        level = None
        # A value a co-located client wrote in place in L2 stays there: a copy in memory is a copy more.
        to_disk = (durable and not self._in_object_storage_first(mode)) or isinstance(value, PlacedFile)
        if fits and to_disk and self._l2 is not None:
            levels = self._placement.levels
            level = self._placement.place(key, value, actual, levels[levels.index(self._l2) :])
            if level is not None:
                self._counters["durable_puts_to_disk"] += 1
        if level is None and fits:
            level = self._placement.place(key, value, actual)
        if level is not None and mode is not WriteMode.CACHE_ONLY:
            self._state.known_current(key)
        if mode is WriteMode.WRITE_BACK and level is not self._l2 and self._l2 is not None:
            on_disk = level is not None and self._keep_on_disk(key, value, actual)
            if not on_disk:
                self._placement.drop_from(self._l2, key)  # the old value's copy, kept by `_replace`
        if level is not None and lease > 0:
            self._state.lease(key, level, lease)
            self._placement.hold(level, key)
            self._counters["leases"] += 1
        elif lease > 0:
            self._state.drop_lease(key)
        if level is None:
            self._counters["puts_not_cached"] += 1
            if mode is WriteMode.CACHE_ONLY or self._l3 is None:
                self._state.evicted(key)
                why = "; ".join(self._placement.refused) if fits else "larger than every cache tier"
                raise TierFull(f"no cache tier has room for {len(value)} bytes under key {key[:64]!r} ({why})")
        return level

    def _drop_unknown(self, key: bytes) -> None:
        """After a failed write-through upload, drops the cached copy of `key` (its `KeyLocks` lock held).

        The request may have reached object storage before the answer was
        lost (a reset, a timeout, a 5xx after the write): the object may now
        hold the new bytes. Keeping the old cached value would serve it
        indefinitely while object storage holds other bytes; dropped, the
        next read fetches whichever is there. A dirty value (newer than the
        object) and a leased one stay.
        """
        if self.written is not None:
            self.written(key)  # the object may hold either value now
        with self._lock:
            if self._state.dirty(key) or self._state.leased(key) is not None:
                return
            self.forget(key)
            if self._placement.drop(key):
                self._counters["puts_failed_dropped"] += 1

    def _keep_on_disk(self, key: bytes, value: bytes, actual: int) -> bool:
        """Writes a dirty value into L2 too, so an acknowledged write-back survives a crash (engine lock held);
        returns whether it did.

        Best effort: when L2 has no room (full of values awaiting upload) the
        value stays in L1 only until the flusher uploads it, and is counted.
        """
        l2 = self._l2
        if l2 is None or not l2.fits_at_all(key, len(value)):
            return False
        try:
            self._placement.install(l2, key, value, actual)
        except CacheError as exc:
            self._counters["writeback_memory_only"] += 1
            log.debug("a write-back value stays in memory only until uploaded: %s", exc)
            return False
        return True

    # -- deletes and evictions ------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """`Engine.delete` after validation: object storage first, then every cached copy."""
        fills_from_l3 = self._l3 is not None and self._namespaces.of(key).write_mode is not WriteMode.CACHE_ONLY
        with self._locks(key):
            existed = False
            if self._chain and not is_range_key(key):
                # Before object storage: a previous owner's copy not yet uploaded must not be uploaded after.
                self._chain.drop(key)
            if fills_from_l3 and not is_range_key(key):
                assert self._l3 is not None
                try:
                    existed = self._l3.delete(key)
                finally:
                    if self.written is not None:
                        self.written(key)  # done, or failed not knowing
            with self._lock:
                self._counters["deletes"] += 1
                self.forget(key)
                try:
                    existed = self._placement.drop(key) or existed
                except CacheError:
                    # A copy a tier could not delete now (L2's map full): checked against object storage
                    # before it is ever served again, and the caller told (it may delete again).
                    self._state.unvouch([key])
                    raise
        return existed

    def evict(self, key: bytes) -> bool:
        """`Engine.evict` after validation: uploads a dirty value first, then drops every cached copy."""
        with self._locks(key):
            if self._writeback is not None and not self._writeback.upload(key):
                raise TierUnavailable(f"cannot evict {key[:64]!r}: its write-back upload failed; it stays cached")
            if self.written is not None:
                # An eviction is how a user says the object changed behind the cache (replaced in the bucket):
                # a listing page sent before it decides nothing for the key either.
                self.written(key)
            with self._lock:
                self.forget(key)
                return self._placement.drop(key)

    def drop_cached(self, key: bytes) -> bool:
        """`Engine.drop_cached` after validation: every cached copy, a dirty one too, and object storage untouched."""
        with self._locks(key), self._lock:
            self._counters["peer_drops"] += 1
            self.forget(key)
            return self._placement.drop(key)

    def forget(self, key: bytes) -> None:
        """Forgets every record of `key` outside the tiers (engine lock held)."""
        self._fills.invalidate(key)
        self._state.forget(key)
        if self._writeback is not None:
            self._writeback.dequeue(key)
