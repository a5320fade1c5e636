"""A naive LRU-K written straight from the paper, for tests to compare against.

O'Neil, O'Neil and Weikum, "The LRU-K Page Replacement Algorithm for
Database Disk Buffering", SIGMOD 1993, figure 1 (the procedure invoked on a
reference to page p at time t). Everything is O(n) scans over plain dicts,
so it is easy to check line by line against the paper. Where the paper is
silent or wrong, this model says what cachesvc decided:

* The paper's shift loops run `for i := 2 to K`, which would copy HIST(p,1)
  into every slot; the intent (and the text) is a shift, so they run from K
  down to 2 here.
* A missing HIST slot is None (the paper uses 0, which a clock may read);
  None means an infinite backward K-distance.
* Ties, and the order among keys of infinite distance, go to the key whose
  last reference came first (the paper's subsidiary policy is LRU). A
  counter of references orders references that share a clock reading.
* CRP 0 means no correlation at all (the paper's `t - LAST(q) > CRP` would
  still call two references at one clock reading correlated).
* When no key is eligible the paper finds no victim; cachesvc evicts the
  least recently used key instead.
* Retained information: an evicted page's history is dropped once
  `t - LAST(p) > retained_seconds`, or when more than `retained_history`
  evicted pages have one (oldest LAST first); None means as many as there
  are pages in the buffer. Both bounds are applied on every eviction and on
  every fetch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ReferenceLRUK"]


@dataclass
class _Page:
    hist: list[float | None]  # hist[0] is HIST(p,1)
    last: float  # LAST(p)
    last_ref: int  # number of the most recent reference, for LRU order


class ReferenceLRUK:
    """LRU-K with the EvictionPolicy events, every decision by a full scan."""

    name = "lru-k-reference"

    def __init__(
        self,
        clock: Callable[[], float],
        k: int = 2,
        correlated_period: float = 0.5,
        retained_history: int | None = None,
        retained_seconds: float | None = None,
    ) -> None:
        self.clock = clock
        self.k = k
        self.crp = correlated_period
        self.retained_history = retained_history
        self.retained_seconds = retained_seconds
        self.refs = 0
        self.buffer: dict[bytes, _Page] = {}
        self.retained: dict[bytes, _Page] = {}

    def _correlated(self, t: float, page: _Page) -> bool:
        return self.crp > 0 and not t - page.last > self.crp

    def _prune_retained(self, t: float) -> None:
        if self.retained_seconds is not None:
            for q in [q for q, page in self.retained.items() if t - page.last > self.retained_seconds]:
                del self.retained[q]
        bound = len(self.buffer) if self.retained_history is None else self.retained_history
        while len(self.retained) > bound:
            oldest = min(self.retained, key=lambda q: self.retained[q].last_ref)
            del self.retained[oldest]

    def on_insert(self, key: bytes, size: int) -> None:
        t = self.clock()
        self.refs += 1
        if key in self.buffer:
            self._hit(key, t)
            return
        # "fetch p into the buffer frame previously held by victim"
        self._prune_retained(t)
        page = self.retained.pop(key, None)
        if page is None:
            # "allocate HIST(p); for i := 2 to K do HIST(p,i) := 0 od"
            page = _Page(hist=[None] * self.k, last=t, last_ref=self.refs)
        else:
            # "for i := 2 to K do HIST(p,i) := HIST(p,i-1) od"
            for i in range(self.k - 1, 0, -1):
                page.hist[i] = page.hist[i - 1]
        page.hist[0] = t
        page.last = t
        page.last_ref = self.refs
        self.buffer[key] = page

    def on_access(self, key: bytes) -> None:
        if key in self.buffer:
            self.refs += 1
            self._hit(key, self.clock())

    def _hit(self, key: bytes, t: float) -> None:
        page = self.buffer[key]
        if not self._correlated(t, page):
            # "a new, uncorrelated reference"
            correl_period_of_refd_page = page.last - page.hist[0]  # type: ignore[operator]
            for i in range(self.k - 1, 0, -1):
                prev = page.hist[i - 1]
                page.hist[i] = None if prev is None else prev + correl_period_of_refd_page
            page.hist[0] = t
        # correlated or not: "LAST(p) := t"
        page.last = t
        page.last_ref = self.refs

    def on_evict(self, key: bytes) -> None:
        page = self.buffer.pop(key, None)
        if page is not None:
            self.retained[key] = page
            self._prune_retained(self.clock())

    def on_delete(self, key: bytes) -> None:
        self.buffer.pop(key, None)
        self.retained.pop(key, None)

    def victim(self) -> bytes | None:
        if not self.buffer:
            return None
        t = self.clock()
        victim = None
        best: tuple[float, int] | None = None
        for q, page in self.buffer.items():
            # "if t - LAST(q) > Correlated_Reference_Period ... and HIST(q,K) < min"
            if self._correlated(t, page):
                continue
            hist_k = page.hist[self.k - 1]
            rank = (float("-inf") if hist_k is None else hist_k, page.last_ref)
            if best is None or rank < best:
                victim, best = q, rank
        if victim is None:
            victim = min(self.buffer, key=lambda q: self.buffer[q].last_ref)
        return victim

    def __len__(self) -> int:
        return len(self.buffer)

    def __contains__(self, key: object) -> bool:
        return key in self.buffer
