"""The tier engine: the only code that moves bytes between tiers.

Read path: L1 (memory) -> L2 (LMDB) -> L3 (object storage). A hit in a lower
tier is promoted to L1; a miss in both cache tiers is filled from L3 once, no
matter how many readers miss at the same time (`races.Fills`).

Placement: L2 is inclusive of what it received. An L1 victim is demoted into
L2 unless L2 already holds it; an L2 victim is dropped when object storage
holds it, and written back first when only the cache does (write-back keys).

Writes, per key namespace (longest matching prefix wins):
- write-through (default): the value goes to L3 first, then into the cache,
  so an acknowledged put is durable in object storage;
- write-back: the value goes into the cache and a bounded queue, and a
  flusher uploads it; `close()` drains the queue, and whatever cannot be
  uploaded in time is kept in L2 flagged dirty and re-queued on the next start;
- cache-only: never written to object storage (for example KV-cache blocks).

Integrity: every value carries its xxh3-64 checksum. L2 and L3 verify it on
every read; a mismatch is counted, the bad copy dropped, and the read goes on
to the tier below. Corrupt bytes are never returned.

Locking: one engine lock guards the cache tiers' bookkeeping and policies
(held only for memory and local-disk work); object-storage I/O runs outside it,
serialized per key by striped key locks so two writes to one key reach L3 and
the cache in the same order.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cachesvc.engine.deadlines import Deadlines
from cachesvc.engine.races import Fills
from cachesvc.engine.writeback import WriteBackQueue
from cachesvc.errors import (
    CacheError,
    ChecksumMismatch,
    CorruptValue,
    InvalidKey,
    NotConfigured,
    Overloaded,
    TierFull,
    TierUnavailable,
    ValueTooLarge,
)
from cachesvc.integrity import checksum as xxh3
from cachesvc.policy.base import EvictionPolicy
from cachesvc.tiers.base import Entry, Tier

__all__ = ["MAX_KEY_BYTES", "Engine", "Hit", "Namespace", "WriteMode"]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024
_STRIPES = 64


class WriteMode(enum.StrEnum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"
    CACHE_ONLY = "cache-only"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Keys starting with `prefix` are written with `write_mode`.

    `lease_seconds` and `ttl_seconds` are the defaults of puts in the
    namespace that do not set their own (0: no lease, no TTL).
    """

    prefix: bytes
    write_mode: WriteMode
    lease_seconds: float = 0.0
    ttl_seconds: float = 0.0


_DEFAULT_NAMESPACE = Namespace(b"", WriteMode.WRITE_THROUGH)


@dataclass(frozen=True, slots=True)
class _Lease:
    """A pinned value: the tier it is pinned in, its cost there, and how many puts leased it."""

    level: _Level
    cost: int
    holders: int


@dataclass(frozen=True, slots=True)
class Hit:
    """A value found by the engine and the tier that answered."""

    value: bytes
    checksum: int
    tier: str


class _Level:
    """A cache tier with its eviction policy and counters."""

    def __init__(self, tier: Tier, policy: EvictionPolicy) -> None:
        self.tier = tier
        self.policy = policy
        self.hits = 0
        self.evictions = 0

    @property
    def name(self) -> str:
        return self.tier.name

    def fits_at_all(self, key: bytes, size: int) -> bool:
        capacity = self.tier.capacity_bytes
        return capacity is None or self.tier.cost(key, size) <= capacity


