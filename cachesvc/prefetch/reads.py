"""What the open plans will read: the known future that plan-aware eviction consults.

`PlannedReads` is shared by the prefetcher (which adds and removes plans)
and the tiers' `PlanAware` policies (which ask about keys). It owns no plan
state of its own: it asks each open plan's `PrefetchPlanner` under that
plan's lock, and fans the keys whose answer changed out to every policy
that follows it, so a policy learns of a read, a fetch or a closed plan at
its next event instead of scanning keys.

Locking: a policy calls in under the engine lock; this module then takes
its own lock and each plan's lock, never the engine's. The planners call
`changed` under their plan's lock; it only appends to queues.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from cachesvc.policy.planned import PlannedUse
from cachesvc.prefetch.planner import PrefetchPlanner

__all__ = ["PlannedReads"]


class _Changes:
    """One follower's queue of changed keys (deque appends and pops are atomic).

    Only keys `cares(key)` accepts are queued (a tier's policy cares about
    the keys it holds), so a plan of millions of keys queues about as many
    as the tier holds, and the policy drains them under the engine lock.
    """

    def __init__(self, cares: Callable[[bytes], bool]) -> None:
        self._keys: deque[bytes] = deque()
        self.cares = cares

    def append(self, key: bytes) -> None:
        if self.cares(key):
            self._keys.append(key)

    def drain(self, limit: int) -> list[bytes]:
        """Up to `limit` keys changed since the last drain, each once, in the order of its last change
        among them; the rest stay queued."""
        keys = self._keys
        if not keys:
            return []
        taken = []
        try:
            for _ in range(limit):
                taken.append(keys.popleft())
        except IndexError:
            pass
        if len(taken) == 1:
            return taken
        return list(reversed(dict.fromkeys(reversed(taken))))


class PlannedReads:
    """The open plans' next reads of each key, for `cachesvc.policy.planned.PlanAware`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[int, tuple[threading.Condition, PrefetchPlanner]] = {}
        self._open: tuple[int, ...] = ()  # the numbers of `_plans`, a new tuple on every change
        self._followers: tuple[_Changes, ...] = ()

    # The prefetcher's side.

    def add(self, number: int, lock: threading.Condition, planner: PrefetchPlanner) -> None:
        """Plan `number` is open; its planner is read under `lock`."""
        with self._lock:
            self._plans[number] = (lock, planner)
            self._open = tuple(self._plans)

    def remove(self, number: int) -> None:
        """Plan `number` closed: every key it would still read has a new future."""
        with self._lock:
            found = self._plans.pop(number, None)
            self._open = tuple(self._plans)
        if found is None:
            return
        lock, planner = found
        for follower in self._followers:
            with lock:
                keys = planner.unread_keys(follower.cares)
            for key in keys:
                follower.append(key)

    def changed(self, key: bytes) -> None:
        """The next read of `key` in some plan changed (a planner's `on_change`)."""
        for follower in self._followers:
            follower.append(key)

    # The policies' side (`cachesvc.policy.planned.PlannedFuture`).

    def follow(self, cares: Callable[[bytes], bool]) -> _Changes:
        """A new queue that hears of every key `cares` accepts whose future changes from now on.

        `cares` is called from any thread without the follower's lock (a
        policy passes its own membership test, which must then count a key
        as held from before it asks `uses` about the key)."""
        changes = _Changes(cares)
        with self._lock:
            self._followers = (*self._followers, changes)
        return changes

    def uses(self, key: bytes) -> list[PlannedUse]:
        """The next read of `key` in each open plan that will read it."""
        return self.uses_many([key])[0]

    def uses_many(self, keys: Sequence[bytes]) -> list[list[PlannedUse]]:
        """`uses` of each key, taking each plan's lock once."""
        with self._lock:
            plans = list(self._plans.items())
        found: list[list[PlannedUse]] = [[] for _ in keys]
        for number, (lock, planner) in plans:
            with lock:
                cursor = planner.cursor
                wants, next_read = planner.wants, planner.next_read
                for uses, key in zip(found, keys, strict=True):
                    if wants(key):
                        use = next_read(key)
                        if use is not None:
                            uses.append(PlannedUse(number, use[0], cursor, use[1]))
        return found

    def open_plans(self) -> tuple[int, ...]:
        """The open plans' numbers: the same tuple until a plan is added or removed."""
        return self._open

    def remaining(self, plan: int) -> int | None:
        """Plan `plan`'s positions from its cursor to its end; None once the plan is closed."""
        found = self._plans.get(plan)
        if found is None:
            return None
        planner = found[1]
        return len(planner) - planner.cursor  # two int reads: no lock needed

    def cursor(self, plan: int) -> int | None:
        """Plan `plan`'s cursor (every index below it read); None once the plan is closed."""
        found = self._plans.get(plan)
        if found is None:
            return None
        return found[1].cursor  # one int read: no lock needed

    def evicted(self, key: bytes) -> None:
        """The cache evicted `key`: plans that fetched it and have not read it count it lost."""
        with self._lock:
            plans = list(self._plans.values())
        for lock, planner in plans:
            with lock:
                if planner.wants(key):
                    planner.on_evicted(key)
