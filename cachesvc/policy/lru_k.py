"""LRU-K eviction (O'Neil, O'Neil and Weikum, SIGMOD 1993).

This module owns the LRU-K policy: the per-key reference history, the
correlated reference period, the retained information period and the choice
of victim. Like every policy it is pure: events in, victims out, time from
the injected clock.

Terms from the paper, as used here:

* HIST(p, 1..K): the times of the K most recent *uncorrelated* references to
  key p, HIST(p, 1) the newest. A slot with no reference yet is -inf, so the
  backward K-distance `now - HIST(p, K)` of a key with fewer than K
  references is infinite.
* LAST(p): the time of the most recent reference, correlated or not.
* Correlated reference period (CRP): a reference within CRP seconds of
  LAST(p) is correlated with the one before it (a burst from one user, one
  transaction). It moves LAST(p) only. The next uncorrelated reference shifts
  HIST, and adds the length of the burst that just ended
  (LAST(p) - HIST(p, 1)) to the older entries, so the burst counts as a
  single point in time. A key referenced within the last CRP seconds is not
  eligible for eviction.
* Retained information period: the history of an evicted key is kept for a
  while, so a key that comes back resumes its past rather than starting as a
  stranger with infinite K-distance. It is bounded in count (by default, as
  many evicted keys as there are resident ones) and optionally in time.

Where the paper's pseudo-code is silent or wrong, this module follows
`tests/lru_k_reference.py`, which lists each decision.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from cachesvc.policy.base import Clock, monotonic_clock

__all__ = [
    "DEFAULT_CORRELATED_PERIOD",
    "LRUKPolicy",
]

DEFAULT_CORRELATED_PERIOD = 0.5
"""Seconds. The winner of the CRP sweep in `bench/eviction.py`
(bench/results/eviction.json): of 0, 0.01, 0.05, 0.1, 0.5, 1 and 5 s, the only
values never below LRU on any trace and size were 0.1, 0.5 and 1 s, and 0.5 s
had the best mean hit ratio. Plain LRU-K (0) fell up to 5 points below LRU on
the Twitter trace (6 in byte hit ratio): a new key was evicted before its
second reference arrived. 5 s fell below LRU on CloudPhysics and degraded to
LRU on the faster traces, where every resident key sat inside its CRP. The
best value grows with the time a key stays resident, so a tier that turns
over much faster or slower than those traces (2,000 and 16 requests/s) may
want its own `--lru-k-crp`."""

_NEVER = -math.inf


class _History:
    """What LRU-K knows about one key: HIST, LAST and an event sequence number.

    `seq` is a counter bumped on every reference. It orders references that
    share a clock reading (coarse clocks, trace timestamps) and identifies
    which heap entry of a key is current.
    """

    __slots__ = ("hist", "last", "seq")

    def __init__(self, hist: list[float], last: float, seq: int) -> None:
        self.hist = hist
        self.last = last
        self.seq = seq


class LRUKPolicy:
    """Evicts the eligible key whose K-th most recent reference is oldest.

    A key is eligible when its last reference is more than
    `correlated_period` seconds old. Among eligible keys, those with fewer
    than K uncorrelated references (infinite backward K-distance) go first,
    least recently used first; then the key with the oldest HIST(p, K). Ties
    go to the least recently used key. When no resident key is eligible, the
    least recently used key goes, so a tier is never overfilled. Sizes do not
    influence the choice: the engine keeps asking for victims until the new
    value fits.

    Every event costs O(log n) amortized (n = resident keys plus retained
    histories): a dict lookup, an OrderedDict move, and at most one push onto
    and one pop from a binary heap. Stale heap entries are dropped lazily
    and the heaps are rebuilt when half their entries are stale.

    Memory: about 400 bytes per resident key for K=2, beyond the key itself
    (a history object, a K-slot list of floats, a dict entry, and an
    OrderedDict entry or a heap tuple; measured with tracemalloc on CPython
    3.11), plus about 32 bytes for each K above 2. A retained history costs
    about 300 bytes more; with the default bound there are at most as many
    as resident keys, so plan on up to 700 bytes per resident key.

    Time comes only from `clock`, which must never run backwards.

    Args:
        clock: seconds as a float; only differences matter.
        k: the K in LRU-K; 1 is LRU with a correlated reference period.
        correlated_period: the CRP in seconds. 0 disables correlation: every
            reference is uncorrelated and every key is always eligible, which
            is the paper's plain LRU-K.
        retained_history: at most this many evicted keys keep their history;
            the ones whose last reference is oldest are forgotten first. None
            (the default) bounds it by the number of resident keys, which the
            benchmark found best: history much older than the tier's
            residency time ranks keys that return once after a long time
            above new keys. 0 forgets a key when it is evicted.
        retained_seconds: an evicted key's history is forgotten this many
            seconds after its last reference; None keeps it until the count
            bound pushes it out.

    Raises:
        ValueError: a parameter is out of range.
    """

    name = "lru-k"

    def __init__(
        self,
        clock: Clock = monotonic_clock,
        k: int = 2,
        correlated_period: float = DEFAULT_CORRELATED_PERIOD,
        retained_history: int | None = None,
        retained_seconds: float | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"lru_k.k must be an integer >= 1, got {k!r}")
        if not correlated_period >= 0:  # also rejects NaN
            raise ValueError(f"lru_k.correlated_period must be >= 0 seconds, got {correlated_period!r}")
        if retained_history is not None and (
            isinstance(retained_history, bool) or not isinstance(retained_history, int) or retained_history < 0
        ):
            raise ValueError(f"lru_k.retained_history must be an integer >= 0 or None, got {retained_history!r}")
        if retained_seconds is not None and not retained_seconds > 0:
            raise ValueError(f"lru_k.retained_seconds must be > 0 or None, got {retained_seconds!r}")
        self._clock = clock
        self._k = k
        self._crp = float(correlated_period)
        self._retain_count = retained_history
        self._retain_seconds = retained_seconds
        self._seq = 0
        self._resident: dict[bytes, _History] = {}
        # Resident keys referenced within the CRP, oldest LAST first. Keys
        # leave from the front once their CRP has passed, so the young set
        # is kept without ever scanning it.
        self._young: OrderedDict[bytes, _History] = OrderedDict()
        # Eligible resident keys as (HIST(p, K), seq, key). An entry is
        # current while the key is resident and its seq is unchanged; every
        # reference moves a key back to `_young` and so stales its entry.
        self._eligible: list[tuple[float, int, bytes]] = []
        # Histories of evicted keys, and (seq, key) in LAST order to forget
        # the oldest first.
        self._retained: dict[bytes, _History] = {}
        self._retained_order: list[tuple[int, bytes]] = []
        self._victim: bytes | None = None

    # Events.

    def on_insert(self, key: bytes, size: int) -> None:
        """A key became resident (put or fill); a reference to it."""
        del size  # LRU-K ranks keys by their references alone.
        now = self._clock()
        self._victim = None
        entry = self._resident.get(key)
        if entry is not None:
            self._reference(key, entry, now)
            return
        retained = self._retained
        bound = len(self._resident) if self._retain_count is None else self._retain_count
        if self._retain_seconds is not None or len(retained) > bound:
            # Deletes may have shrunk the resident set, and with it the bound.
            self._forget_expired(now)
        self._seq += 1
        entry = retained.pop(key, None)
        if entry is None:
            hist = [_NEVER] * self._k
            hist[0] = now
            entry = _History(hist, now, self._seq)
        else:
            # The paper's fetch of a page with history: a plain shift. The
            # reference that brought the key back is uncorrelated by
            # definition, as the key was not resident to be referenced.
            hist = entry.hist
            for i in range(self._k - 1, 0, -1):
                hist[i] = hist[i - 1]
            hist[0] = now
            entry.last = now
            entry.seq = self._seq
            if len(self._retained_order) > 2 * len(retained) + 64:
                self._compact_retained()
        self._resident[key] = entry
        self._young[key] = entry

    def on_access(self, key: bytes) -> None:
        """A resident key was hit; unknown keys are ignored."""
        entry = self._resident.get(key)
        if entry is not None:
            self._victim = None
            self._reference(key, entry, self._clock())

    def on_evict(self, key: bytes) -> None:
        """The engine evicted `key`; its history moves to the retained set."""
        entry = self._resident.pop(key, None)
        if entry is None:
            return
        self._victim = None
        resident = self._resident
        self._young.pop(key, None)
        if len(self._eligible) > 2 * len(resident) + 64:
            self._compact_eligible()
        bound = len(resident) if self._retain_count is None else self._retain_count
        retained = self._retained
        if bound == 0:
            # Nothing resident is left to be worth a history (or none is
            # kept at all): forget every evicted key.
            retained.clear()
            self._retained_order.clear()
            return
        retained[key] = entry
        heapq.heappush(self._retained_order, (entry.seq, key))
        if self._retain_seconds is not None:
            self._forget_expired(self._clock())
        elif len(retained) > bound:
            self._forget_expired(0.0)  # the time bound is off, so `now` is unused

    def on_delete(self, key: bytes) -> None:
        """A user deleted `key`: forget it, history included."""
        self._victim = None
        if self._resident.pop(key, None) is not None:
            self._young.pop(key, None)
            if len(self._eligible) > 2 * len(self._resident) + 64:
                self._compact_eligible()
        if self._retained.pop(key, None) is not None and len(self._retained_order) > 2 * len(self._retained) + 64:
            self._compact_retained()

    # Decisions.

    def victim(self) -> bytes | None:
        """The resident key to evict next, or None when nothing is resident.

        The answer is kept until the next event, so asking twice returns the
        same key even if keys left their CRP in between.
        """
        if self._victim is not None:
            return self._victim
        if not self._resident:
            return None
        self._promote(self._clock())
        eligible = self._eligible
        resident = self._resident
        while eligible:
            _, seq, key = eligible[0]
            entry = resident.get(key)
            if entry is not None and entry.seq == seq:
                self._victim = key
                return key
            heapq.heappop(eligible)
        # Every resident key is inside its CRP: rather than overfill the
        # tier, evict the one referenced longest ago.
        self._victim = next(iter(self._young))
        return self._victim

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    # Internals.

    def _reference(self, key: bytes, entry: _History, now: float) -> None:
        """Records a reference to a resident key at `now`."""
        crp = self._crp
        if crp <= 0 or now - entry.last > crp:
            hist = entry.hist
            # The burst that ended at LAST(p) collapses to one point: older
            # references move forward by its length, so the interarrival
            # time measured excludes the burst itself.
            burst = entry.last - hist[0]
            for i in range(self._k - 1, 0, -1):
                hist[i] = hist[i - 1] + burst
            hist[0] = now
        entry.last = now
        self._seq += 1
        entry.seq = self._seq
        young = self._young
        if key in young:
            young.move_to_end(key)
        else:
            young[key] = entry

    def _promote(self, now: float) -> None:
        """Moves keys whose CRP has passed from the young set to the heap."""
        young = self._young
        crp = self._crp
        k = self._k - 1
        promoted = []
        for key, entry in young.items():
            if crp > 0 and now - entry.last <= crp:
                break
            promoted.append((entry.hist[k], entry.seq, key))
        eligible = self._eligible
        for item in promoted:
            young.popitem(last=False)
            heapq.heappush(eligible, item)

    def _compact_eligible(self) -> None:
        """Rebuilds the eligible heap without its stale entries."""
        k = self._k - 1
        young = self._young
        self._eligible = [(entry.hist[k], entry.seq, key) for key, entry in self._resident.items() if key not in young]
        heapq.heapify(self._eligible)

    def _forget_expired(self, now: float) -> None:
        """Drops retained histories past the count or time bound."""
        order = self._retained_order
        retained = self._retained
        max_age = self._retain_seconds
        bound = len(self._resident) if self._retain_count is None else self._retain_count
        while order:
            seq, key = order[0]
            entry = retained.get(key)
            if entry is None or entry.seq != seq:
                heapq.heappop(order)
                continue
            if len(retained) <= bound and (max_age is None or now - entry.last <= max_age):
                break
            heapq.heappop(order)
            del retained[key]

    def _compact_retained(self) -> None:
        """Rebuilds the retained order without entries of keys it lost."""
        self._retained_order = [(entry.seq, key) for key, entry in self._retained.items()]
        heapq.heapify(self._retained_order)
