"""The tier engine: the one place that orchestrates reads and writes across tiers.

Read path: L1 (memory) -> L2 (local disk) -> the fill chain (`fillchain`:
a cluster node's peers, then object storage). A hit in L2 is promoted to L1;
a miss in both cache tiers is filled once, no matter how many readers miss
at the same time (`races.Fills`), and cached.

Writes (`writepath`), per key namespace (`namespaces`; the longest matching prefix wins):
- write-through (default): the value goes to L3 first, then into the cache,
  so an acknowledged put is durable in object storage; a failed one drops
  the cached copy, since the object may hold either value now;
- write-back: the value goes into the cache (L1, and L2 too, so a crash of the
  process does not lose it) and `WriteBack` uploads it; a dirty value is never
  evicted from the last cache tier before it is uploaded, and `close()` keeps
  what could not be uploaded in L2, flagged dirty;
- cache-only: never written to object storage (for example KV-cache blocks).

Each concern has one owner, below the engine, and none calls back up into it:
`KeyState` (leases, TTLs, dirty and hidden flags, freshness, versions),
`Placement` (which tier holds a value, eviction, demotion; it reads the key
state), `ReadPath` and `WritePath` (what a get and a put do below the
engine's checks), `WriteBack` (the upload queue and the flusher; it acts on the key
state and the placement it is handed), `FillChain` (where a miss is read
from), `Fills`, `Reads` and `KeyLocks` (the races), `ReadFeed` (who hears of
demand reads) and `KeyIndex` (the digests of held KV keys). The engine
decides the order of things and carries them out.

Integrity: every value carries its xxh3-64 checksum. L2 and L3 verify it on
every read; a mismatch is counted, the bad copy dropped, and the read goes on
to the tier below. Corrupt bytes are never returned.

Locking: one engine lock guards the key state, the policies and the memory
tier. Local-disk reads run outside it, registered in `Placement.reads`, so a
copy removed or replaced meanwhile is read again, never counted or promoted;
a filled value is written to local disk outside it too, in room reserved
under it and under its key's `KeyLocks` stripe, so no put or delete of the
key interleaves and a write that invalidates the fill keeps it out. Object
storage and peers are reached outside it, writes serialized per key by
`KeyLocks`, so two writes to one key reach L3 and the cache in the same order
and a delete is never followed by a stale upload. Puts, evictions and
demotions still write local disk under the lock.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cacheclient.wire import MAX_KEY_BYTES
from cacheclient.wire.ranges import is_range_key
from cachesvc.engine.behind import Behind
from cachesvc.engine.direct import DirectReads, DiskMarks
from cachesvc.engine.events import ReadFeed
from cachesvc.engine.fillchain import FillChain, FillSource, KnowsNewer, ObjectStorageFill
from cachesvc.engine.keyindex import DigestAnswer, KeyIndex
from cachesvc.engine.keystate import KeyState
from cachesvc.engine.namespaces import Hit, Namespace, Namespaces, WriteMode
from cachesvc.engine.pipeline import pipelined
from cachesvc.engine.placement import Level, Placement
from cachesvc.engine.races import Fills, KeyLocks
from cachesvc.engine.readpath import ReadPath, ToFill
from cachesvc.engine.versions import VersionClock
from cachesvc.engine.vouching import BulkVouching, ListedPages, Verdict
from cachesvc.engine.writeback import UploadOrder, WriteBack, WriteBackGate
from cachesvc.engine.writepath import Limits, WritePath
from cachesvc.errors import Overwrite, TierUnavailable
from cachesvc.policy.base import EvictionPolicy
from cachesvc.tiers.base import (
    Entry,
    ListableTier,
    NamedListingTier,
    PlacedFile,
    RevalidatingTier,
    SharedTier,
    Tier,
    VersionedTier,
)
from cachesvc.tiers.lmdb_tier import LMDBTier

__all__ = ["MAX_KEY_BYTES", "Engine", "Hit", "Namespace", "WriteMode"]

log = logging.getLogger(__name__)


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
        fill_behind_bytes: how many bytes of those L2 writes may wait, on one
            thread, behind the reads that filled L1 (`behind.Behind`); 0: the
            reader that led a fill writes it to L2 before it is answered.
        fill_idle_seconds: while L1 is shared (co-located clients read it)
            and at most half full, those L2 writes wait until no fill and no
            read came for this long (`Behind.defer`: passes over data that
            fits in L1 do not pay for them as they run); 0: they do not.
        max_lease_seconds: the longest lease a put may ask for.
        reads: where demand reads are published (see `ReadFeed`).
        key_index: the followed prefixes' digest logs (`KeyDigest`); None: none followed.
        revalidate_seconds: a hit on a value last known to match its object
            longer ago than this checks the object first, and reads it again
            if it changed (`KeyState`); 0: never (objects are immutable).
        vouch_listings: listings in flight at once while the copies found at
            start-up (or after a move) are vouched for in bulk
            (`cachesvc.engine.vouching`); 0: each is checked alone at its
            first read (one HEAD).
        vouch_gate: waited for before each such listing, with the seconds it
            may take: True once no other node can take a write the listing
            would miss (a cluster node's fences, `Fences.before_listing`);
            False: the listing decides nothing. None: a lone node's, nothing.
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
        fill_concurrency: int = 32,
        request_fills: int | None = None,
        fill_l2: bool = True,
        fill_behind_bytes: int = 64 << 20,
        fill_idle_seconds: float = 0.0,
        max_lease_seconds: float = 3600.0,
        reads: ReadFeed | None = None,
        key_index: KeyIndex | None = None,
        revalidate_seconds: float = 0.0,
        vouch_listings: int = 4,
        vouch_gate: Callable[[float], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._namespaces = Namespaces(namespaces)
        self.versions = VersionClock(wall_clock)
        if l1 is None and l2 is None:
            raise ValueError("the engine needs at least one cache tier (L1 or L2)")
        if l3 is None and self._namespaces.any_write_back():
            raise ValueError("write-back namespaces need object storage (L3) to write back to")
        if fill_sources and l3 is None:
            raise ValueError("fill sources are asked before object storage (L3), and there is none")
        if revalidate_seconds > 0 and l3 is not None and not isinstance(l3, RevalidatingTier):
            raise ValueError(f"revalidate_seconds: {l3.name} cannot tell whether an object changed")
        self.l1 = Level(l1, policy_factory(l1.name)) if l1 is not None else None
        # Local-disk reads are lock-free snapshots: they run outside the engine lock.
        self.l2 = Level(l2, policy_factory(l2.name), reads_unlocked=True) if l2 is not None else None
        self.l3 = l3
        self._chain = FillChain(
            [*fill_sources, ObjectStorageFill(l3)] if l3 is not None else [],
            verify=self._in_object_storage if isinstance(l3, VersionedTier) else None,
            adopt=self._adopt if isinstance(l3, VersionedTier) else None,
        )
        self.counters: Counter[str] = Counter()
        self.key_index = key_index if key_index is not None else KeyIndex([])
        self._state: KeyState[Level] = KeyState(
            max_lease_seconds, revalidate_seconds if l3 is not None else 0.0, clock, wall_clock
        )
        self._marks = DiskMarks(l2, self.counters) if isinstance(l2, LMDBTier) else None
        self._state.marks = self._marks
        self._placement = Placement(
            [lv for lv in (self.l1, self.l2) if lv is not None], self._state, self.counters, self.key_index
        )
        self.max_value_bytes = max_value_bytes
        self._limits = Limits(max_value_bytes)
        self._lock = threading.RLock()
        self._locks = KeyLocks()
        self._fills = Fills()
        self._fill_pool = ThreadPoolExecutor(fill_concurrency, thread_name_prefix="fill")
        self._request_fills = max(1, request_fills or fill_concurrency // 2)
        self._feed = reads if reads is not None else ReadFeed()
        self._closed = False
        self._writeback = (
            WriteBack(
                l3,
                self._placement,
                self._state,
                self._lock,
                self._locks,
                capacity=writeback_capacity,
                io_timeout=io_timeout,
                observe=self.versions.observe,
            )
            if l3 is not None
            else None
        )
        self._behind = (
            Behind(fill_behind_bytes, quiet=fill_idle_seconds, activity=self._reads_served)
            if fill_behind_bytes > 0 and l2 is not None
            else None
        )
        self._path = ReadPath(
            placement=self._placement,
            state=self._state,
            lock=self._lock,
            locks=self._locks,
            fills=self._fills,
            chain=self._chain,
            l3=l3,
            namespaces=self._namespaces,
            counters=self.counters,
            fill_l2=fill_l2,
            io_timeout=io_timeout,
            versions=self.versions,
            writeback=self._writeback,
            behind=self._behind,
        )
        if self._writeback is not None:
            self._writeback.vouch = self._path.vouch  # an unvouched dirty copy is checked before its upload
        self._write = WritePath(
            placement=self._placement,
            state=self._state,
            lock=self._lock,
            locks=self._locks,
            fills=self._fills,
            chain=self._chain,
            l3=l3,
            namespaces=self._namespaces,
            counters=self.counters,
            versions=self.versions,
            limits=self._limits,
            writeback=self._writeback,
            marks=self._marks,
        )
        self._direct = (
            DirectReads(l1, self._state, self._lock, self._placement.levels[0].policy, self._feed, self.counters)
            if isinstance(l1, SharedTier)
            else None
        )
        self._bulk = (
            BulkVouching(
                store=l3,
                state=self._state,
                lock=self._lock,
                peek=self._path.peek,
                end_read=self._placement.reads.end,
                drop=self._path.drop_stale,
                eligible=self._listing_vouches,
                counters=self.counters,
                versions=self.versions,
                in_flight=vouch_listings,
                wait=io_timeout,
                gate=vouch_gate,
            )
            if vouch_listings > 0 and isinstance(l3, NamedListingTier) and isinstance(l3, VersionedTier)
            else None
        )
        self._path.bulk = self._bulk
        # A move's keys come from their previous owners: their copies are checked a listing page at a time.
        self._pages = (
            ListedPages(l3, vouch_gate, wait=io_timeout)
            if self._bulk is not None and fill_sources and isinstance(l3, NamedListingTier)
            else None
        )
        if self._pages is not None:
            self._write.written = self._pages.wrote
        self._reopen()
        if self._bulk is not None:
            self._bulk.start()
        if self._marks is not None:
            self._marks.in_doubt(False)  # left by a node killed in doubt; every copy read back is marked now
            self._marks.tier.serve_direct_reads()  # co-located clients may read the file from here on
        if self._writeback is not None:
            self._writeback.start()

    @property
    def write_back_gate(self) -> WriteBackGate | None:
        """Passed by every write-back value before it is acknowledged (a cluster node's; None: none)."""
        return self._write.gate

    @write_back_gate.setter
    def write_back_gate(self, gate: WriteBackGate | None) -> None:
        self._write.gate = gate

    @property
    def direct_reads(self) -> Callable[[bytes], bool] | None:
        """Which keys co-located clients may read from the shared L1 without the engine (a cluster node's: the
        keys it owns); None: every key the engine would serve as it is (`cachesvc.engine.direct`)."""
        return self._direct.owned if self._direct is not None else None

    @direct_reads.setter
    def direct_reads(self, owned: Callable[[bytes], bool] | None) -> None:
        if self._direct is not None:
            self._direct.owned = owned
        if self._marks is not None:
            self._marks.tier.readable = owned  # and from L2's file: a key another node may write is marked

    def mark_unreadable(self) -> None:
        """After this node's view of which keys it owns changed: every L2 copy co-located clients may no longer
        read directly (`direct_reads`) is marked in the file."""
        if self._marks is not None:
            self._marks.mark_unreadable()

    def conceal_direct_reads(self) -> None:
        """Every key co-located clients read from the shared L1 is read through the engine again until it
        serves it (and may publish it) again: what the engine would serve as it is changed."""
        if self._direct is not None:
            with self._lock:
                self._direct.conceal_all()

    def doubt_direct_reads(self) -> None:
        """A cluster node cut off from the shard for half its lease: co-located clients read nothing
        directly (neither the shared L1 nor L2's file) until `suspect_cached` (its rejoin)."""
        self.conceal_direct_reads()
        if self._marks is not None:
            self._marks.in_doubt(True)

    def hold_direct_reads(self, hold: bool) -> None:
        """Co-located clients read nothing directly while `hold` (neither the shared L1 nor L2's file).

        For a cluster node a peer fenced with a map it has not followed
        yet: following it marks the copies of the keys that moved, which can
        take longer than the peer waits for its fence, and the peer then
        takes writes of them (`cachesvc.server.fences`). Released once the
        node holds that map; a hold does not end a lease's doubt, nor the
        other way round.
        """
        if self._direct is not None:
            with self._lock:
                self._direct.held = hold
                if hold:
                    self._direct.conceal_all()
        if self._marks is not None:
            self._marks.in_doubt(hold, reason=DiskMarks.FENCE)

    @property
    def checks_freshness(self) -> bool:
        """Whether a hit may check its object first (`revalidate_seconds`): copies co-located clients cannot
        read directly, since nothing on disk says which are due."""
        return self._state.checks_freshness

    def _reads_served(self) -> int:
        """Reads through the engine and co-located reads swept so far (a count that moves while clients read)."""
        return self.counters["gets"] + self.counters["direct_hit_keys"] + self.counters["prefetches"]

    def note_direct_hits(self) -> int:
        """Tells L1's policy and the prefetcher's open plans of the reads co-located clients made from the
        shared L1 since the last call; returns how many keys. Called from time to time by the server."""
        return self._direct.note_hits() if self._direct is not None else 0

    @property
    def shared_l1(self) -> SharedTier | None:
        """L1 when co-located clients read it without the server (`cachesvc.tiers.arena`), else None."""
        return self._direct.tier if self._direct is not None else None

    def hold_uploads_while(self, busy: Callable[[], bool]) -> None:
        """Write-back uploads wait while `busy()` (co-located writers have places open: a save under way), as
        they wait for puts to settle (`WriteBack.busy`)."""
        if self._writeback is not None:
            self._writeback.busy = busy

    @property
    def upload_order(self) -> UploadOrder | None:
        """Says when a write-back upload may skip the object's version check (a cluster node's; None: never)."""
        return self._writeback.order if self._writeback is not None else None

    @upload_order.setter
    def upload_order(self, order: UploadOrder | None) -> None:
        if self._writeback is not None:
            self._writeback.order = order

    def _reopen(self) -> None:
        """Rebuilds policies, TTLs, versions and the dirty set from what the tiers hold (a restart).

        Every copy found is unvouched: while this node was down its keys
        were other nodes' to write, so each is checked against object storage
        at its first read (`ReadPath`), and a dirty one before its upload.
        """
        found = [(level, list(level.tier.scan())) for level in self._placement.levels]
        for _, residents in found:
            for resident in residents:
                dirty = resident.dirty and self._writeback is not None and not self._state.dirty(resident.key)
                self._state.restore(resident.key, dirty, resident.expires_at)
                if resident.version:
                    self._state.set_version(resident.key, resident.version)
                    self.versions.observe(resident.version)
                if dirty and self._writeback is not None:
                    self._writeback.queue(resident.key)
            # An immutable namespace's values do not change under their names: nothing to check.
            self._state.unvouch([r.key for r in residents if not self._namespaces.of(r.key).immutable])
        for level, residents in found:
            for resident in residents:
                self.key_index.admitted(resident.key)
                if not self._placement.held(level, resident.key):
                    level.policy.on_insert(resident.key, resident.cost)

    def _listing_vouches(self, key: bytes) -> bool:
        """Whether a listing may vouch for the cached copy of `key` (engine lock held): a clean copy of a key
        object storage holds the newest value of. Not a dirty copy, a range key, a cache-only key, nor a key
        of a write-back namespace when a peer may hold a newer value (only it can say)."""
        if self._state.dirty(key) or is_range_key(key):
            return False
        mode = self._namespaces.of(key).write_mode
        if mode is WriteMode.CACHE_ONLY:
            return False
        return mode is not WriteMode.WRITE_BACK or not any(isinstance(s, KnowsNewer) for s in self._chain.sources)

    @property
    def vouch_walks(self) -> Callable[[bytes], bool] | None:
        """Which unvouched copies the background check vouches for by listing (a cluster node's: those of the
        keys it owns now; the rest at their first read); None: every one."""
        return self._bulk.walks if self._bulk is not None else None

    @vouch_walks.setter
    def vouch_walks(self, walks: Callable[[bytes], bool] | None) -> None:
        if self._bulk is not None:
            self._bulk.walks = walks

    def vouching(self) -> dict[str, float | int] | None:
        """How far the check of the copies found at start-up (or after a move) is: copies to check, checked,
        kept, dropped, left to their first read, listings, seconds, rate; None when copies are not vouched
        for in bulk."""
        return self._bulk.progress() if self._bulk is not None else None

    def dirty_count(self) -> int:
        """How many write-back values are not uploaded yet."""
        with self._lock:
            return self._state.dirty_count()

    def dirty(self, key: bytes) -> bool:
        """Whether object storage lacks the newest value of `key` (a write-back value not yet uploaded)."""
        with self._lock:
            return self._state.dirty(key)

    def uploaded(self, key: bytes) -> bool:
        """Whether object storage holds the bytes cached for `key`: written or filled through this node (a
        peer's copy only once checked against object storage), not dirty, not cache-only; an unvouched
        copy is checked against object storage first (one HEAD)."""
        if self.l3 is None or self.write_mode(key) is WriteMode.CACHE_ONLY:
            return False
        with self._lock:
            dirty, unvouched = self._state.dirty(key), self._state.unvouched(key)
        if dirty:
            return False
        if unvouched:
            # A clean copy read back after a restart or a move: one HEAD says whether S3 holds these
            # bytes (otherwise it would read "not uploaded" until something read it).
            try:
                self._path.vouch(key)
            except TierUnavailable:
                return False
        with self._lock:
            return not self._state.dirty(key) and not self._state.unvouched(key)

    # -- validation -----------------------------------------------------

    def check_key(self, key: bytes) -> None:
        """Raises InvalidKey unless 1 <= len(key) <= MAX_KEY_BYTES and a range key (`cacheclient.wire.ranges`)
        names a valid range; ValueTooLarge when the range is over max_value_bytes."""
        self._limits.check_key(key)

    def check_size(self, size: int) -> None:
        """Raises ValueTooLarge when `size` is over max_value_bytes."""
        self._limits.check_size(size)

    @property
    def namespaces(self) -> Namespaces:
        """The namespace table writes follow (a cluster node replaces it with the shard's)."""
        return self._namespaces

    def namespace(self, key: bytes) -> Namespace:
        """The namespace `key` belongs to (the longest matching prefix)."""
        return self._namespaces.of(key)

    def write_mode(self, key: bytes) -> WriteMode:
        return self._namespaces.of(key).write_mode

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
        hit = self._path.read(key, release)
        self._feed.publish([key])
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
                self._state.suspect_all()
                if self._direct is not None:
                    self._direct.conceal_all()
        self.unvouch_cached()
        if self._marks is not None:
            self._marks.in_doubt(False)  # every copy L2 holds is marked now (`doubt_direct_reads`)

    def fill_source(self, name: str) -> FillSource | None:
        """The fill chain's source named `name` ("handover", "peers", "l3"), or None."""
        return next((source for source in self._chain.sources if source.name == name), None)

    def clean_copy(self, key: bytes) -> bytes | None:
        """The cached value of `key` unless it is one object storage lacks (dirty, or cache-only), from the
        cache tiers alone; None otherwise, and for a write-back key (see `handed_over`). Not a read. For a
        handover: the copy of a key that moved away is unvouched here, and its new owner checks it against
        object storage before it keeps it."""
        if not self.handed_over(key):
            return None
        with self._lock:
            if self._state.dirty(key):
                return None
        found = self._path.peek(key)
        if found is None:
            return None
        entry, ticket = found
        with self._lock:
            unchanged = self._placement.reads.end(ticket)
            if not unchanged or self._state.dirty(key):
                return None
        return bytes(entry.value)

    def handed_over(self, key: bytes) -> bool:
        """Whether a copy of `key` may be handed over after a move (`cachesvc.server.handover`): one object
        storage holds. Not a cache-only key (nothing to check it against), nor a write-back one: a handed-over
        copy is checked against object storage alone, which says nothing of a newer value another node took
        and has not uploaded yet (the Jepsen runs read one so, after an undrain); such a key's first read asks
        its previous owner, which uploads first (`cachesvc.server.peers`)."""
        return self.l3 is not None and self.write_mode(key) is WriteMode.WRITE_THROUGH

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to the counter `name` (Stats), for what the server does around the engine."""
        with self._lock:
            self.counters[name] += n

    def cached_bytes(self) -> int:
        """The bytes the cache tiers hold, all together."""
        with self._lock:
            return sum(level.tier.used_bytes for level in self._placement.levels)

    def cached_keys(self, limit: int) -> list[bytes]:
        """Up to `limit` keys the cache tiers hold, L1's first (its hot set), each once; range keys left out."""
        keys: dict[bytes, None] = {}
        for level in self._placement.levels:
            if level.reads_unlocked:
                listed = list(level.tier.list_keys())
            else:
                with self._lock:
                    listed = list(level.tier.list_keys())
            for key in listed:
                if len(keys) >= limit:
                    return list(keys)
                if not is_range_key(key):
                    keys[key] = None
        return list(keys)

    def unvouch(self, keys: Sequence[bytes]) -> None:
        """The cached copies of `keys` are checked against object storage at their next read (`ReadPath`),
        and no read joins a fill of them begun before (see `unvouch_cached`)."""
        with self._lock:
            self._state.unvouch(list(keys))
            for key in keys:
                self._fills.invalidate(key)
            if self._direct is not None:
                self._direct.conceal(keys)

    def unvouch_cached(self, where: Callable[[bytes], bool] | None = None) -> None:
        """Every copy cached now (of the keys `where` picks) is checked against object storage before it is
        served again (`ReadPath`).

        For a node whose keys moved away or back (a drain and its cancel, a
        lease lost and regained, a join): while they were elsewhere, others
        wrote them. Costs one HEAD per key at its next read (a cache-only
        key: none), and a scan of the cache tiers' keys now.

        Fills of those keys begun before are invalidated too: a fill whose L2
        write is still behind stays joinable, and a reader that missed a copy
        L1 dropped without demoting it got the fill's value unchecked.
        """
        keys: list[bytes] = []
        for level in self._placement.levels:
            if level.reads_unlocked:
                # Local disk is listed outside the lock (a put meanwhile only costs its key one more HEAD).
                keys.extend(key for key in level.tier.list_keys() if where is None or where(key))
            else:
                with self._lock:
                    keys.extend(key for key in level.tier.list_keys() if where is None or where(key))
        keys = [key for key in keys if not self._namespaces.of(key).immutable]  # nothing to check (`_reopen`)
        with self._lock:
            if self._bulk is not None:
                self._bulk.unvouching()
            if self._pages is not None:
                self._pages.moved()
            self._state.unvouch(keys)
            self._fills.invalidate_where(where)
            if self._direct is not None:
                self._direct.conceal(keys)
            self.counters["unvouched"] += len(keys)
        if self._bulk is not None and keys:
            self._bulk.start()  # checked in bulk from now, ahead of their reads

    def _in_object_storage(self, key: bytes, entry: Entry) -> Entry | None:
        """A copy a peer gave, checked against object storage (one HEAD); None when the object is not those
        bytes (deleted, or replaced since). Raises TierUnavailable when object storage cannot answer."""
        assert isinstance(self.l3, VersionedTier)
        verdict = self._listed_verdict(key, entry)
        if verdict is not Verdict.ASK:
            with self._lock:
                self.counters["peer_fills_listed"] += 1
                if verdict is Verdict.DROP:
                    self.counters["peer_fills_refused"] += 1
                    return None
            return Entry(entry.value, entry.checksum)  # its version is not known: the object's is not listed
        version = self.l3.vouch(key, entry.value, entry.checksum)
        with self._lock:
            self.counters["peer_fills_checked"] += 1
            if version is None:
                self.counters["peer_fills_refused"] += 1
                return None
        self.versions.observe(version)
        return Entry(entry.value, entry.checksum, version=version)

    def _listed_verdict(self, key: bytes, entry: Entry) -> Verdict:
        """What a listing page (`ListedPages`) says of a copy a peer gave; ASK: it is checked alone."""
        if self._pages is None:
            return Verdict.ASK
        with self._lock:
            if not self._listing_vouches(key):
                return Verdict.ASK
        try:
            return self._pages.check(key, entry.value)
        except Exception as exc:  # the HEAD meets it too, and says so
            log.debug("listing around %r failed: %s", key[:64], exc)
            return Verdict.ASK

    def _adopt(self, key: bytes, entry: Entry, version: int) -> Entry | None:
        """A copy a peer holds dirty (it could not upload it), at `version` there, taken over as this node's
        own write-back value when object storage has no object of `key`, or one of a version older than
        `version` (one HEAD); None otherwise (an object of unknown version is not ordered: refused). It
        keeps its version (a new one when the peer's is not known)."""
        assert isinstance(self.l3, VersionedTier)
        if self._writeback is None:
            return None
        gate = self.write_back_gate
        if gate is not None:
            if not gate.enter():
                return None  # the cluster cannot be told this node would hold it
            gate.leave()  # marked dirty within the gate's quiet time (`WriteBackGate`)
        theirs = self.l3.head_version(key)
        if theirs is not None and not (version and theirs and theirs < version):
            return None
        with self._lock:
            self.counters["peer_fills_adopted"] += 1
            if version:
                self.versions.observe(version)
        return Entry(entry.value, entry.checksum, dirty=True, version=version or self.versions.next())

    def get_cached(self, key: bytes) -> Hit | None:
        """`get` from the cache tiers alone: a miss never reads object storage (what a peer asks,
        `cachesvc.server.peers`). Not published as a demand read: no plan of this server's waits on it.

        Raises:
            InvalidKey: the key is empty or too long.
        """
        self.check_key(key)
        if self._writeback is not None and self.dirty(key):
            # A peer asks because the key moved to it: hand the value over through object storage first
            # (uploaded only if still the newest there: a superseded one goes and reads as a miss), so the
            # copy the peer keeps is one object storage holds. When the upload fails the value is given
            # as it is, and the peer takes it over as its own value to upload (`FillChain`).
            with self._locks(key):
                self._writeback.upload(key)
        [found] = self._path.look([key], False, join=False, count="peer_reads")
        return found if isinstance(found, Hit) else None

    def drop_cached(self, key: bytes) -> bool:
        """Drops every cached copy of `key`, a dirty one too, without touching object storage.

        What a key's new owner sends its previous owners before it deletes the
        key (`cachesvc.server.peers.PeerFill.drop`): a copy they hold,
        dirty or not, must neither be uploaded over the delete nor served.
        """
        self.check_key(key)
        return self._write.drop_cached(key)

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
        if self._bulk is not None and self._state.any_unvouched:
            self._bulk.vouch_keys(keys)  # a listing page each, not a HEAD each: then read as one batch
        with self._lock:
            checks, unvouched = self._state.checks_freshness, self._state.any_unvouched
            due = [
                (checks and self._state.check_due(key)) or (unvouched and self._state.unvouched(key)) for key in keys
            ]
        looked = self._path.look([key for key, d in zip(keys, due, strict=True) if not d], release, join=False)
        results: list[Hit | None] = [None] * len(keys)
        missed: list[int] = []
        answers = iter(looked)
        plain_misses = 0
        for i, checked in enumerate(due):
            found = None if checked else next(answers)
            if checked or isinstance(found, ToFill):
                missed.append(i)  # `ReadPath.read` checks its copy or object first, or fills it (and counts it)
            elif isinstance(found, Hit):
                results[i] = found
            else:
                plain_misses += 1
        with self._lock:
            self.counters["gets"] += len(keys) - len(missed)
            self.counters["misses"] += plain_misses
        pipeline = len(missed) > 1 or (len(missed) == 1 and stop is not None)
        if len(missed) == 1 and not pipeline:
            results[missed[0]] = self._path.read(keys[missed[0]], release)
        source = (
            pipelined(
                results,
                missed,
                lambda j: self._fill_pool.submit(self._path.read, keys[j], release),
                self._request_fills,
                stop,
            )
            if pipeline
            else iter(results)
        )
        # Demand reads are published for the prefetch plans: all of them before the last hit goes out
        # (a caller need not ask past it), or, when the caller stops early, those it was given.
        given = 0
        try:
            for hit in source:
                given += 1
                if given == len(keys):
                    self._feed.publish(keys)
                yield hit
        finally:
            if 0 < given < len(keys):
                self._feed.publish(keys[:given])
            if isinstance(source, Generator):
                source.close()  # cancels the fills not yet started

    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` into the cache ahead of a read, without counting as one.

        Returns the bytes fetched from object storage: 0 when the key was
        already cached, None when object storage does not have it.
        """
        self.check_key(key)
        return self._path.prefetch(key)

    # -- writes ---------------------------------------------------------

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int | None = None,
        *,
        lease: float | None = None,
        ttl: float | None = None,
        durable: bool = False,
    ) -> None:
        """Stores `value` under `key` as its namespace's write mode says (`writepath`).

        Args:
            lease: seconds to pin the value (see the class docs); None: the
                namespace's default.
            ttl: seconds until the value expires; None: the namespace's default.
            durable: the value survives this server being killed once `put`
                returns: in object storage, or on local disk (L2) too when the
                write mode would keep it in memory only.

        Raises:
            InvalidKey, ValueTooLarge: the request is out of bounds (a lease
                over `max_lease_seconds`, a negative or infinite TTL included).
            ChecksumMismatch: `checksum` is given and does not match `value`.
            TierUnavailable: write-through and object storage is down.
            TierFull: cache-only and no cache tier has room for the value.
            Overloaded: write-back and the queue stayed full past the deadline.
            NotConfigured: `durable`, and this server has neither local disk
                nor object storage for the key (before anything is written),
                or its disk has no room for the value.
            Overwrite: the key is in an immutable namespace and exists.
        """
        self._refuse_overwrites([key])
        self._write.put_many([(key, value, checksum)], lease=lease, ttl=ttl, durable=durable)

    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes | PlacedFile, int | None]],
        *,
        lease: float | None = None,
        ttl: float | None = None,
        durable: bool = False,
    ) -> None:
        """`put` for each (key, value, checksum); all are validated before any is written."""
        self._refuse_overwrites([key for key, _, _ in items])
        self._write.put_many(items, lease=lease, ttl=ttl, durable=durable)

    def _refuse_overwrites(self, keys: Sequence[bytes]) -> None:
        """Raises Overwrite when one of `keys` is in an immutable namespace and exists: cached here, or an object
        (one HEAD each). Another node's put of the same key at the same moment is not seen (no conditional PUT)."""
        for key in keys:
            namespace = self._namespaces.of(key)
            if not namespace.immutable:
                continue
            self.check_key(key)
            if self._path.cached_tier(key) is not None or (
                self._fills_from_l3(key) and self.l3 is not None and self.l3.contains(key)
            ):
                raise Overwrite(key, namespace.prefix)

    def delete(self, key: bytes) -> bool:
        """Removes `key` from every tier, object storage included; returns whether any held it.

        A range key's bytes are its object's: only the cached copy goes.
        """
        self.check_key(key)
        return self._write.delete(key)

    def evict(self, key: bytes) -> bool:
        """Drops `key` from the cache tiers only, uploading it first if it is dirty.

        Raises:
            TierUnavailable: the key is dirty and its upload failed; it stays cached.
        """
        self.check_key(key)
        return self._write.evict(key)

    def release(self, keys: Sequence[bytes]) -> int:
        """Ends one holder's lease on each of `keys`, as a get with `release=True` does, without reading it.

        A routing client ends a replicated key's lease this way on the replicas
        it did not read. Returns how many of the keys were leased.
        """
        for key in keys:
            self.check_key(key)
        released = 0
        with self._lock:
            for key in keys:
                if self._state.leased(key) is None:
                    continue
                released += 1
                if self._state.release(key) is not None:
                    self._placement.unhold(key)
            self.counters["leases_released"] += released
        return released

    def contains(self, key: bytes, cached_only: bool = False) -> str | None:
        """The name of the fastest tier holding `key`, or None. Not an access."""
        self.check_key(key)
        level = self._path.cached_tier(key)
        if level is not None:
            return level.name
        if cached_only or not self._fills_from_l3(key):
            return None
        assert self.l3 is not None
        return self.l3.name if self.l3.contains(key) else None

    def cached_version(self, key: bytes) -> int:
        """The version of the copy of `key` the cache tiers hold (0: none recorded, or not cached)."""
        with self._lock:
            return self._state.version(key)

    def list_page(
        self, prefix: bytes, start_after: bytes, limit: int, *, cached: bool = False
    ) -> tuple[list[tuple[bytes, int]], bool]:
        """One page of (key, size) under `prefix` after `start_after`, in key order, and whether more follow.

        Object storage's keys (see `ListableTier`); with `cached`, or on a
        server without object storage, the keys this server's cache tiers hold.
        """
        if cached or not isinstance(self.l3, ListableTier):
            return self._list_cached(prefix, start_after, limit)
        return self.l3.list_page(prefix, start_after, limit)

    def _list_cached(self, prefix: bytes, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
        # A key in two tiers (a copy being promoted) is listed once; expired keys are left out.
        # The tiers read under the engine lock are scanned under it, the last one outside it.
        now = time.time()
        sizes: dict[bytes, int] = {}

        def take(level: Level) -> None:
            for found in level.tier.scan():
                key = found.key
                if key > start_after and key.startswith(prefix) and not 0 < found.expires_at <= now:
                    sizes.setdefault(key, found.size)

        with self._lock:
            for level in self._placement.locked:
                take(level)
        if self._placement.unlocked is not None:
            take(self._placement.unlocked)
        keys = heapq.nsmallest(limit + 1, sizes)
        return [(key, sizes[key]) for key in keys[:limit]], len(keys) > limit

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
            self._placement.expire_due()
            pending = self.key_index.read(prefix, epoch, since_seq, snapshot, snapshot_after, max_entries)
        return pending()

    # -- lifecycle and stats ----------------------------------------------

    def flush(self, timeout: float) -> int:
        """Uploads queued write-back keys until none are left or `timeout` passes; returns the keys left."""
        return self._writeback.flush(timeout) if self._writeback is not None else 0

    def close(self, flush_timeout: float = 30.0) -> None:
        """Uploads what it can, keeps L1 (dirty values first) in L2 within its budget, and closes the tiers."""
        if self._closed:
            return
        self._closed = True
        if self._bulk is not None:
            self._bulk.close()
        self._fill_pool.shutdown(wait=True)
        if self._behind is not None:
            self._behind.close()
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
            counters["pinned_keys"], counters["ttl_keys"] = self._state.counts()
            counters["fills_in_flight"] = self._fills.fetching()
            counters["dirty_keys"] = self._state.dirty_count()
            counters["unvouched_keys"] = self._state.unvouched_count()
        if self._bulk is not None:
            vouching = self._bulk.progress()
            counters["vouch_held"], counters["vouch_checked"] = int(vouching["held"]), int(vouching["checked"])
            counters["vouch_rate"], counters["vouch_done"] = int(vouching["rate"]), int(vouching["done"])
            counters["vouch_left_to_reads"] = int(vouching["left_to_reads"])
            counters["vouch_millis"] = int(float(vouching["seconds"]) * 1000)
        if self._pages is not None:
            counters["peer_fill_listings"] = self._pages.listings
        if self._behind is not None:
            counters["l2_fills_behind"], counters["l2_fills_behind_full"] = self._behind.ran, self._behind.refused
            counters["l2_fills_behind_bytes"] = self._behind.backlog_bytes
            counters["l2_fills_deferred"] = self._behind.deferred_waiting
        counters.update(self._chain.counters())
        if self._writeback is not None:
            counters.update(self._writeback.counters())
        return {"tiers": tiers, "counters": counters}
