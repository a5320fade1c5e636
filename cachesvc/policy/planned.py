"""Plan-aware eviction: the plans' known future and every other key's guessed one, on one scale.

This module owns `PlanAware`, a policy that wraps another (LRU-K on a
server) and the contract of the known future it consults (`PlannedFuture`:
for a key, its next read in each open prefetch plan).

The scale is the tier's own references: a tick is one insert or hit this
policy sees. The victim is the key whose next read is expected furthest in
ticks, whichever kind it is:

* A key some open plan will read (a planned key) is due in
  `(position - cursor) * pace` ticks for each plan that will read it, and
  its distance is the nearest of those. A plan's pace is the ticks per
  position it has taken since this policy first saw it open,
  `(ticks + 1) / (positions read + 1)`: a plan that gets one read in three
  of the tier's references is three ticks a position, and a plan that
  stalls drifts further away. The distance of a use is its index in the
  plan minus the plan's cursor (the plan's reads so far). Among planned
  keys the furthest goes first (Belady's MIN); ties go to the larger key,
  bytewise.
* A key no open plan will read (an unplanned key) is expected back in its
  mean interval over all the history kept of it,
  `(now - first) / (references - 1)` ticks (the Poisson estimate of its
  interval from its first reference to now; counts over `EXACT_COUNTS`
  rounded down to their `COUNT_BITS` leading bits, at most a quarter
  under); a key with fewer than K
  references, at infinity. Issue 26's mixes replaced the backward
  K-distance (`(now - HIST(K)) / (K - 1)`, LRU-K's ranking) with it: a
  Zipf-popular key's last two references say little of its rate, all of
  them say much (1.21x Belady's fetches on the issue mix at 50% against
  1.40x). A key an open plan has read for the last time (an epoch
  planned as it starts: its tenant reads the rest of the plan first) is
  expected after that plan's end, its remaining positions times its pace
  (the lowest-numbered such plan), plus half a pass of the plan (all its
  positions at its pace): the next pass reads it anywhere in its run. That
  holds until something else reads it or the plan closes. (Half its own
  interval in place of half a pass, as before, cost fetches on issue 26's
  mixes: planned-heavy at 50% of the objects 10,563 against 10,509.)
  Against the planned keys, the unplanned candidate is the one expected
  furthest ahead (ties: fewer than K references first, then the older last
  reference for those, the older first reference for the rest).

The unplanned candidate goes when its estimate is at least the furthest
planned key's distance; otherwise that planned key goes. While a plan is
open and no planned key is resident the unplanned candidate goes, ranked
the same way (issue 26's unplanned-heavy mix at 1% of the objects: 40,487
fetches against 45,123 when the wrapped policy chose there, its LRU-K
taking a hot Zipf key's quick rereads for one correlated reference). With
no plan open the wrapped policy alone chooses (it holds only the unplanned
keys, and sees every reference to them), so with no plan open this is
exactly the wrapped policy. A key read once and never again (a
scan) still goes before any planned key; a hot unplanned key (a KV prefix
read every few hundred ticks) outlives a planned key whose read is an
epoch away; and a fetched-ahead value is ranked by its read like any
other planned key, so prefetching protects it no further than its
distance. Every key's first and last reference ticks and its count of
references are kept while it is resident and, for `RETAINED_PER_RESIDENT`
times as many evicted keys as there are resident ones (those referenced
fewest times forgotten first, then the earliest evicted), after it leaves:
a popular key evicted and read again resumes its rate instead of starting
as a stranger.

Fairness: a plan's protected set is the resident keys it will read outside
its window; it may hold at most `fair_share` times the share of the tier's
references it earns (capped at the whole tier) of the resident bytes. A
plan earns the references to keys it will read (its reads and its
prefetch fills), decayed with a half-life of `share_half_life` ticks, as a
share of every reference since it opened: `(earned + 1) / (ticks + 1)`,
so a plan just opened has the whole tier. While a plan is over that bound
and the victim chosen above is expected back at all (a finite estimate)
and is no plan's (no open plan will read it, nor read it for the last
time), the victim is instead the over-bound plan's key read furthest ahead
in it (the plan most over its bound by ratio, ties to the lower plan
number). A plan alone on a tier earns the whole of it. The bound is for
tenants without a plan: their next reads are estimates, and no window
fetches ahead of them. Between plans it does not apply: each key's next
read is known (for a key a plan read for the last time, its next pass),
the furthest goes (Belady), and each plan's window still fetches its next
values ahead of its reads. `fairness_evictions` counts the evictions so
chosen and `shares()` gives each plan's protected fraction of the resident
bytes.

A fill of a value a plan fetched ahead is a tick, but not a reference of
its own in the key's history: the read that follows replaces it, so a
prefetched value is not taken for a hot key (two references one tick
apart) once no plan reads it.

Cost: plans' cursors move without telling the policy, so keys are kept in
one max-heap per plan ordered by planned index (an order the cursor does not
change), each key in the heap of its nearest use as last seen, and in a
second heap per plan for each plan that will read it (for fairness). A
victim is the best of the plans' heap tops by current distance, re-checked
against the key's uses now: a heap entry's distance is an upper bound of the
key's (the nearest use is at most the filed one), so if the best top is
still filed at its nearest use it is the furthest key; otherwise it is
re-filed and the choice repeated. Each event costs O(log n) amortized plus,
for a key in a plan, one look at each open plan (`PlannedFuture.uses`);
a victim costs one look at each plan's heap top. Keys whose future changed
come from the future's change queue (only keys this tier holds are queued),
drained at every event, `SYNC_BATCH` at a time.

Unplanned keys are filed in one heap per group (the plan that read them for
the last time, if any, and their rounded count), ordered by first reference
(last, below K references), an order that time does not change; a victim
looks at each group's top, about 80 groups for counts up to a million
(16 exact counts, then 4 per doubling).

Memory per resident key, beyond the wrapped policy's: its first and last
reference ticks and count (a list of 3 ints) and dict entry; a planned key
also a record, one nearest-heap entry and one entry per plan that reads it.
Evicted keys' histories (the same list and dict entry, and a heap entry) are kept for at most
`RETAINED_PER_RESIDENT` times as many keys as are resident.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from cachesvc.policy.base import EvictionPolicy

__all__ = ["DEFAULT_FAIR_SHARE", "SYNC_BATCH", "PlanAware", "PlannedFuture", "PlannedUse"]

EXACT_COUNTS = 16
"""An unplanned key's reference count is used as it is up to this; above, rounded down to its
`COUNT_BITS` leading bits (so keys fall in few groups, each kept in reference order: a victim looks at
one key per group)."""

COUNT_BITS = 3
"""Leading bits kept of a count over `EXACT_COUNTS`: a count is at most a quarter over its rounded value,
so a key's estimated interval at most a third over its mean interval. Rounding to 16 times a power of
two (up to half under, intervals up to twice too long) threw out hot Zipf keys on issue 26's mixes
(planned-heavy mix at 50% of the objects: 10,559 fetches against 10,509; issue mix at 20%: 27,496
against 27,380)."""

RETAINED_PER_RESIDENT = 2
"""Evicted keys whose histories are kept, per resident key. Twice rather than once: on issue 26's
mixes a Zipf key read every few thousand reads lost its history between reads at one (unplanned-heavy
mix at 5% of the objects: 32,926 fetches against 32,495; issue mix at 20%: 27,490 against 27,380)."""

SYNC_BATCH = 1024
"""Changed keys a policy re-files per event at most: a plan starting or ending over a tier that holds
many of its keys is applied over several events (about 13 us a key, so at most about 15 ms an
event), never in one long hold of the engine lock. Until then a key may still be ranked as filed."""

DEFAULT_FAIR_SHARE = 3.0
"""A plan's protected set (beyond its window) may hold this times the share of the tier's references
it earns, capped at the whole tier: a plan earning under a third of the references cannot take the
whole tier. The bound costs fetches by design (it keeps keys Belady would not); on
`bench/plan_eviction.py`'s mixed traces (20,000 reads) 3.0 cost at most 1.2% more fetches than no
bound (None) where 1.5 cost up to 11% and 2.0 up to 7%; since it leaves choices between plans to
their next reads, at most 0.42% on the 60,000-read traces, none where every read is planned."""

DEFAULT_SHARE_HALF_LIFE = 1024
"""Ticks (the tier's references): the half-life of the references a plan's share is earned by."""

_INF = math.inf


def _rounded(count: int) -> int:
    """`count` up to EXACT_COUNTS, else rounded down to its COUNT_BITS leading bits."""
    if count <= EXACT_COUNTS:
        return count
    shift = count.bit_length() - COUNT_BITS
    return count >> shift << shift


class PlannedUse(NamedTuple):
    """The next read of a key in one open plan."""

    plan: int
    """The plan's number (unique while the server runs)."""
    position: int
    """The position of the read in the plan."""
    cursor: int
    """The plan's cursor: every position below it has been read."""
    in_window: bool
    """Whether the plan has fetched, or is fetching, the value for this read."""


class Changes(Protocol):
    def drain(self, limit: int) -> list[bytes]:
        """Up to `limit` keys whose planned uses changed since the last drain."""
        ...


class PlannedFuture(Protocol):
    """What `PlanAware` needs to know of the open plans."""

    def follow(self, cares: Callable[[bytes], bool]) -> Changes:
        """A queue of the keys `cares` accepts whose uses change from now on (`cares` may be
        called from any thread)."""
        ...

    def uses(self, key: bytes) -> Sequence[PlannedUse]:
        """The next read of `key` in each open plan that will read it (empty: none will)."""
        ...

    def uses_many(self, keys: Sequence[bytes]) -> Sequence[Sequence[PlannedUse]]:
        """`uses` of each of `keys`, in order."""
        ...

    def cursor(self, plan: int) -> int | None:
        """A plan's cursor now; None once it is closed."""
        ...

    def open_plans(self) -> tuple[int, ...]:
        """The open plans' numbers; the same object until a plan opens or closes (cheap to poll)."""
        ...

    def remaining(self, plan: int) -> int | None:
        """A plan's positions from its cursor to its end; None once it is closed."""
        ...

    def evicted(self, key: bytes) -> None:
        """The tier evicted `key` (plans count a fetched value lost before its read)."""
        ...


class _Planned:
    """A resident key some plan will read: where it is filed, and which plans claim it."""

    __slots__ = ("claims", "index", "plan", "size", "version")

    def __init__(
        self, size: int, plan: int, index: int, claims: tuple[tuple[int, int, bool], ...], version: int
    ) -> None:
        self.size = size
        self.plan = plan  # the plan of its nearest use when filed
        self.index = index
        self.claims = claims  # (plan, position, in_window) for every plan that will read it
        self.version = version


_Heap = list[tuple[int, int, bytes]]  # (-index, version, key): the key read furthest ahead first


class PlanAware:
    """Evicts the key expected furthest ahead, planned or not (see the module docs).

    Args:
        inner: the policy for keys no plan will read (it sees only those).
        future: the open plans' next reads.
        reports_evictions: tell `future` of each eviction, so plans count
            fetched values lost before their read (set on the tier that
            prefetches fill, L1).
        k: the references an unplanned key needs for a finite estimate
            (fewer: never expected back); 2 matches the server's LRU-K.
        fair_share: a plan's protected set may hold this times the share of
            references it earns (see the module docs); None: no bound.

    Raises:
        ValueError: a parameter is out of range.
    """

    def __init__(
        self,
        inner: EvictionPolicy,
        future: PlannedFuture,
        *,
        reports_evictions: bool = False,
        k: int = 2,
        fair_share: float | None = DEFAULT_FAIR_SHARE,
        share_half_life: int = DEFAULT_SHARE_HALF_LIFE,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if fair_share is not None and not fair_share > 0:
            raise ValueError(f"fair_share must be > 0 or None, got {fair_share!r}")
        if isinstance(share_half_life, bool) or not isinstance(share_half_life, int) or share_half_life < 1:
            raise ValueError(f"share_half_life must be an integer >= 1, got {share_half_life!r}")
        self.inner = inner
        # The configured policy's name (what Stats and `cachectl stats` show): every server's tiers
        # are plan-aware, and with no plan open this is exactly `inner`.
        self.name = getattr(inner, "name", type(inner).__name__)
        self._future = future
        self._k = k
        self._share = fair_share
        self._decay = 0.5 ** (1 / share_half_life)
        self._arriving: bytes | None = None  # the key being inserted, held from before its uses are asked
        self._changes = future.follow(self._cares)
        self._reports = reports_evictions
        self._sizes: dict[bytes, int] = {}  # keys in `inner`, with their sizes
        self._planned: dict[bytes, _Planned] = {}
        self._bytes = 0  # resident bytes, both kinds
        self._tick = 0
        self._refs: dict[bytes, list[int]] = {}  # resident keys' [first, last reference tick, references]
        # Evicted keys' [first, last, references] with the eviction's number, and (references, number, key)
        # to forget the fewest-referenced first (stale entries dropped lazily).
        self._retained: dict[bytes, tuple[list[int], int]] = {}
        self._forget: list[tuple[int, int, bytes]] = []
        self._evictions = 0
        self._provisional: set[bytes] = set()  # resident keys whose newest tick is a fill ahead of a planned read
        # Unplanned keys, for when they compete with planned ones, in one heap per (the open plan that
        # read them for the last time or None, their group: 0 with fewer than K references, else their
        # rounded count), ordered so its top is the group's furthest: (last, key) in group 0, else
        # (first, key). Stale entries are dropped lazily.
        self._groups: dict[tuple[int | None, int], list[tuple[int, bytes]]] = {}
        self._indexed = 0
        self._unindexed = False  # the heaps lack keys referenced while nothing read them (`_index`)
        # Unplanned keys an open plan read for the last time (its tenant reads the rest of the plan
        # first), under the lowest-numbered such plan, and each plan's, in heaps ordered as above.
        self._done: dict[bytes, int] = {}
        self._done_plans: set[int] = set()  # plans that have marked keys done since they opened
        self._opened: tuple[int, ...] | None = None
        self._origins: dict[int, tuple[int, int]] = {}  # plan -> (tick, cursor) when first seen open
        self._claimed: dict[int, list[int]] = {}  # plan -> [bytes it will read, bytes of those in its window]
        self._earned: dict[int, list[float]] = {}  # plan -> [its references, decayed, as of tick]
        self._nearest: dict[int, _Heap] = {}  # each planned key under the plan of its nearest use
        self._wants: dict[int, _Heap] = {}  # each planned key under every plan that will read it
        self._entries = 0
        self._live = 0
        self._version = 0
        self._fair_pick: bytes | None = None
        self.fairness_evictions = 0
        """Evictions of a key chosen because a plan was over its share (see the module docs)."""

    # Events.

    def on_insert(self, key: bytes, size: int) -> None:
        self._sync()
        old = self._sizes.get(key)
        if old is None:
            entry = self._planned.get(key)
            old = entry.size if entry is not None else 0
        self._bytes += size - old
        # A plan that takes the key up while `_file` asks about it queues it
        # for the next drain, so no change falls between the two.
        self._arriving = key
        try:
            uses = self._future.uses(key)
            # A value a plan fetched ahead: its read, not its fill, is the reference that counts.
            self._reference(key, provisional=any(use.in_window for use in uses), plans=[use.plan for use in uses])
            self._file(key, size, referenced=True, uses=uses)
        finally:
            self._arriving = None

    def on_access(self, key: bytes) -> None:
        self._sync()
        if key in self._refs:
            entry = self._planned.get(key)
            self._reference(key, provisional=False, plans=[c[0] for c in entry.claims] if entry is not None else ())
        if key in self._sizes:
            self._clear_done(key)  # read by something other than the plans that were done with it
            self._index(key)
            self.inner.on_access(key)

    def on_evict(self, key: bytes) -> None:
        self._sync()
        if key == self._fair_pick:
            self.fairness_evictions += 1
            self._fair_pick = None
        size = self._sizes.pop(key, None)
        if size is not None:
            self.inner.on_evict(key)
        else:
            entry = self._planned.pop(key, None)
            if entry is None:
                return
            self._unclaim(entry)
            size = entry.size
        self._bytes -= size
        self._provisional.discard(key)
        self._clear_done(key)
        refs = self._refs.pop(key, None)
        if refs is not None:
            self._retain(key, refs)
        if self._reports:
            self._future.evicted(key)

    def on_delete(self, key: bytes) -> None:
        self._sync()
        entry = self._planned.pop(key, None)
        if entry is not None:
            self._unclaim(entry)
            self._bytes -= entry.size
        size = self._sizes.pop(key, None)
        if size is not None:
            self._bytes -= size
        self._refs.pop(key, None)
        self._provisional.discard(key)
        self._clear_done(key)
        self._retained.pop(key, None)
        self.inner.on_delete(key)

    # Decisions.

    def victim(self) -> bytes | None:
        self._sync()
        while True:
            if not self._planned:
                return self._unplanned_victim()
            unplanned = self._coldest() if self._sizes else None
            found = self._furthest()
            if found is None:
                return self._unplanned_victim()
            if isinstance(found, bool):
                continue  # a key no plan wants any more went to the wrapped policy: choose again
            choice, value = found
            if unplanned is not None:
                estimate = self.estimate(unplanned)
                if estimate >= value:
                    choice, value = unplanned, estimate
            if self._share is not None and value != _INF and choice not in self._planned and choice not in self._done:
                fair = self._fair_victim()
                if fair is not None:
                    return fair
            return choice

    def _unplanned_victim(self) -> bytes | None:
        """The victim while no planned key is resident: the unplanned key expected furthest ahead while a
        plan is open, else the wrapped policy's."""
        if not self._sizes:
            return None
        return self._coldest() if self._opened else self.inner.victim()

    def estimate(self, key: bytes) -> float:
        """An unplanned resident key's expected ticks to its next read: its mean interval over all the
        history kept of it, `(now - first) / max(1, rounded(references) - 1)`, infinite with fewer than K
        references; for a key an open plan read for the last time, the rest of that plan plus half a
        pass of it."""
        first, _, count = self._refs[key]
        found = _INF if count < self._k else (self._tick - first) / max(1, _rounded(count) - 1)
        plan = self._done.get(key)
        if plan is None:
            return found
        cursor = self._future.cursor(plan)
        left = self._future.remaining(plan)
        if cursor is None or left is None:
            return found  # closed since the last event: freed at the next
        pace = self._pace(plan, cursor)
        return left * pace + (cursor + left) * pace / 2  # the next pass reads it somewhere in one

    def shares(self) -> dict[int, float]:
        """Each open plan's protected set (the resident keys it will read outside its window) as a
        fraction of the resident bytes."""
        total = self._bytes
        return {
            plan: (wanted - window) / total if total else 0.0
            for plan, (wanted, window) in self._claimed.items()
            if self._future.cursor(plan) is not None
        }

    def __len__(self) -> int:
        return len(self._sizes) + len(self._planned)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes or key in self._planned

    # Internals.

    def _cares(self, key: bytes) -> bool:
        """Whether a change to `key`'s future matters here (called from the plans' threads)."""
        return key in self._sizes or key in self._planned or key == self._arriving

    def _reference(self, key: bytes, *, provisional: bool, plans: Sequence[int]) -> None:
        """One tick: a reference to `key` (resident, or becoming so), earned by the open `plans` that
        will read it.

        A provisional reference (a fill ahead of a planned read) is replaced
        by the key's next reference instead of counting as one of its own.
        """
        self._tick += 1
        tick = self._tick
        for plan in plans:
            earned = self._earned.get(plan)
            if earned is not None:
                earned[0] = earned[0] * self._decay ** (tick - earned[1]) + 1.0
                earned[1] = tick
        refs = self._refs.get(key)
        if refs is None:
            kept = self._retained.pop(key, None)
            refs = self._refs[key] = [tick, tick, 0] if kept is None else kept[0]
        if key in self._provisional:
            self._provisional.discard(key)
            if refs[2] == 1:
                refs[0] = tick  # the fill was its only reference: the read is its first
            refs[1] = tick
        else:
            refs[1] = tick
            refs[2] += 1
        if provisional:
            self._provisional.add(key)

    def _retain(self, key: bytes, refs: list[int]) -> None:
        """Keeps an evicted key's history, for at most RETAINED_PER_RESIDENT times as many keys as are
        resident (those referenced fewest times forgotten first, then the earliest evicted)."""
        self._evictions += 1
        number = self._evictions
        retained, forget = self._retained, self._forget
        retained[key] = (refs, number)
        heapq.heappush(forget, (refs[2], number, key))
        while len(retained) > RETAINED_PER_RESIDENT * len(self._refs):
            _, gone, old = heapq.heappop(forget)
            kept = retained.get(old)
            if kept is not None and kept[1] == gone:
                del retained[old]
        if len(forget) > 2 * len(retained) + 64:
            self._forget = [(kept[2], seq, old) for old, (kept, seq) in retained.items()]
            heapq.heapify(self._forget)

    def _index(self, key: bytes) -> None:
        """Files an unplanned key by its references now (older entries of it go stale).

        Only a victim while a plan is open reads these heaps (`_coldest`);
        while none is the wrapped policy decides alone, so nothing is filed
        and the heaps are rebuilt once they are read again (a heap push per
        hit was a tenth of a warm server's read path).
        """
        if self._unindexed or not (self._opened or self._planned or self._done):
            self._unindexed = True
            return
        group, order = self._group(self._refs[key])
        where = (self._done.get(key), group)
        heap = self._groups.get(where)
        if heap is None:
            heap = self._groups[where] = []
        heapq.heappush(heap, (order, key))
        self._indexed += 1
        if self._indexed > 2 * len(self._sizes) + 64:
            self._reindex()

    def _group(self, refs: list[int]) -> tuple[int, int]:
        """A key's group (0: fewer than K references, else its rounded count) and its order in it."""
        first, last, count = refs
        if count < self._k:
            return 0, last
        return _rounded(count), first

    def _reindex(self) -> None:
        """Files every unplanned resident key anew (the heaps' stale entries go)."""
        groups: dict[tuple[int | None, int], list[tuple[int, bytes]]] = {}
        refs, done = self._refs, self._done
        for key in self._sizes:
            group, order = self._group(refs[key])
            where = (done.get(key), group)
            heap = groups.get(where)
            if heap is None:
                heap = groups[where] = []
            heap.append((order, key))
        for heap in groups.values():
            heapq.heapify(heap)
        self._groups = groups
        self._indexed = len(self._sizes)
        self._unindexed = False

    def _mark_done(self, key: bytes, plan: int) -> None:
        self._done[key] = plan
        self._done_plans.add(plan)

    def _clear_done(self, key: bytes) -> None:
        """Forgets that an open plan read `key` for the last time (its heap entries go stale)."""
        self._done.pop(key, None)

    def _group_top(self, where: tuple[int | None, int], heap: list[tuple[int, bytes]]) -> bytes | None:
        """The current top of one group's heap, dropping stale entries."""
        sizes, refs, done = self._sizes, self._refs, self._done
        plan, group = where
        while heap:
            order, key = heap[0]
            if key in sizes and done.get(key) == plan and self._group(refs[key]) == (group, order):
                return key
            heapq.heappop(heap)
            self._indexed -= 1
        return None

    def _rank(self, key: bytes) -> tuple[float, int, int]:
        """An unplanned key's rank, the victim highest: its estimate, then fewer than K references
        first, then the older reference (the last for those, the first for the rest)."""
        first, last, count = self._refs[key]
        if count < self._k:
            return (self.estimate(key), 1, -last)
        return (self.estimate(key), 0, -first)

    def _coldest(self) -> bytes | None:
        """The unplanned key expected furthest ahead (`_rank`): the best of the groups' tops (within a
        group the heap's order is the rank's)."""
        if self._unindexed:
            self._reindex()
        best: tuple[tuple[float, int, int], bytes] | None = None
        groups = self._groups
        for where, heap in list(groups.items()):
            key = self._group_top(where, heap)
            if key is None:
                del groups[where]
                continue
            candidate = (self._rank(key), key)
            if best is None or candidate > best:
                best = candidate
        return None if best is None else best[1]

    def _pace(self, plan: int, cursor: int) -> float:
        """Ticks per position of `plan` since this policy first saw it open."""
        origin = self._origins.get(plan)
        if origin is None:
            origin = self._origins[plan] = (self._tick, cursor)
        return (self._tick - origin[0] + 1) / (cursor - origin[1] + 1)

    def _sync(self) -> None:
        """Notes plans opened or closed, and re-files the resident keys whose planned uses changed (up
        to `SYNC_BATCH` of them)."""
        opened = self._future.open_plans()
        if opened is not self._opened:
            self._opened = opened
            origins = self._origins
            for plan in opened:
                if plan not in origins:
                    origins[plan] = (self._tick, self._future.cursor(plan) or 0)
                    self._earned[plan] = [0.0, self._tick]
            if len(origins) > len(opened):
                still = set(opened)
                for plan in [plan for plan in origins if plan not in still]:
                    del origins[plan]
                    self._claimed.pop(plan, None)
                    self._earned.pop(plan, None)
                    if plan in self._done_plans:
                        self._done_plans.discard(plan)
                        # Every key the plan read for the last time, filed in its heaps or not (nothing is
                        # filed while no planned key is resident: `_index`).
                        freed = [key for key, done in self._done.items() if done == plan]
                        for key in freed:  # all unmarked before any is filed (filing may rebuild the heaps)
                            del self._done[key]
                        for key in freed:
                            self._index(key)  # expected by its history again
        keys = self._changes.drain(SYNC_BATCH)
        if not keys:
            return
        planned, sizes = self._planned, self._sizes
        keys = [key for key in keys if key in planned or key in sizes]
        for key, uses in zip(keys, self._future.uses_many(keys), strict=True):
            entry = planned.get(key)
            self._file(key, entry.size if entry is not None else sizes[key], referenced=False, uses=uses)

    def _file(self, key: bytes, size: int, *, referenced: bool, uses: Sequence[PlannedUse] | None = None) -> bool:
        """Files a resident key by its uses (asked now unless given); returns whether a plan will read it.

        `referenced`: the event is a reference to the key (an insert), which
        the wrapped policy counts when the key is its own.
        """
        if uses is None:
            uses = self._future.uses(key)
        planned = self._planned.get(key)
        if not uses:
            if planned is not None:
                del self._planned[key]
                self._unclaim(planned)
                if not referenced:
                    # Read for the last time by the plans still open (a closed plan's keys are free):
                    # filed under the lowest-numbered.
                    readers = [plan for plan, _, _ in planned.claims if self._future.cursor(plan) is not None]
                    if readers:
                        self._mark_done(key, min(readers))
            if referenced:
                self._clear_done(key)
            if planned is not None or referenced or key not in self._sizes:
                self.inner.on_insert(key, size)
            self._sizes[key] = size
            self._index(key)
            return False
        self._clear_done(key)
        if self._sizes.pop(key, None) is not None:
            self.inner.on_evict(key)  # taken up by a plan: LRU-K keeps its history for when it comes back
        pace = self._pace
        nearest = min(uses, key=lambda use: ((use.position - use.cursor) * pace(use.plan, use.cursor), use.plan))
        claims = tuple((use.plan, use.position, use.in_window) for use in uses)
        if (
            planned is not None
            and planned.plan == nearest.plan
            and planned.index == nearest.position
            and planned.claims == claims
            and planned.size == size
        ):
            return True
        if planned is not None:
            self._unclaim(planned)
        self._version += 1
        version = self._version
        entry = self._planned[key] = _Planned(size, nearest.plan, nearest.position, claims, version)
        self._claim(entry)
        heap = self._nearest.get(nearest.plan)
        if heap is None:
            heap = self._nearest[nearest.plan] = []
        heapq.heappush(heap, (-nearest.position, version, key))
        for plan, position, _ in claims:
            heap = self._wants.get(plan)
            if heap is None:
                heap = self._wants[plan] = []
            heapq.heappush(heap, (-position, version, key))
        self._entries += 1 + len(claims)
        if self._entries > 2 * self._live + 64:
            self._compact()
        return True

    def _claim(self, entry: _Planned) -> None:
        self._live += 1 + len(entry.claims)
        for plan, _, in_window in entry.claims:
            sums = self._claimed.get(plan)
            if sums is None:
                sums = self._claimed[plan] = [0, 0]
            sums[0] += entry.size
            if in_window:
                sums[1] += entry.size

    def _unclaim(self, entry: _Planned) -> None:
        self._live -= 1 + len(entry.claims)
        for plan, _, in_window in entry.claims:
            sums = self._claimed.get(plan)
            if sums is not None:  # gone with its plan
                sums[0] -= entry.size
                if in_window:
                    sums[1] -= entry.size

    def _top(self, heaps: dict[int, _Heap], plan: int) -> tuple[int, bytes] | None:
        """The current (index, key) at the top of `heaps[plan]`, dropping stale entries."""
        heap = heaps.get(plan)
        if heap is None:
            return None
        planned = self._planned
        while heap:
            index, version, key = heap[0]
            entry = planned.get(key)
            if entry is not None and entry.version == version:
                return -index, key
            heapq.heappop(heap)
            self._entries -= 1
        del heaps[plan]
        return None

    def _furthest(self) -> tuple[bytes, float] | bool | None:
        """The planned key whose next read is furthest, checked against its uses now, with its distance.

        None when no key is planned; True when a key checked turned out to
        be no plan's (it went to the wrapped policy).
        """
        planned = self._planned
        nearest = self._nearest
        while True:
            best: tuple[float, bytes] | None = None
            closed: bytes | None = None
            for plan in list(nearest):
                top = self._top(nearest, plan)
                if top is None:
                    continue
                cursor = self._future.cursor(plan)
                if cursor is None:
                    closed = top[1]
                    break
                candidate = ((top[0] - cursor) * self._pace(plan, cursor), top[1])
                if best is None or candidate > best:
                    best = candidate
            if closed is not None:
                # Its plan closed since the last drain: the key is re-filed at
                # once rather than ranked by a plan that is gone.
                if not self._file(closed, planned[closed].size, referenced=False):
                    return True
                continue
            if best is None:
                return None
            key = best[1]
            entry = planned[key]
            if not self._file(key, entry.size, referenced=False):
                return True
            if planned[key] is entry:
                return key, best[0]
            # Its nearest use moved (another plan got closer, or a pace
            # changed): filed anew; choose again.

    def _fair_victim(self) -> bytes | None:
        """The key to evict instead of an unplanned one because a plan is over its share, or None."""
        share = self._share
        assert share is not None
        total = self._bytes
        over: dict[int, float] = {}
        for plan, (wanted, window) in self._claimed.items():
            protected = wanted - window
            if protected <= 0:
                continue
            cursor = self._future.cursor(plan)
            if cursor is None:
                continue
            bound = min(1.0, share * self._earned_share(plan)) * total
            ratio = protected / bound if bound > 0 else _INF
            if ratio > 1.0:
                over[plan] = ratio
        if not over:
            return None
        worst = min(over, key=lambda plan: (-over[plan], plan))
        top = self._top(self._wants, worst)
        if top is None:
            return None
        self._fair_pick = top[1]
        return top[1]

    def _earned_share(self, plan: int) -> float:
        """The decayed share of the tier's references since `plan` opened that were to keys it reads,
        (references + 1) / (ticks + 1): 1 for a plan just opened."""
        earned = self._earned.get(plan)
        origin = self._origins.get(plan)
        if earned is None or origin is None:
            return 1.0
        now = self._tick
        decay = self._decay
        total = (1.0 - decay ** (now - origin[0])) / (1.0 - decay)
        return (earned[0] * decay ** (now - earned[1]) + 1.0) / (total + 1.0)

    def _compact(self) -> None:
        """Rebuilds the heaps without entries of keys re-filed or gone."""
        self._nearest.clear()
        self._wants.clear()
        for key, entry in self._planned.items():
            self._nearest.setdefault(entry.plan, []).append((-entry.index, entry.version, key))
            for plan, position, _ in entry.claims:
                self._wants.setdefault(plan, []).append((-position, entry.version, key))
        for heaps in (self._nearest, self._wants):
            for heap in heaps.values():
                heapq.heapify(heap)
        self._entries = self._live
