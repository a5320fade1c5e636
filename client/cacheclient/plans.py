"""The client's plans: what a job will read, in order, handed to the cache server to prefetch ahead of.

A `Plan` is a list of steps, each naming the keys it needs (a batch of
samples, a module's parameters). `Plan.sampler_order`,
`Plan.execution_order` and `Plan(steps)` build one; `plan.start(cache,
window_bytes=...)` hands it to the cache server, which fetches ahead of the
reads it serves (from S3 into its memory) while at most `window_bytes` are
fetched and not yet read. The server learns progress from those reads;
`PlanRun.advance` reports it explicitly. `CacheClient.prefetch` is the call
underneath, and its `PrefetchPlan` the handle a `PlanRun` holds.
`FollowedPlan` is a plan kept one forward ahead of a model whose
parameters stream from the cache (`cacheclient.models.streaming`).

This module needs no torch (`cacheclient.prefetch`, which users import it
through, does).
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from cacheclient.client import CacheClient, PrefetchPlan
from cacheclient.errors import CacheClientError

__all__ = ["FOLLOW_MAX_KEYS", "FollowedPlan", "Plan", "PlanRun", "Steps", "as_key"]

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What `Plan.execution_order` reads a plan of a model's forward from (`cacheclient.models.ModelManifest`)."""

    def execution_steps(self, order: Sequence[str]) -> tuple[list[list[bytes]], dict[bytes, int]]:
        """The keys of each module in `order`, a step per module, and every key's value size."""
        ...


def as_key(key: bytes | str) -> bytes:
    """A key as bytes (a str is its UTF-8)."""
    return key.encode() if isinstance(key, str) else bytes(key)


