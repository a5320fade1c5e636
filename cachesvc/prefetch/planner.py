"""The prefetch planner: which keys of a plan to fetch next. Pure: events in, decisions out.

A plan is the ordered list of keys a job will read (a sampler's order, a
model's layer order). The planner fetches ahead of the reads, in plan order,
while the bytes fetched but not yet read stay within the window. It learns
progress from reads (any order: DataLoader workers finish batches out of
order) and from explicit "consumed" reports.

Each read is scored against what prefetching did for it: `useful` (its
fetch finished first and brought bytes), `late` (read while its fetch was
in flight, or before the plan got to it), and, when the plan ends, every
fetched value nobody read is `wasted`. A fetched value the cache evicted
before its read is `evicted` (and its read is none of the others). A fetch
that found the value already cached (0 bytes) is none of these; one that
brought bytes counts as `prefetched`.

For plan-aware eviction the planner also answers, for a key, its next
planned read (`next_read`: the earliest unread occurrence, and whether the
plan has fetched or is fetching it, which protects it), and reports every
key whose answer changed to `on_change`.

Window accounting counts fetches in flight at their planned size (or, when
the plan has no sizes, the largest size seen so far), so with sizes the
window is never exceeded; without them, by at most one value.

The window in use adapts to the cache it fills (additive increase,
multiplicative decrease): every fetched value the cache evicted before its
read halves it (down to one value), and each read a fetch served in time
grows it by that value's share of one value (one value more per window's
worth of such reads, up to `window_bytes`). So a plan whose
window does not fit beside what the cache holds (other plans' windows,
keys read more often) fetches only what stays until its read, instead of
fetching values to push out and fetch again (issue 26).
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Outcome", "PrefetchPlanner", "Progress"]

_PENDING, _IN_FLIGHT, _FETCHED, _READ, _FAILED, _EVICTED = range(6)
# Fetched or being fetched and not yet read: inside the plan's window.
_IN_WINDOW = frozenset((_IN_FLIGHT, _FETCHED, _EVICTED))


@dataclass(frozen=True, slots=True)
class Progress:
    planned: int
    fetched: int
    consumed: int
    window_used_bytes: int
    failed: int
    done: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    """What prefetching did for a plan's reads (see the module docstring)."""

    useful: int = 0
    late: int = 0
    wasted: int = 0
    evicted: int = 0
    prefetched: int = 0

    def __add__(self, other: Outcome) -> Outcome:
        return Outcome(
            self.useful + other.useful,
            self.late + other.late,
            self.wasted + other.wasted,
            self.evicted + other.evicted,
            self.prefetched + other.prefetched,
        )


