"""Runs prefetch plans against the engine: the driver around `PrefetchPlanner`.

One bounded thread pool does every plan's fetches, so prefetching never
takes more than `concurrency` object-storage connections, and demand reads
(served on the RPC threads, never queued behind prefetches) go first. Plans
learn progress from the engine's demand reads. A plan stops fetching the
moment it is closed; fetches already in flight finish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from cachesvc.engine import Engine
from cachesvc.errors import CacheError, Overloaded
from cachesvc.prefetch.planner import PrefetchPlanner, Progress

__all__ = ["Plan", "Prefetcher"]

log = logging.getLogger(__name__)


class Plan:
    """One running plan: its planner and the condition its driver waits on."""

    def __init__(self, window_bytes: int) -> None:
        self.planner = PrefetchPlanner(window_bytes)
        self.cond = threading.Condition()
        self.closed = False

    def extend(self, keys: Sequence[bytes], sizes: Sequence[int] | None) -> None:
        with self.cond:
            self.planner.extend(keys, sizes)
            self.cond.notify_all()

    def consumed(self, n: int) -> None:
        with self.cond:
            self.planner.on_consumed(n)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Prefetcher:
    """Every plan of one server."""

    def __init__(self, engine: Engine, concurrency: int = 8, max_plans: int = 64) -> None:
        self._engine = engine
        self._concurrency = concurrency
        self._max_plans = max_plans
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="prefetch")
        self._plans: set[Plan] = set()
        self._lock = threading.Lock()
        engine.read_listeners.append(self._on_read)

    def open(self, window_bytes: int) -> Plan:
        """A new plan. Raises Overloaded when `max_plans` are already running."""
        plan = Plan(window_bytes)
        with self._lock:
            if len(self._plans) >= self._max_plans:
                raise Overloaded(f"too many prefetch plans running (max_prefetch_plans={self._max_plans})")
            self._plans.add(plan)
        return plan

    def _on_read(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            plans = list(self._plans)
        for plan in plans:
            with plan.cond:
                woke = False
                for key in keys:
                    if plan.planner.wants(key):
                        plan.planner.on_read(key)
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
        """Drives `plan` until it is closed or `active()` turns false, yielding progress now and then."""
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
            with self._lock:
                self._plans.discard(plan)

    def close(self) -> None:
        with self._lock:
            plans = list(self._plans)
        for plan in plans:
            plan.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
