"""Runs prefetch plans against the engine: the driver around `PrefetchPlanner`.

One bounded thread pool does every plan's fetches, so prefetching never
takes more than `concurrency` object-storage connections, and demand reads
(served on the RPC threads, never queued behind prefetches) go first. Plans
learn progress from demand reads handed to `Prefetcher.on_read`: whoever
builds the engine and the prefetcher subscribes it to the engine's
`ReadFeed`; the prefetcher never reaches into the engine for them.

At most `max_plans` plans are open at once, and a plan holds at most
`max_plan_keys` keys: both bound the memory and the threads plans take
(a gRPC server keeps one handler thread per open plan). A plan stops
fetching the moment it is closed; fetches already in flight finish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from cachesvc.errors import CacheError, InvalidKey, LimitReached, Overloaded
from cachesvc.prefetch.planner import Outcome, PrefetchPlanner, Progress

__all__ = ["Plan", "Prefetcher"]

log = logging.getLogger(__name__)


class Fetcher(Protocol):
    def prefetch(self, key: bytes) -> int | None:
        """Fills `key` ahead of a read: bytes fetched, 0 if already cached, None if not found."""
        ...


class Plan:
    """One open plan: its planner (once started) and the condition its driver waits on.

    Opened by `Prefetcher.open`, it counts toward `max_plans` until closed.
    `start` gives it its window and first keys; `close` (idempotent, from
    any thread) ends it and frees its place.
    """

    def __init__(self, max_keys: int, on_close: Callable[[Plan], None]) -> None:
        self.cond = threading.Condition()
        self.closed = False
        self.error: CacheError | None = None
        """Why the plan ended early (a bad later message, too many keys); None otherwise."""
        self._planner: PrefetchPlanner | None = None
        self._max_keys = max_keys
        self._on_close = on_close

    @property
    def planner(self) -> PrefetchPlanner:
        if self._planner is None:
            raise RuntimeError("the plan has not been started")
        return self._planner

    def start(self, window_bytes: int, keys: Sequence[bytes], sizes: Sequence[int] | None) -> None:
        """Sets the window and the first keys.

        Raises:
            InvalidKey: `window_bytes` is not positive, or sizes do not match keys.
            LimitReached: more than `max_plan_keys` keys.
        """
        if window_bytes <= 0:
            raise InvalidKey("Prefetch: the first message must set window_bytes > 0")
        with self.cond:
            self._planner = PrefetchPlanner(window_bytes)
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

    def consumed(self, n: int) -> None:
        with self.cond:
            self.planner.on_consumed(n)
            self.cond.notify_all()

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
    """

    def __init__(
        self, engine: Fetcher, concurrency: int = 8, max_plans: int = 64, max_plan_keys: int = 1 << 21
    ) -> None:
        self._engine = engine
        self._concurrency = concurrency
        self.max_plans = max_plans
        self._max_plan_keys = max_plan_keys
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="prefetch")
        self._plans: set[Plan] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._opened = self._refused = 0
        self._ended = Outcome()  # summed over closed plans

    def open(self) -> Plan:
        """A new plan, not yet started; it counts toward `max_plans` until closed.

        Raises:
            LimitReached: `max_plans` plans are already open.
            Overloaded: the prefetcher is closed (the server is stopping).
        """
        plan = Plan(self._max_plan_keys, self._forget)
        with self._lock:
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
        with plan.cond:
            outcome = plan._planner.outcome(ended=True) if plan._planner is not None else Outcome()
        with self._lock:
            self._plans.discard(plan)
            self._ended += outcome

    @property
    def open_plans(self) -> int:
        with self._lock:
            return len(self._plans)

    def counters(self) -> dict[str, int]:
        """Plans opened and refused (at `max_plans`) since start, and open now; what
        prefetching did for reads (`Outcome`: useful and late, open plans included;
        wasted, counted when a plan closes)."""
        with self._lock:
            plans = list(self._plans)
            counters = {
                "prefetch_plans_opened": self._opened,
                "prefetch_plans_refused": self._refused,
                "prefetch_plans_open": len(plans),
            }
            outcome = self._ended
        for plan in plans:
            with plan.cond:
                if plan._planner is not None:
                    outcome += plan._planner.outcome(ended=False)
        counters.update(prefetch_useful=outcome.useful, prefetch_late=outcome.late, prefetch_wasted=outcome.wasted)
        return counters

    def on_read(self, keys: Sequence[bytes]) -> None:
        """Demand reads of `keys`: each started plan counts them as read (subscribe this to the engine's reads)."""
        with self._lock:
            plans = list(self._plans)
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
        with plan.cond:
            plan.planner.on_fetched(index, size)
            plan.cond.notify_all()

    def run(self, plan: Plan, active: Callable[[], bool], report_every: float = 0.5) -> Iterator[Progress]:
        """Drives a started `plan` until it is closed or `active()` turns false, yielding progress now and then.

        The plan is closed when this returns (or the caller stops iterating).
        """
        try:
            last: Progress | None = None
            while True:
                with plan.cond:
                    if plan.closed or not active():
                        break
                    limit = self._concurrency - plan.planner.in_flight
                    for index, key in plan.planner.next_fetches(max(limit, 0)):
                        self._pool.submit(self._fetch, plan, index, key)
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
        for plan in plans:
            plan.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
