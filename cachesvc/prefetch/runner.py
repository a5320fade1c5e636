"""Runs prefetch plans against the engine: the driver around `PrefetchPlanner`.

One bounded thread pool does every plan's fetches, so prefetching never
takes more than `concurrency` object-storage connections, and demand reads
(served on the RPC threads, never queued behind prefetches) go first. Which
plan's fetch takes a free slot is the `FetchScheduler`'s call: a plan of
higher `Priority` before any of lower, plans of one priority in turn. Plans
learn progress from demand reads handed to `Prefetcher.on_read`: whoever
builds the engine and the prefetcher subscribes it to the engine's
`ReadFeed`; the prefetcher never reaches into the engine for them.

With a `PlannedReads`, every started plan is registered there, so the
tiers' plan-aware eviction policies (`cachesvc.policy.planned`) see what
open plans will read; closing a plan takes it out (its protection ends).

At most `max_plans` plans are open at once, and a plan holds at most
`max_plan_keys` keys: both bound the memory and the threads plans take
(a gRPC server keeps one handler thread per open plan). A plan stops
fetching the moment it is closed; fetches already in flight finish.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from cachesvc.errors import CacheError, InvalidKey, LimitReached, Overloaded
from cachesvc.prefetch.planner import Outcome, PrefetchPlanner, Progress
from cachesvc.prefetch.reads import PlannedReads
from cachesvc.prefetch.schedule import FetchScheduler, Priority

__all__ = ["Plan", "Prefetcher"]

log = logging.getLogger(__name__)

RECENT_PLANS = 16
"""Closed plans whose own counters `Prefetcher.counters` still lists (a plan's wasted count is known once it closes)."""


class Fetcher(Protocol):
    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` ahead of a read: bytes fetched, 0 if already cached, None if not found."""
        ...


class Plan:
    """One open plan: its planner (once started) and the condition its driver waits on.

    Opened by `Prefetcher.open`, it counts toward `max_plans` until closed.
    `start` gives it its window, priority and first keys; `close`
    (idempotent, from any thread) ends it and frees its place.
    """

    def __init__(
        self,
        max_keys: int,
        on_close: Callable[[Plan], None],
        number: int = 0,
        planned_reads: PlannedReads | None = None,
        on_more: Callable[[], None] | None = None,
    ) -> None:
        """`on_more()` hears, outside the plan's lock, that the plan may have more to fetch
        (keys added, reads that free its window)."""
        self.number = number
        """Unique among the plans of one server (the per-plan counters are named by it)."""
        self.cond = threading.Condition()
        self.closed = False
        self.priority = Priority.NORMAL
        self.error: CacheError | None = None
        """Why the plan ended early (a bad later message, too many keys); None otherwise."""
        self._planner: PrefetchPlanner | None = None
        self._max_keys = max_keys
        self._on_close = on_close
        self._planned_reads = planned_reads
        self._on_more = on_more if on_more is not None else _nothing

    @property
    def planner(self) -> PrefetchPlanner:
        if self._planner is None:
            raise RuntimeError("the plan has not been started")
        return self._planner

    def start(
        self,
        window_bytes: int,
        keys: Sequence[bytes],
        sizes: Sequence[int] | None,
        priority: Priority = Priority.NORMAL,
    ) -> None:
        """Sets the window, the priority and the first keys.

        Raises:
            InvalidKey: `window_bytes` is not positive, or sizes do not match keys.
            LimitReached: more than `max_plan_keys` keys.
        """
        if window_bytes <= 0:
            raise InvalidKey("Prefetch: the first message must set window_bytes > 0")
        reads = self._planned_reads
        with self.cond:
            self.priority = priority
            self._planner = PrefetchPlanner(window_bytes, reads.changed if reads is not None else None)
            if reads is not None:
                # Before any key: a policy that hears of a key looks for it in the open plans.
                reads.add(self.number, self.cond, self._planner)
        self.extend(keys, sizes)

    def extend(self, keys: Sequence[bytes], sizes: Sequence[int] | None) -> None:
        """Appends keys to the plan.

        Raises:
            InvalidKey: sizes do not match keys.
            LimitReached: the plan would hold more than `max_plan_keys` keys.
        """
        with self.cond:
            planner = self.planner
            if len(planner) + len(keys) > self._max_keys:
                raise LimitReached(
                    f"Prefetch: a plan holds at most {self._max_keys} keys (max_plan_keys), "
                    f"got {len(planner) + len(keys)}; split it into plans of at most that many"
                )
            try:
                planner.extend(keys, sizes)
            except ValueError as exc:
                raise InvalidKey(f"Prefetch: {exc}") from None
            self.cond.notify_all()
        self._on_more()

    def consumed(self, n: int) -> None:
        with self.cond:
            self.planner.on_consumed(n)
            self.cond.notify_all()
        self._on_more()

    def next_fetches(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` (index, key) to fetch now, marked in flight; none once closed (the scheduler's source)."""
        with self.cond:
            if self.closed or self._planner is None:
                return []
            chosen = self._planner.next_fetches(limit)
            # It may also have given up on a value larger than the window: progress to report.
            self.cond.notify_all()
            return chosen

    def fail(self, error: CacheError) -> None:
        """Ends the plan because of `error` (kept in `error` for the caller)."""
        with self.cond:
            if self.error is None and not self.closed:
                self.error = error
        self.close()

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self._on_close(self)


class Prefetcher:
    """Every plan of one server.

    Args:
        engine: what fetches a key ahead of a read (`Engine.prefetch`).
        concurrency: fetches all plans run at once.
        max_plans: plans open at once; one more is refused with LimitReached.
        max_plan_keys: keys one plan may hold.
        planned_reads: where open plans are shown to plan-aware eviction; None: nowhere.
    """

    def __init__(
        self,
        engine: Fetcher,
        concurrency: int = 8,
        max_plans: int = 64,
        max_plan_keys: int = 1 << 21,
        planned_reads: PlannedReads | None = None,
    ) -> None:
        self._engine = engine
        self._planned_reads = planned_reads
        self.max_plans = max_plans
        self._max_plan_keys = max_plan_keys
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="prefetch")
        # Fetch slots and who gets them: taken before any plan's lock, never under one.
        self._dispatch = threading.Lock()
        self._scheduler: FetchScheduler[Plan] = FetchScheduler()
        self._idle_slots = concurrency
        self._stopped = False
        self._plans: set[Plan] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._opened = self._refused = 0
        self._numbers = itertools.count(1)
        self._ended = Outcome()  # summed over closed plans
        self._recent: deque[tuple[int, Outcome]] = deque(maxlen=RECENT_PLANS)  # the last closed plans

    def open(self) -> Plan:
        """A new plan, not yet started; it counts toward `max_plans` until closed.

        Raises:
            LimitReached: `max_plans` plans are already open.
            Overloaded: the prefetcher is closed (the server is stopping).
        """
        with self._lock:
            plan = Plan(self._max_plan_keys, self._forget, next(self._numbers), self._planned_reads, self._issue)
            if self._closed:
                raise Overloaded("the server is stopping: no new prefetch plans")
            if len(self._plans) >= self.max_plans:
                self._refused += 1
                raise LimitReached(
                    f"too many prefetch plans open (max_prefetch_plans={self.max_plans}); "
                    "close finished plans or raise max_prefetch_plans on the server"
                )
            self._plans.add(plan)
            self._opened += 1
        return plan

    def _forget(self, plan: Plan) -> None:
        with self._dispatch:
            self._scheduler.remove(plan)
        if self._planned_reads is not None:
            self._planned_reads.remove(plan.number)
        with plan.cond:
            outcome = plan._planner.outcome(ended=True) if plan._planner is not None else Outcome()
        with self._lock:
            self._plans.discard(plan)
            self._ended += outcome
            if plan._planner is not None:
                self._recent.append((plan.number, outcome))

    @property
    def open_plans(self) -> int:
        with self._lock:
            return len(self._plans)

    def counters(self) -> dict[str, int]:
        """Plans opened and refused (at `max_plans`) since start, and open now; what
        prefetching did for reads (`Outcome`), summed over all plans, and for each open
        plan and the last `RECENT_PLANS` closed ones by number.

        Per plan N: `prefetch_plan_N_prefetched` (fetches that brought bytes before the read),
        `_used_in_time` (read after the fetch finished), `_used_late` (read
        while or before being fetched), `_evicted_before_use` (evicted from
        the tier prefetches fill before the plan read them) and `_wasted`
        (never read; known once the plan closes, 0 before). Sums: `prefetch_`
        `useful`, `late`, `wasted`, `prefetched`, `evicted_before_use`.
        """
        with self._lock:
            plans = sorted(self._plans, key=lambda plan: plan.number)
            counters = {
                "prefetch_plans_opened": self._opened,
                "prefetch_plans_refused": self._refused,
                "prefetch_plans_open": len(plans),
            }
            total = self._ended
            each = list(self._recent)
        for plan in plans:
            with plan.cond:
                if plan._planner is not None:
                    outcome = plan._planner.outcome(ended=False)
                    each.append((plan.number, outcome))
                    total += outcome
        counters.update(
            prefetch_useful=total.useful,
            prefetch_late=total.late,
            prefetch_wasted=total.wasted,
            prefetch_prefetched=total.prefetched,
            prefetch_evicted_before_use=total.evicted,
        )
        for number, outcome in each:
            name = f"prefetch_plan_{number}_"
            counters[name + "prefetched"] = outcome.prefetched
            counters[name + "used_in_time"] = outcome.useful
            counters[name + "used_late"] = outcome.late
            counters[name + "wasted"] = outcome.wasted
            counters[name + "evicted_before_use"] = outcome.evicted
        return counters

    def on_read(self, keys: Sequence[bytes]) -> None:
        """Demand reads of `keys`: each started plan counts them as read (subscribe this to the engine's reads)."""
        with self._lock:
            plans = list(self._plans)
        more = False
        for plan in plans:
            with plan.cond:
                planner = plan._planner
                if planner is None:
                    continue
                woke = False
                for key in keys:
                    if planner.wants(key):
                        planner.on_read(key)
                        woke = True
                if woke:
                    plan.cond.notify_all()
                    more = True
        if more:  # reads free window: the plans that made them may fetch further
            self._issue()

    def _issue(self, freed: int = 0) -> None:
        """Starts fetches on the idle slots (plus `freed` slots just given back), in the scheduler's order."""
        with self._dispatch:
            self._idle_slots += freed
            if self._stopped:
                return
            for plan, index, key in self._scheduler.issue(self._idle_slots):
                self._idle_slots -= 1
                self._pool.submit(self._fetch, plan, index, key)

    def _fetch(self, plan: Plan, index: int, key: bytes) -> None:
        size: int | None
        if plan.closed:
            size = None
        else:
            try:
                size = self._engine.prefetch(key)
            except CacheError as exc:
                log.debug("prefetch of a key failed: %s", exc)
                size = None
            except Exception:
                log.exception("prefetch of a key failed")
                size = None
        try:
            with plan.cond:
                plan.planner.on_fetched(index, size)
                plan.cond.notify_all()
        finally:
            self._issue(freed=1)  # a slot lost would shrink every plan's concurrency for good

    def run(self, plan: Plan, active: Callable[[], bool], report_every: float = 0.5) -> Iterator[Progress]:
        """Drives a started `plan` until it is closed or `active()` turns false, yielding progress now and then.

        Its fetches start as the scheduler gives it slots; this loop reports.
        The plan is closed when this returns (or the caller stops iterating).
        """
        try:
            with self._dispatch:
                # A plan closed before this (its caller gone) is not scheduled: `_forget` has run or will.
                if not plan.closed:
                    self._scheduler.add(plan, plan.priority)
            self._issue()
            last: Progress | None = None
            while True:
                with plan.cond:
                    if plan.closed or not active():
                        break
                    progress = plan.planner.progress()
                    if progress == last:
                        plan.cond.wait(report_every)
                        continue
                last = progress
                yield progress
        finally:
            plan.close()

    def close(self) -> None:
        """Closes every plan and refuses new ones; waits for fetches in flight."""
        with self._lock:
            self._closed = True
            plans = list(self._plans)
        with self._dispatch:
            self._stopped = True
        for plan in plans:
            plan.close()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _nothing() -> None:
    pass