class PrefetchPlanner:
    """The state of one plan.

    Memory: about 110 bytes per planned key besides the key itself (its
    state, size and window charge in arrays, and an index entry).
    """

    def __init__(self, window_bytes: int, on_change: Callable[[bytes], None] | None = None) -> None:
        """A plan with a window of `window_bytes`; `on_change(key)` hears of every key whose
        `next_read` answer may have changed (called under the caller's lock: keep it cheap)."""
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        self.window_bytes = window_bytes
        self._limit = window_bytes  # the window in use: halved by evictions before use, regrown by useful reads
        self._keys: list[bytes] = []
        self._sizes = array("q")  # planned size per index, -1 when unknown
        self._state = bytearray()
        self._held = array("q")  # bytes charged to the window per index
        # The earliest unread index of each key, or all of them, in order, for
        # a key planned more than once (a deque costs ~600 bytes; most keys
        # are planned once).
        self._unread: dict[bytes, int | deque[int]] = {}
        self._next = 0  # lowest index that may still need a fetch
        self._consumed = 0  # every index below this one has been read
        self._in_flight = 0
        self._window_used = 0
        self._max_seen = 0
        self._fetched = 0
        self._failed = 0
        self._useful = self._late = self._evicted = self._prefetched = 0
        self._on_change = on_change if on_change is not None else _ignore
        self._lost: set[int] = set()  # in flight, and evicted before the fetch reported (rare)

    def __len__(self) -> int:
        return len(self._keys)

    def extend(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> None:
        """Appends keys (and their sizes, when known) to the plan."""
        if sizes is not None and len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys")
        if sizes is not None and any(not 0 <= size < 1 << 63 for size in sizes):
            raise ValueError("sizes must be in 0..2**63-1")
        start = len(self._keys)
        changed = self._on_change
        for n, key in enumerate(keys):
            entry = self._unread.get(key)
            if entry is None:
                self._unread[key] = start + n
                changed(key)
            elif isinstance(entry, int):
                self._unread[key] = deque((entry, start + n))
            else:
                entry.append(start + n)
        self._keys.extend(keys)
        self._sizes.extend(sizes if sizes is not None else itertools.repeat(-1, len(keys)))
        self._state.extend(bytes(len(keys)))  # _PENDING
        self._held.frombytes(bytes(self._held.itemsize * len(keys)))

    def _estimate(self, index: int) -> int:
        size = self._sizes[index]
        return size if size >= 0 else self._max_seen

    def _first_unread(self, key: bytes) -> int | None:
        entry = self._unread.get(key)
        return entry if entry is None or isinstance(entry, int) else entry[0]

    def _pop_unread(self, key: bytes) -> int:
        entry = self._unread[key]
        if isinstance(entry, int):
            del self._unread[key]
            return entry
        index = entry.popleft()
        if len(entry) == 1:
            self._unread[key] = entry[0]
        return index

    def next_fetches(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` (index, key) to fetch now, marked in flight."""
        chosen: list[tuple[int, bytes]] = []
        while len(chosen) < limit and self._next < len(self._keys):
            i = self._next
            if self._state[i] != _PENDING:
                self._next += 1
                continue
            estimate = self._estimate(i)
            if self._sizes[i] < 0 and self._max_seen == 0 and (self._in_flight or chosen):
                # No size known yet: one fetch until a size is seen, or a
                # burst of fetches estimated at 0 bytes would overrun the window.
                break
            if self._window_used > 0 and self._window_used + estimate > self._limit:
                break
            if self._window_used == 0 and estimate > self.window_bytes:
                # One value larger than the window: fetching it would break
                # the promise, so the plan skips it (the read will fetch it).
                self._state[i] = _FAILED
                self._failed += 1
                self._next += 1
                continue
            self._state[i] = _IN_FLIGHT
            self._held[i] = estimate
            self._window_used += estimate
            self._in_flight += 1
            self._next += 1
            chosen.append((i, self._keys[i]))
            self._on_change(self._keys[i])
        return chosen

    def on_fetched(self, index: int, size: int | None) -> None:
        """A fetch finished: `size` bytes now held, 0 if already cached, None if not found/failed."""
        if self._state[index] != _IN_FLIGHT:
            return
        self._in_flight -= 1
        self._window_used -= self._held[index]
        if size is None:
            self._state[index] = _FAILED
            self._held[index] = 0
            self._failed += 1
            self._on_change(self._keys[index])
            return
        self._max_seen = max(self._max_seen, size)
        self._fetched += 1
        self._prefetched += size > 0
        self._state[index] = _FETCHED
        self._held[index] = size
        self._window_used += size
        if self._lost and index in self._lost:
            # Evicted between landing in the cache and this report.
            self._lost.discard(index)
            if size > 0:
                self._state[index] = _EVICTED
                self._evicted += 1
                self._shrink()

    def on_read(self, key: bytes) -> None:
        """A demand read of `key`: the earliest unread occurrence in the plan is consumed."""
        if key in self._unread:
            self._mark_read(self._pop_unread(key))

    def on_consumed(self, n: int) -> None:
        """The caller reports that the first `n` keys have been read."""
        for i in range(self._consumed, min(n, len(self._keys))):
            if self._state[i] != _READ:
                if self._first_unread(self._keys[i]) == i:
                    self._pop_unread(self._keys[i])
                self._mark_read(i)

    def on_evicted(self, key: bytes) -> None:
        """The cache evicted `key`: a fetched value of it that the plan has not read yet is lost.

        Its window charge stays until the read (so the plan does not fetch
        further ahead into a cache already too full to hold its window).
        """
        index = self._first_unread(key)
        if index is None:
            return
        state = self._state[index]
        if state == _FETCHED and self._held[index] > 0:
            self._state[index] = _EVICTED
            self._evicted += 1
            self._shrink()
        elif state == _IN_FLIGHT:
            self._lost.add(index)  # settled when its fetch reports

    def _shrink(self) -> None:
        """A fetched value was evicted before its read: halve the window in use, to one value at least."""
        self._limit = max(self._max_seen, 1, self._limit // 2)

    @property
    def window_in_use(self) -> int:
        """The window the plan fetches within now (see the module docs): at most `window_bytes`."""
        return self._limit

    def next_read(self, key: bytes) -> tuple[int, bool] | None:
        """The index of the next planned read of `key`, and whether it is in the window
        (fetched or being fetched, not yet read); None when the plan will not read `key` again."""
        index = self._first_unread(key)
        if index is None:
            return None
        return index, self._state[index] in _IN_WINDOW

    @property
    def cursor(self) -> int:
        """Every index below this one has been read."""
        return self._consumed

    def unread_keys(self, wanted: Callable[[bytes], bool]) -> list[bytes]:
        """The keys `wanted` accepts that the plan will still read, the ones it reads soonest last."""
        first = self._first_unread
        return sorted(filter(wanted, self._unread), key=lambda key: -(first(key) or 0))

    def _mark_read(self, i: int) -> None:
        state = self._state[i]
        self._lost.discard(i)
        if state == _FETCHED and self._held[i] > 0:
            self._useful += 1
            # One value more per window's worth of useful reads (congestion avoidance, not slow start).
            self._limit = min(self.window_bytes, self._limit + max(1, self._held[i] * self._held[i] // self._limit))
        elif state in (_IN_FLIGHT, _PENDING):
            self._late += 1
        if state == _IN_FLIGHT:
            # Read before its fetch finished: the fetch still holds its
            # estimate until on_fetched, which will then find it read.
            self._in_flight -= 1
        self._window_used -= self._held[i]
        self._held[i] = 0
        self._state[i] = _READ
        self._on_change(self._keys[i])
        while self._consumed < len(self._keys) and self._state[self._consumed] == _READ:
            self._consumed += 1

    def progress(self) -> Progress:
        while self._next < len(self._keys) and self._state[self._next] != _PENDING:
            self._next += 1
        return Progress(
            planned=len(self._keys),
            fetched=self._fetched,
            consumed=self._consumed,
            window_used_bytes=self._window_used,
            failed=self._failed,
            done=self._next >= len(self._keys) and self._in_flight == 0,
        )

    def outcome(self, *, ended: bool) -> Outcome:
        """Reads helped (useful) and not helped in time (late) so far; with `ended`, also
        the fetched values never read (wasted), a pass over the unread part of the plan."""
        if not ended:
            return Outcome(self._useful, self._late, 0, self._evicted, self._prefetched)
        held = self._held
        state = self._state
        wasted = sum(1 for i in range(self._consumed, len(self._keys)) if state[i] == _FETCHED and held[i] > 0)
        return Outcome(self._useful, self._late, wasted, self._evicted, self._prefetched)

    def wants(self, key: bytes) -> bool:
        """Whether `key` has an unread occurrence in the plan."""
        return key in self._unread


def _ignore(key: bytes) -> None:
    del key