class Engine:
    """Serves gets and puts across up to three tiers.

    Args:
        l1: memory tier, or None.
        l2: local-disk tier, or None. At least one of l1 and l2 is required.
        l3: object storage, or None for a cache with nothing below it.
        policy_factory: builds the eviction policy of a tier, given its name.
        namespaces: write modes by key prefix; other keys are write-through.
        max_value_bytes: the largest value accepted.
        writeback_capacity: keys the write-back queue holds before puts wait.
        io_timeout: seconds a reader waits for a fill, and a writer for room
            in the write-back queue.
        fill_concurrency: object-storage fetches one `get_many` runs at once.
        fill_l2: whether values filled from object storage are also written
            to L2 (so L2 holds the warm working set across restarts, and
            co-located clients can read it directly).
        clock: monotonic seconds, for leases and TTLs.

    Leases: a put with a lease pins the value in the tier it lands in: the
    tier's policy no longer sees it, so it is never a victim, until a get with
    `release=True` reads it or the lease ends. TTLs: a value past its TTL
    reads as a miss and is dropped.
    """

    def __init__(
        self,
        *,
        l1: Tier | None,
        l2: Tier | None,
        l3: Tier | None,
        policy_factory: Callable[[str], EvictionPolicy],
        namespaces: Sequence[Namespace] = (),
        max_value_bytes: int = 256 << 20,
        writeback_capacity: int = 4096,
        io_timeout: float = 60.0,
        fill_concurrency: int = 16,
        fill_l2: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if l1 is None and l2 is None:
            raise ValueError("the engine needs at least one cache tier (L1 or L2)")
        if l3 is None and any(ns.write_mode is WriteMode.WRITE_BACK for ns in namespaces):
            raise ValueError("write-back namespaces need object storage (L3) to write back to")
        self.l1 = _Level(l1, policy_factory(l1.name)) if l1 is not None else None
        self.l2 = _Level(l2, policy_factory(l2.name)) if l2 is not None else None
        self.l3 = l3
        self._levels = [level for level in (self.l1, self.l2) if level is not None]
        self._namespaces = sorted(namespaces, key=lambda ns: len(ns.prefix), reverse=True)
        self.max_value_bytes = max_value_bytes
        self._io_timeout = io_timeout
        self._lock = threading.RLock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._fills = Fills()
        self._dirty: set[bytes] = set()
        self.counters: Counter[str] = Counter()
        self._writeback = WriteBackQueue(writeback_capacity)
        self._fill_pool = ThreadPoolExecutor(fill_concurrency, thread_name_prefix="fill")
        self._fill_l2 = fill_l2
        self._clock = clock
        self._leases: Deadlines[_Lease] = Deadlines()
        self._ttls: Deadlines[None] = Deadlines()
        self.read_listeners: list[Callable[[Sequence[bytes]], None]] = []
        """Called with the keys of every demand read (not prefetches), outside the engine lock."""
        self._closed = False
        for level in self._levels:
            for resident in level.tier.scan():
                level.policy.on_insert(resident.key, resident.cost)
                if resident.dirty:
                    self._dirty.add(resident.key)
        for key in sorted(self._dirty):
            self._writeback.push(key, reserved=False)
        self._flusher: threading.Thread | None = None
        if l3 is not None:
            self._flusher = threading.Thread(target=self._flush_loop, name="write-back", daemon=True)
            self._flusher.start()

    # -- validation -----------------------------------------------------

    def check_key(self, key: bytes) -> None:
        """Raises InvalidKey unless 1 <= len(key) <= MAX_KEY_BYTES."""
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidKey(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")

    def check_size(self, size: int) -> None:
        """Raises ValueTooLarge when `size` is over max_value_bytes."""
        if size > self.max_value_bytes:
            raise ValueTooLarge(f"value of {size} bytes is over the limit of max_value_bytes={self.max_value_bytes}")

    def namespace(self, key: bytes) -> Namespace:
        """The namespace `key` belongs to (the longest matching prefix)."""
        for ns in self._namespaces:
            if key.startswith(ns.prefix):
                return ns
        return _DEFAULT_NAMESPACE

    def write_mode(self, key: bytes) -> WriteMode:
        return self.namespace(key).write_mode

    def _stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    # -- reads ----------------------------------------------------------

    def get(self, key: bytes, *, release: bool = False) -> Hit | None:
        """The value of `key` from the fastest tier that holds it; None on a miss.

        Args:
            release: end the lease of the key once read (the decode side of a
                prefill/decode hand-off).

        Raises:
            InvalidKey: the key is empty or too long.
            TierUnavailable: the cache tiers miss and object storage is down.
            CorruptValue: object storage holds bytes that fail their checksum.
        """
        self.check_key(key)
        hit = self._get(key, release)
        self._notify_read([key])
        return hit

    def _notify_read(self, keys: Sequence[bytes]) -> None:
        for listener in self.read_listeners:
            listener(keys)

    def _get(self, key: bytes, release: bool = False) -> Hit | None:
        with self._lock:
            self.counters["gets"] += 1
            self._expire()
            hit = self._get_cached(key)
            if hit is not None:
                if release:
                    self._release(key)
                return hit
            if self.l3 is None or self.write_mode(key) is WriteMode.CACHE_ONLY:
                self.counters["misses"] += 1
                return None
        entry = self._fill(key)
        with self._lock:
            self.counters["hits_l3" if entry is not None else "misses"] += 1
        return Hit(entry.value, entry.checksum, "l3") if entry is not None else None

    def _fill(self, key: bytes) -> Entry | None:
        """Fetches `key` from object storage into the cache, once however many callers miss at once."""
        assert self.l3 is not None
        with self._lock:
            fill, leader = self._fills.join(key)
            if not leader:
                self.counters["fills_joined"] += 1
        if not leader:
            return fill.wait(self._io_timeout)
        try:
            entry = self.l3.get(key)
        except BaseException as exc:
            with self._lock:
                self._fills.finish(fill)
                if isinstance(exc, CorruptValue):
                    self.counters["checksum_failures"] += 1
                elif isinstance(exc, TierUnavailable):
                    self.counters["l3_errors"] += 1
            fill.fail(exc)
            raise
        with self._lock:
            self._fills.finish(fill)
            if entry is not None and not fill.invalidated:
                self.counters["fills"] += 1
                self._place(key, entry.value, entry.checksum, dirty=False)
                self._fill_into_l2(key, entry)
        fill.resolve(entry)
        return entry

    def _fill_into_l2(self, key: bytes, entry: Entry) -> None:
        l2 = self.l2
        if not self._fill_l2 or l2 is None or self.l1 is None or l2.tier.contains(key):
            return
        if not l2.fits_at_all(key, len(entry.value)):
            return
        try:
            self._install(l2, key, entry.value, entry.checksum, dirty=False)
        except CacheError as exc:
            log.debug("fill into L2 skipped: %s", exc)

    def get_many(self, keys: Iterable[bytes], *, release: bool = False) -> list[Hit | None]:
        """`get` for each key, in order. Keys are validated before any is read.

        Cache hits are answered at once; misses are filled from object storage
        concurrently (at most `fill_concurrency` at a time).
        """
        keys = list(keys)
        for key in keys:
            self.check_key(key)
        results: list[Hit | None] = [None] * len(keys)
        missed: list[int] = []
        with self._lock:
            self._expire()
            for i, key in enumerate(keys):
                hit = self._get_cached(key)
                if hit is None:
                    missed.append(i)
                else:
                    self.counters["gets"] += 1
                    results[i] = hit
                    if release:
                        self._release(key)
        if len(missed) == 1:
            results[missed[0]] = self._get(keys[missed[0]], release)
        elif missed:
            fetched = self._fill_pool.map(lambda k: self._get(k, release), [keys[i] for i in missed])
            for i, hit in zip(missed, fetched, strict=True):
                results[i] = hit
        self._notify_read(keys)
        return results

    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` into the cache ahead of a read, without counting as one.

        Returns the bytes fetched from object storage: 0 when the key was
        already cached, None when object storage does not have it.
        """
        self.check_key(key)
        with self._lock:
            self.counters["prefetches"] += 1
            if any(level.tier.contains(key) for level in self._levels):
                return 0
            if self.l3 is None or self.write_mode(key) is WriteMode.CACHE_ONLY:
                return None
        entry = self._fill(key)
        if entry is None:
            return None
        with self._lock:
            self.counters["prefetched_bytes"] += len(entry.value)
        return len(entry.value)

    def _expired(self, key: bytes) -> bool:
        """Whether `key` has passed its TTL (engine lock held)."""
        ttl = self._ttls.get(key)
        return ttl is not None and ttl[0] <= self._clock()

    def _get_cached(self, key: bytes) -> Hit | None:
        if self._expired(key):
            self._drop_cached(key)
            self.counters["ttl_expired"] += 1
            return None
        for depth, level in enumerate(self._levels):
            try:
                entry = level.tier.get(key)
            except CorruptValue:
                self.counters["checksum_failures"] += 1
                log.warning("%s: dropped a value that failed its checksum", level.name)
                level.tier.delete(key)
                level.policy.on_delete(key)
                continue
            if entry is None:
                continue
            level.hits += 1
            self.counters[f"hits_{level.name}"] += 1
            level.policy.on_access(key)
            if depth > 0:
                self._promote(key, entry)
            return Hit(entry.value, entry.checksum, level.name)
        return None

    def _promote(self, key: bytes, entry: Entry) -> None:
        assert self.l1 is not None
        if not self.l1.fits_at_all(key, len(entry.value)):
            return
        try:
            self._install(self.l1, key, entry.value, entry.checksum, dirty=key in self._dirty)
            self.counters["promotions"] += 1
        except CacheError as exc:
            log.debug("promotion of a key skipped: %s", exc)

    # -- writes ---------------------------------------------------------

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int | None = None,
        *,
        lease: float | None = None,
        ttl: float | None = None,
    ) -> None:
        """Stores `value` under `key` as its namespace's write mode says.

        Args:
            lease: seconds to pin the value (see the class docs); None: the
                namespace's default.
            ttl: seconds until the value expires; None: the namespace's default.

        Raises:
            InvalidKey, ValueTooLarge: the request is out of bounds.
            ChecksumMismatch: `checksum` is given and does not match `value`.
            TierUnavailable: write-through and object storage is down.
            TierFull: cache-only and the value fits in no cache tier.
            Overloaded: write-back and the queue stayed full past the deadline.
        """
        self._put(key, value, self._verified_checksum(key, value, checksum), lease, ttl)

    def _verified_checksum(self, key: bytes, value: bytes, checksum: int | None) -> int:
        """The value's xxh3 after checking key, size and the sender's checksum."""
        self.check_key(key)
        self.check_size(len(value))
        actual = xxh3(value)
        if checksum is not None and checksum != actual:
            raise ChecksumMismatch(
                f"value of {len(value)} bytes for key {key[:64]!r} does not match its checksum {checksum:016x}"
            )
        return actual

    def _put(self, key: bytes, value: bytes, actual: int, lease: float | None, ttl: float | None) -> None:
        namespace = self.namespace(key)
        mode = namespace.write_mode
        lease = namespace.lease_seconds if lease is None else lease
        ttl = namespace.ttl_seconds if ttl is None else ttl
        fits = any(level.fits_at_all(key, len(value)) for level in self._levels)
        if mode is WriteMode.WRITE_BACK and not fits:
            mode = WriteMode.WRITE_THROUGH
        if mode is WriteMode.CACHE_ONLY and not fits:
            raise TierFull(f"value of {len(value)} bytes fits in no cache tier and key {key[:64]!r} is cache-only")
        with self._stripe(key):
            if mode is WriteMode.WRITE_THROUGH and self.l3 is not None:
                self.l3.put(key, value, actual)
            reserved = False
            if mode is WriteMode.WRITE_BACK:
                reserved = self._writeback.reserve(key, self._io_timeout)
            try:
                with self._lock:
                    self.counters["puts"] += 1
                    self._expire()
                    self._fills.invalidate(key)
                    held = self._leases.get(key)
                    holders = held[1].holders + 1 if held is not None and lease > 0 else 1
                    self._drop_cached(key, forget=False)
                    if fits:
                        level = self._place(key, value, actual, dirty=mode is WriteMode.WRITE_BACK)
                        if lease > 0 and level is not None:
                            self._pin(
                                level, key, len(value), max(lease, held[0] - self._clock()) if held else lease, holders
                            )
                    if ttl > 0:
                        self._ttls.set(key, self._clock() + ttl, None)
                    if mode is WriteMode.WRITE_BACK:
                        self._dirty.add(key)
            except BaseException:
                self._writeback.release(reserved)
                raise
            if mode is WriteMode.WRITE_BACK:
                self._writeback.push(key, reserved)

    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes, int | None]],
        *,
        lease: float | None = None,
        ttl: float | None = None,
    ) -> None:
        """`put` for each (key, value, checksum); all are validated before any is written."""
        verified = [self._verified_checksum(key, value, checksum) for key, value, checksum in items]
        for (key, value, _), actual in zip(items, verified, strict=True):
            self._put(key, value, actual, lease, ttl)

    def delete(self, key: bytes) -> bool:
        """Removes `key` from every tier, object storage included; returns whether any held it."""
        self.check_key(key)
        with self._stripe(key):
            existed = False
            if self.l3 is not None and self.write_mode(key) is not WriteMode.CACHE_ONLY:
                existed = self.l3.delete(key)
            with self._lock:
                self.counters["deletes"] += 1
                self._fills.invalidate(key)
                self._dirty.discard(key)
                self._writeback.discard(key)
                existed = self._drop_cached(key) or existed
        return existed

    def evict(self, key: bytes) -> bool:
        """Drops `key` from the cache tiers only, writing it back first if it is dirty."""
        self.check_key(key)
        with self._stripe(key):
            if key in self._dirty:
                self._write_back(key)
            with self._lock:
                self._fills.invalidate(key)
                return self._drop_cached(key)

    def contains(self, key: bytes, cached_only: bool = False) -> str | None:
        """The name of the fastest tier holding `key`, or None. Not an access."""
        self.check_key(key)
        with self._lock:
            if not self._expired(key):
                for level in self._levels:
                    if level.tier.contains(key):
                        return level.name
        if cached_only or self.l3 is None or self.write_mode(key) is WriteMode.CACHE_ONLY:
            return None
        return self.l3.name if self.l3.contains(key) else None

    def list_page(self, prefix: bytes, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
        """One page of the keys object storage holds under `prefix` (see `S3Tier.list_page`).

        Raises:
            NotConfigured: there is no object storage to list.
        """
        list_page = getattr(self.l3, "list_page", None)
        if list_page is None:
            raise NotConfigured("List: this cache server has no object storage (s3.bucket is not set)")
        result: tuple[list[tuple[bytes, int]], bool] = list_page(prefix, start_after, limit)
        return result

    # -- placement (engine lock held) ------------------------------------

    def _drop_cached(self, key: bytes, *, forget: bool = True) -> bool:
        """Removes every cached copy of `key`.

        With `forget=False` (a put replacing the value) the policies keep the
        key's history, so the put that follows counts as one more reference
        rather than a first one.
        """
        self._leases.pop(key)
        self._ttls.pop(key)
        existed = False
        for level in self._levels:
            if level.tier.delete(key):
                existed = True
                if not forget:
                    level.policy.on_evict(key)
            if forget:
                level.policy.on_delete(key)
        return existed

    def _place(self, key: bytes, value: bytes, checksum: int, *, dirty: bool) -> _Level | None:
        """Puts a value in the fastest cache tier it fits in at all; returns that tier."""
        for level in self._levels:
            if level.fits_at_all(key, len(value)):
                self._install(level, key, value, checksum, dirty=dirty)
                return level
        return None

    # -- leases and TTLs (engine lock held) ---------------------------------

    def _pin(self, level: _Level, key: bytes, size: int, lease: float, holders: int = 1) -> None:
        level.policy.on_delete(key)
        deadline = self._clock() + lease
        self._leases.set(key, deadline, _Lease(level, level.tier.cost(key, size), holders))
        self.counters["leases"] += 1

    def _release(self, key: bytes) -> None:
        found = self._leases.get(key)
        if found is None:
            return
        deadline, lease = found
        self.counters["leases_released"] += 1
        if lease.holders > 1:
            # Another writer leased the same value (a block two prompts share):
            # it stays pinned for the remaining holders.
            self._leases.set(key, deadline, _Lease(lease.level, lease.cost, lease.holders - 1))
            return
        self._leases.pop(key)
        self._unpin(key, lease)

    def _unpin(self, key: bytes, lease: _Lease) -> None:
        if lease.level.tier.contains(key):
            lease.level.policy.on_insert(key, lease.cost)

    def _expire(self) -> None:
        now = self._clock()
        for key, pinned in self._leases.due(now):
            self._unpin(key, pinned)
            self.counters["leases_expired"] += 1
        for key, _ in self._ttls.due(now):
            self._leases.pop(key)
            self._drop_cached(key)
            self.counters["ttl_expired"] += 1

    def _install(self, level: _Level, key: bytes, value: bytes, checksum: int, *, dirty: bool) -> None:
        tier = level.tier
        # A replaced value frees its space first; on_insert below counts the
        # new one as a reference to the key.
        tier.delete(key)
        needed = tier.cost(key, len(value))
        capacity = tier.capacity_bytes
        assert capacity is not None
        for _ in range(3):
            while tier.used_bytes + needed > capacity:
                victim = level.policy.victim()
                if victim is None:
                    raise TierFull(f"{tier.name}: nothing left to evict for a {needed}-byte entry")
                self._evict_one(level, victim)
            try:
                tier.put(key, value, checksum, dirty=dirty)
            except TierFull:
                # The tier's own limit (LMDB's map) is tighter than the estimate;
                # evict one more and try again.
                victim = level.policy.victim()
                if victim is None:
                    raise
                self._evict_one(level, victim)
                continue
            level.policy.on_insert(key, needed)
            return
        raise TierFull(f"{tier.name}: could not make room for a {needed}-byte entry")

    def _evict_one(self, level: _Level, victim: bytes) -> None:
        entry: Entry | None = None
        try:
            entry = level.tier.get(victim)
        except CorruptValue:
            self.counters["checksum_failures"] += 1
        if entry is not None:
            below = self.l2 if level is self.l1 else None
            if below is not None and not below.tier.contains(victim) and below.fits_at_all(victim, len(entry.value)):
                try:
                    self._install(below, victim, entry.value, entry.checksum, dirty=victim in self._dirty)
                    self.counters["demotions"] += 1
                except CacheError as exc:
                    if victim in self._dirty:
                        raise Overloaded(f"cannot demote a dirty value out of {level.name}: {exc}") from exc
            elif victim in self._dirty and (below is None or not below.tier.contains(victim)):
                # Only this tier holds the newest value: upload it before dropping it.
                self._upload(victim, entry)
        level.tier.delete(victim)
        level.policy.on_evict(victim)
        level.evictions += 1
        self.counters[f"evictions_{level.name}"] += 1

    # -- write-back -----------------------------------------------------

    def _upload(self, key: bytes, entry: Entry) -> None:
        assert self.l3 is not None
        self.l3.put(key, entry.value, entry.checksum)
        self._dirty.discard(key)
        self._writeback.discard(key)
        self.counters["writebacks"] += 1

    def _write_back(self, key: bytes) -> None:
        """Uploads the cached value of a dirty key (stripe lock held)."""
        with self._lock:
            if key not in self._dirty:
                return
            entry = None
            for level in self._levels:
                try:
                    entry = level.tier.get(key)
                except CorruptValue:
                    self.counters["checksum_failures"] += 1
                    continue
                if entry is not None:
                    break
        if entry is None:
            with self._lock:
                # Nothing readable is left to upload (a corrupt copy); the key is lost.
                self._dirty.discard(key)
                self.counters["writeback_lost"] += 1
            return
        assert self.l3 is not None
        self.l3.put(key, entry.value, entry.checksum)
        with self._lock:
            self._dirty.discard(key)
            self.counters["writebacks"] += 1

    def _flush_loop(self) -> None:
        while not self._closed:
            key = self._writeback.pop(timeout=0.2)
            if key is not None:
                self._flush_key(key)

    def _flush_key(self, key: bytes) -> bool:
        with self._stripe(key):
            try:
                self._write_back(key)
                return True
            except TierUnavailable as exc:
                log.warning("write-back postponed: %s", exc)
                self._writeback.push(key, reserved=False)
                return False

    def flush(self, timeout: float) -> int:
        """Uploads queued write-back keys until the queue is empty or `timeout` passes.

        Returns the number of keys still waiting.
        """
        deadline = time.monotonic() + timeout
        while len(self._writeback) and time.monotonic() < deadline:
            key = self._writeback.pop(timeout=0.0)
            if key is not None and not self._flush_key(key):
                time.sleep(0.2)
        return len(self._writeback)

    # -- lifecycle and stats ----------------------------------------------

    def close(self, flush_timeout: float = 30.0) -> None:
        """Drains the write-back queue, keeps what could not be uploaded in L2, and closes the tiers."""
        if self._closed:
            return
        self._closed = True
        self._fill_pool.shutdown(wait=True)
        if self._flusher is not None:
            self._flusher.join(timeout=5.0)
            self.flush(flush_timeout)
        with self._lock:
            if self.l1 is not None and self.l2 is not None:
                for key in sorted(self._dirty):
                    entry = self.l1.tier.get(key)
                    if entry is not None and not self.l2.tier.contains(key):
                        try:
                            self._install(self.l2, key, entry.value, entry.checksum, dirty=True)
                        except CacheError as exc:
                            log.error("lost an unflushed write-back value at shutdown: %s", exc)
            if self._dirty:
                log.warning("%d write-back keys not uploaded; they stay in L2 and retry on restart", len(self._dirty))
            for level in self._levels:
                level.tier.close()
        if self.l3 is not None:
            self.l3.close()

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier usage, for the Stats RPC and `cachectl stats`."""
        with self._lock:
            tiers = [
                {
                    "name": level.name,
                    "used_bytes": level.tier.used_bytes,
                    "capacity_bytes": level.tier.capacity_bytes or 0,
                    "entries": len(level.policy),
                    "hits": level.hits,
                    "evictions": level.evictions,
                    "policy": getattr(level.policy, "name", type(level.policy).__name__),
                }
                for level in self._levels
            ]
            if self.l3 is not None:
                tiers.append(
                    {
                        "name": self.l3.name,
                        "used_bytes": 0,
                        "capacity_bytes": 0,
                        "entries": 0,
                        "hits": self.counters["hits_l3"],
                        "evictions": 0,
                        "policy": "",
                    }
                )
            counters = dict(self.counters)
            counters["dirty_keys"] = len(self._dirty)
            counters["pinned_keys"] = len(self._leases)
            counters["fills_in_flight"] = len(self._fills)
        return {"tiers": tiers, "counters": counters}