class Plan:
    """What a job will read, in order: steps, each naming the keys it needs.

    Stored flat (the keys in order, and where each step starts), so a plan
    of an epoch of millions of samples costs about what its list of keys does.

    Args:
        steps: the keys of each step, in the order the steps run. A key may
            appear in several steps (a loop reads it again).
        sizes: the values' sizes by key, when known; they keep the server's
            window exact.
    """

    def __init__(self, steps: Iterable[Iterable[bytes | str]], *, sizes: Mapping[bytes, int] | None = None) -> None:
        keys: list[bytes] = []
        bounds = array("q", [0])
        for step in steps:
            keys.extend(as_key(k) for k in step)
            bounds.append(len(keys))
        known = sizes is not None and all(k in sizes for k in keys)
        self._init(keys, bounds, [sizes[k] for k in keys] if sizes is not None and known else None)

    def _init(self, keys: list[bytes], bounds: array[int] | None, sizes: list[int] | None) -> None:
        self._keys = keys
        self._bounds = bounds  # None: one key per step
        self.sizes = sizes
        """Each key's value size, in `keys()` order; None when not all are known."""

    @classmethod
    def _flat(cls, keys: list[bytes], sizes: list[int] | None) -> Plan:
        plan = cls.__new__(cls)
        plan._init(keys, None, sizes)
        return plan

    def __repr__(self) -> str:
        return f"Plan({len(self)} steps, {len(self._keys)} keys)"

    def __len__(self) -> int:
        return len(self._keys) if self._bounds is None else len(self._bounds) - 1

    @property
    def steps(self) -> list[tuple[bytes, ...]]:
        """The keys of each step, in order."""
        if self._bounds is None:
            return [(k,) for k in self._keys]
        b = self._bounds
        return [tuple(self._keys[b[i] : b[i + 1]]) for i in range(len(b) - 1)]

    @classmethod
    def from_dag(
        cls,
        steps: Mapping[str, Iterable[bytes | str]],
        after: Mapping[str, Iterable[str]],
        *,
        sizes: Mapping[bytes, int] | None = None,
    ) -> Plan:
        """A plan of steps that depend on each other: a topological order of the DAG.

        Args:
            steps: each step's keys, by step name, in the order the steps were
                given (that order breaks ties: of the steps whose dependencies
                are done, the one listed first runs first, as a scheduler that
                runs ready work in submission order does).
            after: for a step, the steps it runs after (omitted: none).

        Raises:
            ValueError: `after` names a step `steps` does not, or the steps form a cycle.
        """
        names = list(steps)
        index = {name: i for i, name in enumerate(names)}
        waiting = [0] * len(names)
        unblocks: list[list[int]] = [[] for _ in names]
        for name, deps in after.items():
            if name not in index:
                raise ValueError(f"after names step {name!r}, which is not in steps")
            for dep in set(deps):
                if dep not in index:
                    raise ValueError(f"step {name!r} runs after {dep!r}, which is not in steps")
                waiting[index[name]] += 1
                unblocks[index[dep]].append(index[name])
        ready = [i for i, n in enumerate(waiting) if n == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in unblocks[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(names):
            cycle = sorted(names[i] for i, n in enumerate(waiting) if n > 0)
            raise ValueError(f"the steps form a cycle (among {', '.join(map(repr, cycle[:8]))})")
        return cls((steps[names[i]] for i in order), sizes=sizes)

    @classmethod
    def of_keys(cls, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> Plan:
        """A plan that reads `keys` one per step, in order."""
        if sizes is not None and len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys")
        return cls._flat([as_key(k) for k in keys], None if sizes is None else list(sizes))

    @classmethod
    def sampler_order(
        cls, keys: Sequence[bytes | str], indices: Iterable[int], sizes: Sequence[int] | None = None
    ) -> Plan:
        """The plan of an epoch: `keys[i]` for each sample index `i` in the sampler's order.

        Args:
            keys: every sample's key, by index.
            indices: the order the sampler yields.
            sizes: every sample's size, by index, when known.

        Raises:
            IndexError: an index out of range.
        """
        order = indices if isinstance(indices, Sequence) else list(indices)
        for i in order:
            if not 0 <= i < len(keys):
                raise IndexError(f"sampler index {i} out of range for {len(keys)} samples")
        return cls._flat([as_key(keys[i]) for i in order], None if sizes is None else [sizes[i] for i in order])

    @classmethod
    def execution_order(cls, manifest: Steps, order: Sequence[str]) -> Plan:
        """The plan of one forward of a saved model: the values of each module in `order`, the order it runs.

        Args:
            manifest: the saved model's manifest (`cacheclient.models.read_manifest`).
            order: module paths in execution order (`ParameterStream.order`).

        Raises:
            ValueError: `order` names a module the manifest does not list.
        """
        steps, sizes = manifest.execution_steps(order)
        return cls(steps, sizes=sizes)

    def keys(self) -> list[bytes]:
        """Every step's keys, in order."""
        return self._keys

    def keys_before(self, step: int) -> int:
        """How many keys the steps before `step` read: the cursor in keys at that step."""
        if self._bounds is None:
            return min(step, len(self._keys))
        return self._bounds[min(step, len(self._bounds) - 1)]

    def start(self, cache: CacheClient, *, window_bytes: int, priority: str = "normal") -> PlanRun:
        """Hands the plan to the cache server; it fetches ahead of the reads until the run is closed.

        Raises:
            InvalidRequestError, LimitExceededError, DeadlineError: as `CacheClient.prefetch`.
        """
        return PlanRun(self, cache.prefetch(self._keys, window_bytes=window_bytes, sizes=self.sizes, priority=priority))


class PlanRun:
    """A `Plan` running on a cache server; a context manager that ends it."""

    def __init__(self, plan: Plan, prefetch: PrefetchPlan) -> None:
        self.plan = plan
        self.prefetch = prefetch
        """The client's handle of the server's plan."""

    @property
    def progress(self) -> dict[str, Any]:
        """The server's last report: keys planned, fetched, consumed, the window in use, failed, done."""
        return self.prefetch.progress

    def advance(self, steps_done: int) -> None:
        """Tells the server the first `steps_done` steps have been read (reads it serves also count)."""
        self.prefetch.consumed(self.plan.keys_before(steps_done))

    def wait(self, timeout: float) -> bool:
        """Waits until the server reports every key fetched (or failed); returns whether it did."""
        return self.prefetch.wait(timeout)

    def close(self) -> None:
        """Ends the plan: the server stops fetching for it."""
        self.prefetch.close()

    def __enter__(self) -> PlanRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FOLLOW_MAX_KEYS = 1 << 16
"""Keys a `ParameterStream`'s server plan grows to before it is replaced by a new one (from the forward
starting then): it gains a pass every forward, and each planned key costs the server about 110 bytes."""


class FollowedPlan:
    """The server's prefetch plan of a `ParameterStream`, kept one forward ahead of the model.

    The plan is passes of the execution order, one after another, and
    holds the forward running and the next one: plan-aware eviction on the
    server then knows every key's next use across forwards (a key just read
    is next read a whole pass away), not only within one forward, after
    which the keys would fall back to LRU-K. Each forward appends a pass.
    The first pass of a plan reads every module; later passes only the
    modules the client streams (its kept set stays resident, so the server
    neither prefetches nor keeps those). The cursor is reported at every
    module, so modules the client does not read do not hold it back. A new
    order, a plan grown past `FOLLOW_MAX_KEYS`, or a plan the server ended
    starts a new plan. Used only from the model's thread (the hooks): no lock.
    """

    def __init__(self, cache: CacheClient, name: str, window_bytes: int) -> None:
        self._cache = cache
        self._name = name
        self._window_bytes = window_bytes
        self._run: PrefetchPlan | None = None
        self._first: Plan | None = None  # a pass of every module: what a plan starts with
        self._loop: Plan | None = None  # a pass of the streamed modules: what each forward appends
        self._running: Plan | None = None  # the pass of the forward running
        self._base = 0  # where the running forward's pass starts in the plan
        self._next = 0  # where the next forward's pass starts
        self._sent = 0  # the cursor last reported
        self.started = 0
        """Plans started (the first, and one per new order or replacement)."""
        self.extended = 0
        """Passes appended to running plans."""

    def restart(self, first: Plan, loop: Plan) -> None:
        """Replaces the plan with `first` (for the next forward), then `loop`."""
        self.close()
        self._first, self._loop, self._running = first, loop, None
        self._next = self._sent = 0
        keys = first.keys() + loop.keys()
        sizes = first.sizes + loop.sizes if first.sizes is not None and loop.sizes is not None else None
        try:
            self._run = self._cache.prefetch(keys, window_bytes=self._window_bytes, sizes=sizes)
        except CacheClientError as exc:
            log.warning("%s: no server prefetch plan: %s", self._name, exc)
            return
        self.started += 1

    def follow(self, first: Plan, loop: Plan) -> None:
        """An order was recorded: a new plan unless it reads the keys already planned."""
        if (
            self._first is None
            or self._loop is None
            or (first.keys(), loop.keys())
            != (
                self._first.keys(),
                self._loop.keys(),
            )
        ):
            self.restart(first, loop)

    def forward_starts(self) -> None:
        """A forward begins: its pass is the plan's next; the plan gains the pass after it."""
        if self._first is None or self._loop is None or self._run is None:
            return
        first, loop = self._first, self._loop
        if self._run.error is not None or self._next + 2 * len(loop.keys()) > max(
            FOLLOW_MAX_KEYS, len(first.keys()) + len(loop.keys())
        ):
            if self._run.error is not None:
                log.warning("%s: the server ended its plan (%s); starting another", self._name, self._run.error)
            self.restart(first, loop)
            if self._run is None:
                return
        self._running = first if self._next == 0 else loop
        self._base = self._next
        self._next = self._base + len(self._running.keys())
        if self._run.planned < self._next + len(loop.keys()):
            self._run.extend(loop.keys(), loop.sizes)
            self.extended += 1
        self._report(self._base)

    def reached(self, step: int) -> None:
        """The forward reached `step` of its pass: every step before it is read (or held by the client)."""
        if self._running is not None:
            self._report(self._base + self._running.keys_before(step))

    def _report(self, cursor: int) -> None:
        if self._run is not None and cursor > self._sent:
            self._run.consumed(cursor)
            self._sent = cursor

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
