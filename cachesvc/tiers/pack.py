"""The pack: which bytes of L2's shared small-value space are free, and where a new value goes.

Small values in L2 are not one LMDB record each: a 4 KiB value as its own
record takes two 4 KiB LMDB pages. They are laid end to end in one byte
space, the pack, which LMDB holds as pack pages of `PACK_PAGE_BYTES` each
(one LMDB page apiece, see `cacheclient.wire.record`); a value's record is a
list of spans (start, length) of that space, and may cross page boundaries.

This module is the bookkeeping only, with no I/O: the LMDB tier asks it where
a record goes (`plan`), which pages a change leaves empty (`emptied`), writes
both in one LMDB transaction, and then records the change (`apply`). Planning
does not change anything, so a transaction that fails leaves this state as
it was.

Placement is first fit by address: a new record fills the lowest free runs
(the holes that deleted values left), then fresh pages past the end. Holes
are reused by the next puts, so a cache that evicts to make room keeps its
pages full; a page whose last value goes is dropped, which hands its LMDB
page back for any use. Runs shorter than `min_run` are left alone (a span
costs locator bytes) until a neighbour is freed and they merge, except the
free tail of the last page, which fresh pages continue; a record takes at
most `max_spans` spans.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

__all__ = ["PackSpace", "Span"]

Span = tuple[int, int]
"""(start, length) in bytes of the pack."""


class PackSpace:
    """Free runs and live bytes per page of the pack.

    Args:
        page_bytes: bytes of pack each page holds.
        min_run: free runs shorter than this are only used to finish a record.
        max_spans: most spans one record is split into.
    """

    def __init__(self, page_bytes: int, *, min_run: int = 32, max_spans: int = 16) -> None:
        if page_bytes <= 0 or max_spans < 1:
            raise ValueError("page_bytes and max_spans must be positive")
        self.page_bytes = page_bytes
        self.min_run = min_run
        self.max_spans = max_spans
        self._live: dict[int, int] = {}
        """Live bytes of every page that exists."""
        self._end_page = 0
        """One past the highest page that exists: fresh pages start here."""
        self._starts: list[int] = []
        """Starts of the free runs, sorted; runs never touch (they are merged)."""
        self._usable: list[int] = []
        """Starts of the free runs of at least `min_run` bytes, sorted."""
        self._run_end: dict[int, int] = {}
        self._run_start: dict[int, int] = {}
        self._free = 0

    # -- what an operator or a test reads -------------------------------------

    @property
    def pages(self) -> int:
        """Pages that exist."""
        return len(self._live)

    @property
    def end_page(self) -> int:
        """One past the highest page that exists."""
        return self._end_page

    @property
    def free_bytes(self) -> int:
        """Bytes of existing pages that hold no value (holes, and the tail of the last page)."""
        return self._free

    def live(self, page: int) -> int:
        """Live bytes of `page` (0 when it does not exist)."""
        return self._live.get(page, 0)

    def free_runs(self) -> list[Span]:
        """Every free run, by address."""
        return [(start, self._run_end[start] - start) for start in self._starts]

    def sparse_pages(self, limit: int) -> list[int]:
        """Up to `limit` pages at most half full, emptiest first: the cheapest to empty by moving their records."""
        half = self.page_bytes // 2
        sparse = sorted((live, page) for page, live in self._live.items() if live <= half)
        return [page for _, page in sparse[:limit]]

    def pages_of(self, spans: Iterable[Span]) -> set[int]:
        """The pages that `spans` touch."""
        return {page for page, _ in self._per_page(spans)}

    # -- planning (changes nothing) ---------------------------------------------

    def plan(self, size: int, avoid: frozenset[int] | set[int] = frozenset()) -> list[Span]:
        """Where a record of `size` bytes goes: free runs first by address, then fresh pages.

        Runs that touch a page in `avoid` are not used (compaction empties those).
        """
        page_bytes = self.page_bytes
        spans: list[Span] = []
        need = size
        for start in self._usable:
            if need == 0 or len(spans) == self.max_spans - 1:
                break
            end = self._run_end[start]
            if avoid and not avoid.isdisjoint(range(start // page_bytes, (end - 1) // page_bytes + 1)):
                continue
            take = min(end - start, need)
            spans.append((start, take))
            need -= take
        if need:
            # Fresh pages continue the free tail of the last page, used or not.
            fresh = self._end_page * page_bytes
            tail = self._run_start.get(fresh)
            if spans and sum(spans[-1]) == fresh:
                start, length = spans.pop()
                spans.append((start, length + need))
            elif tail is not None and tail // page_bytes not in avoid:
                spans.append((tail, need))
            else:
                spans.append((fresh, need))
        return spans

    def emptied(self, released: Sequence[Span], added: Sequence[Span] = ()) -> list[int]:
        """The pages left without a live byte once `released` is freed and `added` taken."""
        delta: dict[int, int] = {}
        for page, length in self._per_page(released):
            delta[page] = delta.get(page, 0) - length
        for page, length in self._per_page(added):
            delta[page] = delta.get(page, 0) + length
        live = self._live
        return sorted(page for page, d in delta.items() if page in live and live[page] + d == 0)

    # -- changes ----------------------------------------------------------------

    def apply(self, added: Sequence[Span] = (), released: Sequence[Span] = ()) -> list[int]:
        """Takes `added` (spans from `plan`) and frees `released`; returns the pages dropped as empty.

        Raises:
            ValueError: a span of `added` is not free (a bug: it did not come
                from `plan` on this state).
        """
        touched: set[int] = set()
        for start, length in added:
            self._grow_to((start + length - 1) // self.page_bytes + 1)
            if not self._take(start, start + length):
                raise ValueError(f"pack bytes {start}..{start + length} are not free")
        for page, length in self._per_page(added):
            self._live[page] += length
            touched.add(page)
        for start, length in released:
            self._add_free(start, start + length)
        for page, length in self._per_page(released):
            self._live[page] -= length
            touched.add(page)
        return self._drop_empty(touched)

    def add_pages(self, pages: Iterable[int]) -> None:
        """Records pages found on disk, all free until `claim`ed (rebuilding the state on open)."""
        for page in sorted(pages):
            if page in self._live:
                continue
            self._live[page] = 0
            self._add_free(page * self.page_bytes, (page + 1) * self.page_bytes)
            self._end_page = max(self._end_page, page + 1)

    def claim(self, spans: Sequence[Span]) -> bool:
        """Marks the spans of a record found on disk as used; False (and nothing taken) when any is not free.

        A span outside the existing pages or over bytes already claimed means
        the record's locator is damaged.
        """
        taken: list[Span] = []
        for start, length in spans:
            if length <= 0 or not self._take(start, start + length):
                for start_back, length_back in taken:
                    self._add_free(start_back, start_back + length_back)
                return False
            taken.append((start, length))
        for page, length in self._per_page(spans):
            self._live[page] += length
        return True

    def drop_empty(self) -> list[int]:
        """Drops every page without a live byte; returns them (after `claim`s on open: pages nothing points to)."""
        return self._drop_empty(set(self._live))

    # -- internals ----------------------------------------------------------------

    def _per_page(self, spans: Iterable[Span]) -> list[tuple[int, int]]:
        """(page, bytes) for every piece of `spans` within one page."""
        page_bytes = self.page_bytes
        pieces = []
        for start, length in spans:
            first, offset = divmod(start, page_bytes)
            if offset + length <= page_bytes:
                pieces.append((first, length))
                continue
            pos, end = start, start + length
            while pos < end:
                page = pos // page_bytes
                piece = min(end, (page + 1) * page_bytes) - pos
                pieces.append((page, piece))
                pos += piece
        return pieces

    def _grow_to(self, end_page: int) -> None:
        for page in range(self._end_page, end_page):
            self._live[page] = 0
            self._add_free(page * self.page_bytes, (page + 1) * self.page_bytes)
        self._end_page = max(self._end_page, end_page)

    def _drop_empty(self, pages: Iterable[int]) -> list[int]:
        dropped = sorted(page for page in pages if self._live.get(page) == 0)
        for page in dropped:
            del self._live[page]
            taken = self._take(page * self.page_bytes, (page + 1) * self.page_bytes)
            assert taken, f"pack page {page} has no live byte but is not free"
        while self._end_page and self._end_page - 1 not in self._live:
            self._end_page -= 1
        return dropped

    def _insert_run(self, start: int, end: int) -> None:
        bisect.insort(self._starts, start)
        if end - start >= self.min_run:
            bisect.insort(self._usable, start)
        self._run_end[start] = end
        self._run_start[end] = start
        self._free += end - start

    def _remove_run(self, start: int) -> int:
        del self._starts[bisect.bisect_left(self._starts, start)]
        end = self._run_end.pop(start)
        if end - start >= self.min_run:
            del self._usable[bisect.bisect_left(self._usable, start)]
        del self._run_start[end]
        self._free -= end - start
        return end

    def _add_free(self, start: int, end: int) -> None:
        if start in self._run_start:
            new_start = self._run_start[start]
            self._remove_run(new_start)
            start = new_start
        if end in self._run_end:
            end = self._remove_run(end)
        self._insert_run(start, end)

    def _take(self, start: int, end: int) -> bool:
        """Removes [start, end) from the free runs; False when it is not wholly inside one."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return False
        run_start = self._starts[i]
        run_end = self._run_end[run_start]
        if end > run_end:
            return False
        self._remove_run(run_start)
        if run_start < start:
            self._insert_run(run_start, start)
        if end < run_end:
            self._insert_run(end, run_end)
        return True
