"""Which stored values a streamed model holds, fetches and drops under a byte budget. Pure.

A model run is a loop of steps (the modules in execution order, then again
for the next forward), each step needing a few units (stored values). The
budget is split in two:

- a kept set: units held once fetched, across forwards. On a loop every
  unit is read once per round, so each byte kept is a byte not fetched
  again; the largest units (times their uses per round) are kept first,
  which also shrinks the window the others need.
- a window for the rest, which stream: the fetcher reads the next steps'
  units ahead of the cursor while the current one runs, and drops streamed
  units used furthest away (Belady on the known future). It fetches ahead
  only when the units it displaces are next used after the step it fetches
  for ("do no harm", Cao et al., 1995), so it never pushes out something
  needed sooner than what it brings in.

Without the split, prefetching ahead on a loop larger than the budget
displaces everything: every round refetches the whole model. With it, a
round fetches only what is not kept, and the window hides the fetch time.

No threads, clocks or I/O: the driver (`cacheclient.prefetch`) calls these
methods under its own lock and does the fetching and the dropping.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Sequence

__all__ = ["ABSENT", "FETCHING", "READY", "Residency"]

ABSENT, FETCHING, READY = range(3)

_NEVER = 1 << 62
"""Distance of a unit no step of the plan uses."""


class Residency:
    """Residency of units 0..n-1 of known sizes, for a cyclic plan of steps, under `budget` bytes.

    `used` counts every unit fetched or being fetched. A unit is in one of
    three states: ABSENT, FETCHING (charged to the budget, bytes on the way)
    or READY (held). Pinned units (in use by a running step) are never dropped.

    Args:
        sizes: each unit's bytes.
        budget: most bytes held (and on the way) at once.
        window: bytes left for streaming units ahead of the cursor, at least
            the largest two consecutive steps' streamed units; None: just that.
    """

    def __init__(self, sizes: Sequence[int], budget: int, window: int | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        self.sizes = list(sizes)
        self.budget = budget
        self.window = window
        self.state = [ABSENT] * len(self.sizes)
        self.pins = [0] * len(self.sizes)
        self.used = 0
        self.peak = 0
        self.steps: list[tuple[int, ...]] = []
        self.cursor = 0
        self.kept: frozenset[int] = frozenset()
        self._uses: list[list[int]] = [[] for _ in self.sizes]

    def set_steps(self, steps: Sequence[Sequence[int]]) -> None:
        """Replaces the plan and chooses the kept set for it; the cursor goes to its first step."""
        self.steps = [tuple(dict.fromkeys(step)) for step in steps]
        self._uses = [[] for _ in self.sizes]
        for index, step in enumerate(self.steps):
            for unit in step:
                self._uses[unit].append(index)
        self.cursor = 0
        self.kept = self._choose_kept()

    def _choose_kept(self) -> frozenset[int]:
        """Kept units, most bytes read per round first, while the streamed rest still has its window.

        The window a streamed step needs is room for it and the step after it
        (one arrives while the other runs): the largest pair of consecutive
        steps' streamed units, or `window` when that is larger.
        """
        n = len(self.steps)
        pairs = [set(self.steps[i]) | set(self.steps[(i + 1) % n]) for i in range(n)]
        pair_bytes = [sum(self.sizes[u] for u in pair) for pair in pairs]
        in_pairs: list[list[int]] = [[] for _ in self.sizes]
        for i, pair in enumerate(pairs):
            for unit in pair:
                in_pairs[unit].append(i)
        kept: set[int] = set()
        kept_bytes = 0
        order = sorted(
            (u for u, uses in enumerate(self._uses) if uses),
            key=lambda u: (-self.sizes[u] * len(self._uses[u]), self._uses[u][0]),
        )
        for unit in order:
            after = list(pair_bytes)
            for i in in_pairs[unit]:
                after[i] -= self.sizes[unit]
            largest = max(after, default=0)
            window = 0 if largest == 0 else max(largest, self.window or 0)
            if kept_bytes + self.sizes[unit] + window <= self.budget:
                kept.add(unit)
                kept_bytes += self.sizes[unit]
                pair_bytes = after
        return frozenset(kept)

    def advance(self, step: int) -> None:
        """The step now running (or about to)."""
        self.cursor = step

    def distance(self, unit: int) -> int:
        """Steps from the cursor to the unit's next use, going round the loop; huge when never used."""
        uses = self._uses[unit]
        if not uses:
            return _NEVER
        i = bisect.bisect_left(uses, self.cursor)
        nxt = uses[i] if i < len(uses) else uses[0] + len(self.steps)
        return nxt - self.cursor

    def find(self, unit_set: Sequence[int], start: int) -> int | None:
        """The index of the first step at or after `start` (going round) that needs exactly `unit_set`."""
        wanted = tuple(dict.fromkeys(unit_set))
        n = len(self.steps)
        for d in range(n):
            index = (start + d) % n
            if self.steps[index] == wanted:
                return index
        return None

    def _candidates(self, beyond: int, kept: bool) -> list[int]:
        """READY unpinned units next used more than `beyond` steps away, furthest first; kept ones only if `kept`."""
        found = [
            (self.distance(u), u)
            for u, state in enumerate(self.state)
            if state == READY and not self.pins[u] and (kept or u not in self.kept)
        ]
        return [u for d, u in sorted(found, reverse=True) if d > beyond]

    def _victims(self, need: int, candidates: list[int]) -> list[int] | None:
        """The first of `candidates` whose drop frees room for `need` bytes; None if all of them do not."""
        free = self.budget - self.used
        victims = []
        for unit in candidates:
            if free >= need:
                break
            victims.append(unit)
            free += self.sizes[unit]
        return victims if free >= need else None

    def _charge(self, units: Sequence[int], victims: Sequence[int]) -> None:
        for unit in victims:
            self.state[unit] = ABSENT
            self.used -= self.sizes[unit]
        for unit in units:
            self.state[unit] = FETCHING
            self.used += self.sizes[unit]
        self.peak = max(self.peak, self.used)

    def reserve_now(self, units: Sequence[int]) -> list[int]:
        """Charges the ABSENT `units` of the running step, dropping what is used later; returns the dropped.

        Streamed units go first, then kept ones. The step needs its units
        now, so when nothing more can be dropped (the rest is pinned by
        enclosing modules) the budget is exceeded (`peak` shows it).
        """
        units = [u for u in dict.fromkeys(units) if self.state[u] == ABSENT]
        need = sum(self.sizes[u] for u in units)
        candidates = self._candidates(0, kept=False) + [u for u in self._candidates(0, kept=True) if u in self.kept]
        victims = self._victims(need, candidates)
        self._charge(units, candidates if victims is None else victims)
        return candidates if victims is None else victims

    def next_fetch(self, lookahead: int, max_bytes: int, skip: Container[int] = ()) -> tuple[list[int], list[int]]:
        """The units to fetch ahead of the cursor and the streamed units to drop for them; charged at once.

        Walks the plan from the cursor, at most `lookahead` steps past it and
        at most once round the loop, taking the ABSENT units of each step,
        until `max_bytes` are taken or a step's units cannot be made room for
        without dropping a unit needed at or before that step. The running
        step's units are taken as `reserve_now` takes them. ([], []) when
        there is nothing to do now. Units in `skip` (whose last fetch failed)
        are passed over.
        """
        units: list[int] = []
        victims: list[int] = []
        taken = 0
        n = len(self.steps)
        for d in range(min(lookahead + 1, n)):
            step = self.steps[(self.cursor + d) % n]
            missing = [u for u in step if self.state[u] == ABSENT and u not in skip]
            if not missing:
                continue
            need = sum(self.sizes[u] for u in missing)
            if d == 0:  # the running step waits for these: make room whatever it takes
                victims += self.reserve_now(missing)
            else:
                dropped = self._victims(need, self._candidates(d, kept=False))
                if dropped is None:
                    break
                self._charge(missing, dropped)
                victims += dropped
            units += missing
            taken += need
            if taken >= max_bytes:
                break
        return units, victims

    def fetched(self, unit: int) -> None:
        """The unit's bytes are held."""
        self.state[unit] = READY

    def dropped(self, unit: int) -> None:
        """The unit's fetch failed, or its bytes were let go: it is ABSENT again."""
        if self.state[unit] != ABSENT:
            self.state[unit] = ABSENT
            self.used -= self.sizes[unit]

    def pin(self, units: Sequence[int]) -> None:
        for unit in units:
            self.pins[unit] += 1

    def unpin(self, units: Sequence[int]) -> None:
        for unit in units:
            self.pins[unit] -= 1
