"""The tier engine: the one place that orchestrates reads and writes across tiers.

Read path: L1 (memory) -> L2 (LMDB) -> L3 (object storage). A hit in a lower
tier is promoted to L1; a miss in both cache tiers is filled from L3 once, no
matter how many readers miss at the same time (`races.Fills`).

Writes, per key namespace (longest matching prefix wins):
- write-through (default): the value goes to L3 first, then into the cache,
  so an acknowledged put is durable in object storage; a failed one drops
  the cached copy, since the object may hold either value now;
- write-back: the value goes into the cache (L1, and L2 too, so a crash of the
  process does not lose it) and `WriteBack` uploads it; a dirty value is never
  evicted from the last cache tier before it is uploaded, and `close()` keeps
  what could not be uploaded in L2, flagged dirty;
- cache-only: never written to object storage (for example KV-cache blocks).

The engine delegates each concern to one owner: `Placement` (which tier holds
a value, eviction, demotion), `Pins` (leases and TTLs), `WriteBack` (the dirty
set, the upload queue, the flusher), `Fills` and `KeyLocks` (the races), and
`ReadFeed` (who hears of demand reads; the engine never knows who listens),
`KeyIndex` (the digests of held KV keys that clients' local indexes follow),
`Freshness` (when a cached value is checked against its object again).

Integrity: every value carries its xxh3-64 checksum. L2 and L3 verify it on
every read; a mismatch is counted, the bad copy dropped, and the read goes on
to the tier below. Corrupt bytes are never returned.

Locking: one engine lock guards the cache tiers' bookkeeping and policies
(held only for memory and local-disk work); object-storage I/O runs outside it,
serialized per key by `KeyLocks`, so two writes to one key reach L3 and the
cache in the same order and a delete is never followed by a stale upload.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, cast

from cacheclient.wire import MAX_KEY_BYTES
from cacheclient.wire import checksum as xxh3
from cacheclient.wire.ranges import RangeKeyError, is_range_key, parse_range_key
from cachesvc.engine.events import ReadFeed
from cachesvc.engine.fillchain import FillChain, FillSource, ObjectStorageFill
from cachesvc.engine.freshness import Freshness
from cachesvc.engine.keyindex import DigestAnswer, KeyIndex
from cachesvc.engine.pins import Pins
from cachesvc.engine.placement import Level, Placement
from cachesvc.engine.races import Fills, KeyLocks
from cachesvc.engine.writeback import WriteBack
from cachesvc.errors import (
    Abandoned,
    CacheError,
    ChecksumMismatch,
    CorruptValue,
    InvalidKey,
    NotConfigured,
    TierFull,
    TierUnavailable,
    ValueTooLarge,
)
from cachesvc.policy.base import EvictionPolicy
from cachesvc.tiers.base import Entry, ListableTier, RevalidatingTier, Tier

__all__ = ["MAX_KEY_BYTES", "Engine", "Hit", "Namespace", "WriteMode"]

log = logging.getLogger(__name__)


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
class Hit:
    """A value found by the engine and the tier that answered."""

    value: bytes
    checksum: int
    tier: str


class Engine:
    """Serves gets and puts across up to three tiers.

    Args:
        l1: memory tier, or None.
        l2: local-disk tier, or None. At least one of l1 and l2 is required.
        l3: object storage, or None for a cache with nothing below it.
        fill_sources: asked for a missed key before object storage, in order
            (a cluster node's `PeerFill`); see `fillchain`. Needs `l3`.
        policy_factory: builds the eviction policy of a tier, given its name.
        namespaces: write modes by key prefix; other keys are write-through.
        max_value_bytes: the largest value accepted.
        writeback_capacity: keys the write-back queue holds before puts wait.
        io_timeout: seconds a reader waits for a fill, and a writer for room
            in the write-back queue.
        fill_concurrency: object-storage fetches all requests run at once.
        request_fills: fetches one `get_many` runs at once (default half of
            `fill_concurrency`), so one large request cannot take them all.
        fill_l2: whether values filled from object storage are also written
            to L2 (so L2 holds the warm working set across restarts, and
            co-located clients can read it directly).
        max_lease_seconds: the longest lease a put may ask for.
        reads: where demand reads are published (see `ReadFeed`).
        key_index: the followed prefixes' digest logs (`KeyDigest`); None: none followed.
        revalidate_seconds: a hit on a value last known to match its object
            longer ago than this checks the object first, and reads it again
            if it changed (`Freshness`); 0: never (objects are immutable).
        clock: monotonic seconds, for leases, TTLs and revalidation.
        wall_clock: Unix seconds, for the expiry tiers persist.

    Leases: a put with a lease pins the value in the tier it lands in until a
    get with `release=True` reads it or the lease ends. TTLs: a value past its
    TTL reads as a miss and is dropped (a dirty one once it is uploaded).
    """

    def __init__(
        self,
        *,
        l1: Tier | None,
        l2: Tier | None,
        l3: Tier | None,
        fill_sources: Sequence[FillSource] = (),
        policy_factory: Callable[[str], EvictionPolicy],
        namespaces: Sequence[Namespace] = (),
        max_value_bytes: int = 256 << 20,
        writeback_capacity: int = 4096,
        io_timeout: float = 60.0,
        fill_concurrency: int = 16,
        request_fills: int | None = None,
        fill_l2: bool = True,
        max_lease_seconds: float = 3600.0,
        reads: ReadFeed | None = None,
        key_index: KeyIndex | None = None,
        revalidate_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if l1 is None and l2 is None:
            raise ValueError("the engine needs at least one cache tier (L1 or L2)")
        if l3 is None and any(ns.write_mode is WriteMode.WRITE_BACK for ns in namespaces):
            raise ValueError("write-back namespaces need object storage (L3) to write back to")
        if fill_sources and l3 is None:
            raise ValueError("fill sources are asked before object storage (L3), and there is none")
        if revalidate_seconds > 0 and l3 is not None and not isinstance(l3, RevalidatingTier):
            raise ValueError(f"revalidate_seconds: {l3.name} cannot tell whether an object changed")
        self.l1 = Level(l1, policy_factory(l1.name)) if l1 is not None else None
        self.l2 = Level(l2, policy_factory(l2.name)) if l2 is not None else None
        self.l3 = l3
        self._chain = FillChain([*fill_sources, ObjectStorageFill(l3)] if l3 is not None else [])
        self.counters: Counter[str] = Counter()
        self.key_index = key_index if key_index is not None else KeyIndex([])
        self._placement = Placement(
            [lv for lv in (self.l1, self.l2) if lv is not None], self, self.counters, self.key_index
        )
        self._namespaces = sorted(namespaces, key=lambda ns: len(ns.prefix), reverse=True)
        self.max_value_bytes = max_value_bytes
        self._io_timeout = io_timeout
        self._lock = threading.RLock()
        self._locks = KeyLocks()
        self._fills = Fills()
        self._pins: Pins[Level] = Pins(max_lease_seconds)
        self._expired_dirty: set[bytes] = set()
        """Keys past their TTL whose newest value still awaits upload: they read as misses."""
        self._freshness = Freshness(revalidate_seconds if l3 is not None else 0.0)
        self._fill_pool = ThreadPoolExecutor(fill_concurrency, thread_name_prefix="fill")
        self._request_fills = max(1, request_fills or fill_concurrency // 2)
        self._fill_l2 = fill_l2
        self._clock = clock
        self._wall_clock = wall_clock
        self._reads = reads if reads is not None else ReadFeed()
        self._closed = False
        self._writeback = (
            WriteBack(l3, self, self._locks, capacity=writeback_capacity, io_timeout=io_timeout)
            if l3 is not None
            else None
        )
        self._reopen()
        if self._writeback is not None:
            self._writeback.start()

    def _reopen(self) -> None:
        """Rebuilds policies, TTLs and the dirty set from what the tiers hold (a restart)."""
        now, wall = self._clock(), self._wall_clock()
        found = [(level, list(level.tier.scan())) for level in self._placement.levels]
        for _, residents in found:
            for resident in residents:
                if resident.dirty and self._writeback is not None and not self._writeback.is_dirty(resident.key):
                    self._writeback.mark_dirty(resident.key)
                if resident.expires_at:
                    self._pins.restore(resident.key, resident.expires_at, now, wall)
        for level, residents in found:
            for resident in residents:
                self.key_index.admitted(resident.key)
                if not self.held(level, resident.key):
                    level.policy.on_insert(resident.key, resident.cost)

    # -- what placement asks (KeyState) -----------------------------------

    def held(self, level: Level, key: bytes) -> bool:
        """Leased in `level`, or dirty in the last tier (it has nowhere else to go before upload)."""
        lease = self._pins.leased(key)
        if lease is not None and lease.level is level:
            return True
        return self._placement.is_last(level) and self.dirty(key)

    def dirty(self, key: bytes) -> bool:
        return self._writeback is not None and self._writeback.is_dirty(key)

    def expires_at(self, key: bytes) -> float:
        return self._pins.wall_expiry(key, self._clock(), self._wall_clock())

    def evicted(self, key: bytes) -> None:
        self._pins.forget(key)
        self._freshness.forget(key)

    # -- what write-back asks (WriteBackSource) ---------------------------

    def dirty_entry(self, key: bytes) -> Entry | None:
        with self._lock:
            found = self._placement.read(key)
        return None if found is None else found[1]

    def uploaded(self, key: bytes) -> None:
        with self._lock:
            if key in self._expired_dirty:
                self._expired_dirty.discard(key)
                self._pins.forget(key)
                self._placement.drop(key)
            else:
                self._placement.unhold(key, uploaded=True)

    # -- validation -----------------------------------------------------

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

    def namespace(self, key: bytes) -> Namespace:
        """The namespace `key` belongs to (the longest matching prefix)."""
        for ns in self._namespaces:
            if key.startswith(ns.prefix):
                return ns
        return _DEFAULT_NAMESPACE

    def write_mode(self, key: bytes) -> WriteMode:
        return self.namespace(key).write_mode

    def _fills_from_l3(self, key: bytes) -> bool:
        return self.l3 is not None and self.write_mode(key) is not WriteMode.CACHE_ONLY

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
        hit = self._read(key, release)
        self._reads.publish([key])
        return hit

    def suspect_cached(self) -> None:
        """Check each cached value against object storage at its next hit (once), as `revalidate_seconds` does.

        For a cluster node that lost its lease and came back: while it was
        away its keys were other nodes' to write, so what it cached may be
        old. Values not yet uploaded and leased values are kept as they are;
        without an object-storage tier that can tell (`unchanged`), nothing
        is checked.
        """
        if isinstance(self.l3, RevalidatingTier):
            with self._lock:
                self._freshness.suspect_all(self._clock())

    def get_cached(self, key: bytes) -> Hit | None:
        """`get` from the cache tiers alone: a miss never reads object storage (what a peer asks,
        `cachesvc.server.peers`). Not published as a demand read: no plan of this server's waits on it.

        Raises:
            InvalidKey: the key is empty or too long.
        """
        self.check_key(key)
        with self._lock:
            self.counters["peer_reads"] += 1
            self._expire()
            hit, _ = self._read_cached(key, release=False)
            return hit

    def _read(self, key: bytes, release: bool = False) -> Hit | None:
        if self._freshness.enabled:
            self._revalidate(key)
        with self._lock:
            self.counters["gets"] += 1
            self._expire()
            hit, expired = self._read_cached(key, release)
            if hit is not None:
                return hit
            if expired or not self._fills_from_l3(key):
                self.counters["misses"] += 1
                return None
        entry = self._fill(key)
        with self._lock:
            if entry is None:
                self.counters["misses"] += 1
            else:
                self.counters["hits_l3"] += 1
                self.counters["hit_bytes_l3"] += len(entry.value)
        return Hit(entry.value, entry.checksum, "l3") if entry is not None else None

    def _revalidate(self, key: bytes) -> None:
        """Drops the cached copy of `key` when it is due for a check and its object changed (see `Freshness`).

        The check (a HEAD) runs outside the engine lock, and only one reader
        per interval makes it: the key counts as checked once one starts.
        When object storage cannot answer, the cached value is served (hits
        are served while it is down) and the next hit checks again.
        """
        with self._lock:
            now = self._clock()
            if not self._freshness.due(key, now) or not self._fills_from_l3(key) or is_range_key(key):
                return
            if self.dirty(key) or self._pins.leased(key) is not None:
                return  # newer in the cache than in object storage, or promised to stay
            found = self._placement.read(key) if self._placement.holder(key) is not None else None
            if found is None:
                return
            entry = found[1]
            self._freshness.known(key, now)
        versions = cast(RevalidatingTier, self.l3)
        try:
            unchanged = versions.unchanged(key, entry.value, entry.checksum)
        except Exception as exc:
            with self._lock:
                self.counters["revalidation_errors"] += 1
                self._freshness.forget(key)
            level = logging.DEBUG if isinstance(exc, TierUnavailable) else logging.WARNING
            log.log(level, "checking %r against object storage failed; serving the cached value: %s", key[:64], exc)
            return
        with self._lock:
            self.counters["revalidations"] += 1
            if unchanged:
                return
            found = self._placement.read(key)
            if found is None or found[1].checksum != entry.checksum or self.dirty(key):
                return  # replaced through the cache meanwhile
            self.counters["revalidation_refills"] += 1
            self._forget(key)
            self._placement.drop(key)

    def _read_cached(self, key: bytes, release: bool) -> tuple[Hit | None, bool]:
        """A cached hit (engine lock held), and whether the key just read as expired.

        An expired key must not be filled from object storage: a dirty one
        is newer in the cache than there.
        """
        if key in self._expired_dirty:
            return None, True
        if self._pins.expired(key, self._clock()):
            self._expire_key(key)
            return None, True
        found = self._placement.read(key)
        if found is None:
            return None, False
        level, entry = found
        level.hits += 1
        self.counters[f"hits_{level.name}"] += 1
        self.counters[f"hit_bytes_{level.name}"] += len(entry.value)
        level.policy.on_access(key)
        if level is not self._placement.levels[0]:
            self._placement.promote(key, entry)
        if release and self._pins.leased(key) is not None:
            self.counters["leases_released"] += 1
            if self._pins.release(key) is not None:
                self._placement.unhold(key)
        return Hit(entry.value, entry.checksum, level.name), False

    def _fill(self, key: bytes) -> Entry | None:
        """Fetches `key` from object storage into the cache, once however many callers miss at once.

        The fill is resolved whatever happens after the fetch, so readers
        waiting on it never hang on a failed placement.
        """
        assert self.l3 is not None
        with self._lock:
            fill, leader = self._fills.join(key)
            if not leader:
                self.counters["fills_joined"] += 1
        if not leader:
            return fill.wait(self._io_timeout)
        began = time.perf_counter()
        try:
            filled = self._chain.fetch(key)
        except BaseException as exc:
            with self._lock:
                self._count_fetch(began)
                self._fills.finish(fill)
                if isinstance(exc, CorruptValue):
                    self.counters["checksum_failures"] += 1
                elif isinstance(exc, TierUnavailable):
                    self.counters["l3_errors"] += 1
            fill.fail(exc)
            raise
        entry = filled.entry if filled is not None else None
        try:
            with self._lock:
                self._count_fetch(began)
                self._fills.finish(fill)
                if entry is not None and not fill.invalidated:
                    self.counters["fills"] += 1
                    self.counters["fill_bytes"] += len(entry.value)
                    self._cache_fill(key, entry)
        finally:
            fill.resolve(entry)
        return entry

    def _count_fetch(self, began: float) -> None:
        """One object-storage read by a fill, and its time (engine lock held), for the S3 latency metric."""
        self.counters["l3_fetches"] += 1
        self.counters["l3_fetch_micros"] += int((time.perf_counter() - began) * 1e6)

    def _cache_fill(self, key: bytes, entry: Entry) -> None:
        """Caches a value read from object storage (engine lock held); a full cache only skips it."""
        try:
            level = self._placement.place(key, entry.value, entry.checksum)
        except CacheError as exc:
            level = None
            log.debug("a filled value was not cached: %s", exc)
        if level is None:
            self.counters["fills_not_cached"] += 1
            return
        self._freshness.known(key, self._clock())
        l2 = self.l2
        if not self._fill_l2 or l2 is None or level is l2 or l2.tier.contains(key):
            return
        if not l2.fits_at_all(key, len(entry.value)):
            return
        try:
            self._placement.install(l2, key, entry.value, entry.checksum)
        except CacheError as exc:
            log.debug("fill into L2 skipped: %s", exc)

    def get_many(self, keys: Iterable[bytes], *, release: bool = False) -> list[Hit | None]:
        """`get` for each key, in order. Keys are validated before any is read.

        Cache hits are answered at once; misses are filled from object storage
        concurrently, at most `request_fills` at a time for this request.
        """
        return list(self.iter_many(keys, release=release))

    def iter_many(
        self, keys: Iterable[bytes], *, release: bool = False, stop: Future[Any] | None = None
    ) -> Iterator[Hit | None]:
        """`get_many`, each hit given as soon as it and every key before it are read.

        Keys are validated before any is read, and the cache tiers are read
        for all of them at once; misses are filled from object storage
        `request_fills` at a time, in key order, so the first values can go
        out while later fills are still in flight. Closing the iterator early
        cancels the fills not yet started.

        Args:
            stop: done once the reads are no longer wanted (the caller's RPC
                was cancelled or its deadline passed). With it, every miss is
                filled on the fill pool, and a wait for a fill ends as soon as
                `stop` is done: the fills not yet started are cancelled and
                `Abandoned` is raised (a fetch already sent finishes and is
                cached, for the next reader).

        Raises:
            Abandoned: `stop` was done while a fill was awaited.
        """
        keys = list(keys)
        for key in keys:
            self.check_key(key)
        results: list[Hit | None] = [None] * len(keys)
        missed: list[int] = []
        with self._lock:
            self._expire()
            now = self._clock()
            for i, key in enumerate(keys):
                if self._freshness.due(key, now) and self._placement.holder(key) is not None:
                    missed.append(i)  # `_read` checks its object first
                    continue
                hit, expired = self._read_cached(key, release)
                if hit is not None:
                    self.counters["gets"] += 1
                    results[i] = hit
                elif expired or not self._fills_from_l3(key):
                    self.counters["gets"] += 1
                    self.counters["misses"] += 1
                else:
                    missed.append(i)
        pipelined = len(missed) > 1 or (len(missed) == 1 and stop is not None)
        if len(missed) == 1 and not pipelined:
            results[missed[0]] = self._read(keys[missed[0]], release)
        source = self._pipelined_fills(keys, missed, results, release, stop) if pipelined else iter(results)
        # Demand reads are published for the prefetch plans: all of them before the last hit goes out
        # (a caller need not ask past it), or, when the caller stops early, those it was given.
        given = 0
        try:
            for hit in source:
                given += 1
                if given == len(keys):
                    self._reads.publish(keys)
                yield hit
        finally:
            if 0 < given < len(keys):
                self._reads.publish(keys[:given])
            if isinstance(source, Generator):
                source.close()  # cancels the fills not yet started

    def _pipelined_fills(
        self,
        keys: list[bytes],
        missed: list[int],
        results: list[Hit | None],
        release: bool,
        stop: Future[Any] | None = None,
    ) -> Iterator[Hit | None]:
        """`results` in order, the missed keys filled through the fill pool, `request_fills` in flight at a time.

        Raises `Abandoned` when `stop` is done while a fill is awaited.
        """
        pending = iter(missed)
        assert all(results[i] is None for i in missed)
        submitted: dict[int, Future[Hit | None]] = {}
        running: set[Future[Hit | None]] = set()

        def top_up() -> None:
            while len(running) < self._request_fills:
                j = next(pending, None)
                if j is None:
                    return
                future = self._fill_pool.submit(self._read, keys[j], release)
                submitted[j] = future
                running.add(future)

        try:
            top_up()
            for i, hit in enumerate(results):
                future = submitted.pop(i, None)
                if future is None:
                    # A cache hit or a plain miss: fills start in key order and one more starts
                    # after each is taken, so a missed key has always been submitted by now.
                    yield hit
                    continue
                while not future.done():
                    if stop is not None and stop.done():
                        raise Abandoned("the caller left before its reads finished: fills not yet started cancelled")
                    finished, _ = wait(running if stop is None else {*running, stop}, return_when=FIRST_COMPLETED)
                    running.difference_update(finished)
                    top_up()
                running.discard(future)
                top_up()
                yield future.result()
        finally:
            for future in submitted.values():
                future.cancel()

    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` into the cache ahead of a read, without counting as one.

        Returns the bytes fetched from object storage: 0 when the key was
        already cached, None when object storage does not have it.
        """
        self.check_key(key)
        with self._lock:
            self.counters["prefetches"] += 1
            if self._placement.holder(key) is not None:
                return 0
            if key in self._expired_dirty or not self._fills_from_l3(key):
                return None
        entry = self._fill(key)
        if entry is None:
            return None
        with self._lock:
            self.counters["prefetched_bytes"] += len(entry.value)
        return len(entry.value)

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
            InvalidKey, ValueTooLarge: the request is out of bounds (a lease
                over `max_lease_seconds`, a negative or infinite TTL included).
            ChecksumMismatch: `checksum` is given and does not match `value`.
            TierUnavailable: write-through and object storage is down.
            TierFull: cache-only and no cache tier has room for the value.
            Overloaded: write-back and the queue stayed full past the deadline.
        """
        self._pins.check(lease, ttl)
        self._put(key, value, self._verified_checksum(key, value, checksum), lease, ttl)

    def _verified_checksum(self, key: bytes, value: bytes, checksum: int | None) -> int:
        """The value's xxh3 after checking key, size and the sender's checksum."""
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

    def _put(self, key: bytes, value: bytes, actual: int, lease: float | None, ttl: float | None) -> None:
        namespace = self.namespace(key)
        mode = namespace.write_mode
        lease = namespace.lease_seconds if lease is None else lease
        ttl = namespace.ttl_seconds if ttl is None else ttl
        fits = self._placement.fits_anywhere(key, len(value))
        if mode is WriteMode.WRITE_BACK and not fits:
            mode = WriteMode.WRITE_THROUGH
        if mode is WriteMode.CACHE_ONLY and not fits:
            raise TierFull(f"value of {len(value)} bytes fits in no cache tier and key {key[:64]!r} is cache-only")
        write_back = self._writeback if mode is WriteMode.WRITE_BACK else None
        with self._locks(key):
            if mode is WriteMode.WRITE_THROUGH and self.l3 is not None:
                try:
                    self.l3.put(key, value, actual)
                except BaseException:
                    self._drop_unknown(key)
                    raise
            reserved = write_back.reserve(key) if write_back is not None else False
            try:
                with self._lock:
                    self.counters["puts"] += 1
                    self._expire()
                    self._fills.invalidate(key)
                    self._expired_dirty.discard(key)
                    self._pins.drop_ttl(key)
                    if lease <= 0:
                        self._pins.drop_lease(key)
                    self._placement.drop(key, forget=False)
                    if ttl > 0:
                        self._pins.expire_at(key, self._clock() + ttl)
                    if write_back is not None:
                        write_back.mark_dirty(key, reserved)
                        reserved = False
                    level = self._placement.place(key, value, actual) if fits else None
                    if level is not None and mode is not WriteMode.CACHE_ONLY:
                        self._freshness.known(key, self._clock())
                    if write_back is not None and level is not None and level is not self.l2:
                        self._keep_on_disk(key, value, actual)
                    if level is not None and lease > 0:
                        self._pins.lease(key, level, lease, self._clock())
                        self._placement.hold(level, key)
                        self.counters["leases"] += 1
                    elif lease > 0:
                        self._pins.drop_lease(key)
                    if level is None:
                        self.counters["puts_not_cached"] += 1
                        if mode is WriteMode.CACHE_ONLY or self.l3 is None:
                            self._pins.forget(key)
                            raise TierFull(
                                f"no cache tier has room for {len(value)} bytes under key {key[:64]!r} "
                                "(every resident value is leased or awaiting upload)"
                            )
            except BaseException:
                if write_back is not None:
                    write_back.release(reserved)
                raise
            if write_back is not None and level is None:
                # Nowhere to keep it until the flusher runs: upload it now.
                assert self.l3 is not None
                try:
                    self.l3.put(key, value, actual)
                finally:
                    write_back.discard(key)

    def _drop_unknown(self, key: bytes) -> None:
        """After a failed write-through upload, drops the cached copy of `key` (its `KeyLocks` lock held).

        The request may have reached object storage before the answer was
        lost (a reset, a timeout, a 5xx after the write): the object may now
        hold the new bytes. Keeping the old cached value would serve it
        indefinitely while object storage holds other bytes; dropped, the
        next read fetches whichever is there. A dirty value (newer than the
        object) and a leased one stay.
        """
        with self._lock:
            if self.dirty(key) or self._pins.leased(key) is not None:
                return
            self._forget(key)
            if self._placement.drop(key):
                self.counters["puts_failed_dropped"] += 1

    def _keep_on_disk(self, key: bytes, value: bytes, actual: int) -> None:
        """Writes a dirty value into L2 too, so an acknowledged write-back survives a crash (engine lock held).

        Best effort: when L2 has no room (full of values awaiting upload) the
        value stays in L1 only until the flusher uploads it, and is counted.
        """
        l2 = self.l2
        if l2 is None or not l2.fits_at_all(key, len(value)):
            return
        try:
            self._placement.install(l2, key, value, actual)
        except CacheError as exc:
            self.counters["writeback_memory_only"] += 1
            log.debug("a write-back value stays in memory only until uploaded: %s", exc)

    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes, int | None]],
        *,
        lease: float | None = None,
        ttl: float | None = None,
    ) -> None:
        """`put` for each (key, value, checksum); all are validated before any is written."""
        self._pins.check(lease, ttl)
        verified = [self._verified_checksum(key, value, checksum) for key, value, checksum in items]
        for (key, value, _), actual in zip(items, verified, strict=True):
            self._put(key, value, actual, lease, ttl)

    def delete(self, key: bytes) -> bool:
        """Removes `key` from every tier, object storage included; returns whether any held it.

        A range key's bytes are its object's: only the cached copy goes.
        """
        self.check_key(key)
        with self._locks(key):
            existed = False
            if self._fills_from_l3(key) and not is_range_key(key):
                assert self.l3 is not None
                existed = self.l3.delete(key)
            with self._lock:
                self.counters["deletes"] += 1
                self._forget(key)
                existed = self._placement.drop(key) or existed
        return existed

    def _forget(self, key: bytes) -> None:
        """Forgets every record of `key` outside the tiers (engine lock held)."""
        self._fills.invalidate(key)
        self._expired_dirty.discard(key)
        self._pins.forget(key)
        self._freshness.forget(key)
        if self._writeback is not None:
            self._writeback.discard(key)

    def evict(self, key: bytes) -> bool:
        """Drops `key` from the cache tiers only, uploading it first if it is dirty.

        Raises:
            TierUnavailable: the key is dirty and its upload failed; it stays cached.
        """
        self.check_key(key)
        with self._locks(key):
            if self._writeback is not None and not self._writeback.upload(key):
                raise TierUnavailable(f"cannot evict {key[:64]!r}: its write-back upload failed; it stays cached")
            with self._lock:
                self._forget(key)
                return self._placement.drop(key)

    def contains(self, key: bytes, cached_only: bool = False) -> str | None:
        """The name of the fastest tier holding `key`, or None. Not an access."""
        self.check_key(key)
        with self._lock:
            if key in self._expired_dirty or self._pins.expired(key, self._clock()):
                return None
            level = self._placement.holder(key)
            if level is not None:
                return level.name
        if cached_only or not self._fills_from_l3(key):
            return None
        assert self.l3 is not None
        return self.l3.name if self.l3.contains(key) else None

    def list_page(self, prefix: bytes, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
        """One page of the keys object storage holds under `prefix` (see `ListableTier`).

        Raises:
            NotConfigured: there is no object storage to list.
        """
        if not isinstance(self.l3, ListableTier):
            raise NotConfigured("List: this cache server has no object storage (s3.bucket is not set)")
        return self.l3.list_page(prefix, start_after, limit)

    def key_digest(
        self, prefix: bytes, epoch: int, since_seq: int, snapshot: bool, snapshot_after: int, max_entries: int
    ) -> DigestAnswer:
        """The held keys under `prefix` as digests, or the changes since `since_seq` (see `KeyIndex.read`).

        Keys past their TTL are dropped first, so the answer claims no key
        that `contains` would deny.

        Raises:
            InvalidKey: an empty prefix, or `max_entries` over the limit.
            NotConfigured: `prefix` is not one of the followed prefixes.
        """
        with self._lock:
            self._expire()
            pending = self.key_index.read(prefix, epoch, since_seq, snapshot, snapshot_after, max_entries)
        return pending()

    # -- leases and TTLs (engine lock held) -------------------------------

    def _expire(self) -> None:
        now = self._clock()
        leases, expired = self._pins.due(now)
        for key, _ in leases:
            self._placement.unhold(key)
            self.counters["leases_expired"] += 1
        for key in expired:
            self._expire_key(key)

    def _expire_key(self, key: bytes) -> None:
        """`key` passed its TTL: drop it, or (dirty) hide it until its upload, then drop it."""
        self.counters["ttl_expired"] += 1
        self._pins.forget(key)
        if self.dirty(key):
            self._expired_dirty.add(key)
            self.key_index.removed(key)  # it reads as a miss from now on
            return
        self._placement.drop(key)

    # -- lifecycle and stats ----------------------------------------------

    def flush(self, timeout: float) -> int:
        """Uploads queued write-back keys until none are left or `timeout` passes; returns the keys left."""
        return self._writeback.flush(timeout) if self._writeback is not None else 0

    def close(self, flush_timeout: float = 30.0) -> None:
        """Uploads what it can, keeps L1 (dirty values first) in L2 within its budget, and closes the tiers."""
        if self._closed:
            return
        self._closed = True
        self._fill_pool.shutdown(wait=True)
        left = self._writeback.close(flush_timeout) if self._writeback is not None else 0
        with self._lock:
            kept, lost = self._placement.demote_all()
            self.counters["kept_at_close"] += kept
            if lost:
                log.error("%d write-back values could not be kept in L2 at shutdown", lost)
            if left:
                log.warning("%d write-back keys not uploaded; they stay in L2 and retry on restart", left)
            for level in self._placement.levels:
                level.tier.close()
        self._chain.close()
        if self.l3 is not None:
            self.l3.close()

    def tier_info(self) -> dict[str, dict[str, str | int]]:
        """Each tier's `info()`, by tier name."""
        tiers: list[Tier] = [level.tier for level in self._placement.levels]
        if self.l3 is not None:
            tiers.append(self.l3)
        return {tier.name: tier.info() for tier in tiers}

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
                for level in self._placement.levels
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
            counters["pinned_keys"], counters["ttl_keys"] = self._pins.counts()
            counters["fills_in_flight"] = len(self._fills)
        counters.update(self._chain.counters())
        counters.update(self._writeback.counters() if self._writeback is not None else {"dirty_keys": 0})
        return {"tiers": tiers, "counters": counters}
