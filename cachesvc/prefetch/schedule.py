"""Which open plan's fetch goes next, by the plans' priorities. Pure: plans in, fetches out.

Every plan of a server shares one pool of fetch slots (`prefetch_concurrency`).
When slots are free, `FetchScheduler.issue` hands them out: a plan of higher
`Priority` gets every fetch it can start (its planner says what fits in its
window) before a plan of lower priority gets any; plans of one priority take
one fetch each in turn, so none of them waits behind another's whole window.
A plan with nothing to fetch now (its window full, its keys all fetched)
takes no slot, and the slot goes to the next plan in that order.

The scheduler holds no lock, thread or clock: its driver
(`cachesvc.prefetch.runner.Prefetcher`) calls it under its own lock when a
slot frees or a plan may have more to fetch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from enum import IntEnum
from typing import Generic, Protocol, TypeVar

__all__ = ["FetchScheduler", "FetchSource", "Priority"]


class Priority(IntEnum):
    """How soon a plan's fetches go against other open plans' (the values of the wire's `Priority`)."""

    LOW = 1
    NORMAL = 2
    HIGH = 3

    @classmethod
    def of_wire(cls, value: int) -> Priority:
        """The priority a request names: unspecified (0) and values this server does not know
        (proto3 enums are open: a newer client's) are NORMAL."""
        try:
            return cls(value)
        except ValueError:
            return cls.NORMAL


class FetchSource(Hashable, Protocol):
    """One plan, as the scheduler sees it (`PrefetchPlanner` is one)."""

    def next_fetches(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` (index, key) to fetch now, marked in flight."""
        ...


S = TypeVar("S", bound=FetchSource)


class FetchScheduler(Generic[S]):
    """The open plans by priority, and which of them start the next fetches."""

    def __init__(self) -> None:
        # Highest priority first; in each, the plan whose turn is next first.
        self._rings: dict[Priority, deque[S]] = {p: deque() for p in sorted(Priority, reverse=True)}
        self._priority: dict[S, Priority] = {}

    def __len__(self) -> int:
        return len(self._priority)

    def add(self, source: S, priority: Priority) -> None:
        """Plan `source` is open, at `priority` (last in its priority's turn)."""
        if source in self._priority:
            raise ValueError("the plan is already scheduled")
        self._priority[source] = priority
        self._rings[priority].append(source)

    def remove(self, source: S) -> None:
        """Plan `source` closed (nothing when it was not scheduled)."""
        priority = self._priority.pop(source, None)
        if priority is not None:
            self._rings[priority].remove(source)

    def issue(self, slots: int) -> list[tuple[S, int, bytes]]:
        """Up to `slots` fetches to start now, (plan, index, key) each, in the order to start them."""
        chosen: list[tuple[S, int, bytes]] = []
        for ring in self._rings.values():
            # Round the ring one fetch per plan at a time, until the slots are
            # spent or a whole round found no plan with a fetch to start.
            idle = 0
            while len(chosen) < slots and idle < len(ring):
                source = ring[0]
                ring.rotate(-1)
                fetch = source.next_fetches(1)
                if fetch:
                    index, key = fetch[0]
                    chosen.append((source, index, key))
                    idle = 0
                else:
                    idle += 1
            if len(chosen) >= slots:
                break
        return chosen
