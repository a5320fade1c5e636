"""Per-key deadlines: the leases that pin values and the TTLs that expire them.

A heap of (deadline, key) with lazy invalidation: setting or dropping a key's
deadline leaves its old heap entry behind, which `due` skips. Time comes from
the caller, so the structure is pure.
"""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

T = TypeVar("T")


class Deadlines(Generic[T]):
    """Keys with a deadline and a payload each."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, tuple[float, T]] = {}
        self._heap: list[tuple[float, bytes]] = []

    def set(self, key: bytes, deadline: float, payload: T) -> None:
        self._by_key[key] = (deadline, payload)
        heapq.heappush(self._heap, (deadline, key))
        if len(self._heap) > 2 * len(self._by_key) + 64:
            # Stale entries outnumber live ones: rebuild so memory stays bounded.
            self._heap = [(d, k) for k, (d, _) in self._by_key.items()]
            heapq.heapify(self._heap)

    def get(self, key: bytes) -> tuple[float, T] | None:
        return self._by_key.get(key)

    def pop(self, key: bytes) -> T | None:
        found = self._by_key.pop(key, None)
        return None if found is None else found[1]

    def due(self, now: float) -> list[tuple[bytes, T]]:
        """Removes and returns every key whose deadline is at or before `now`."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            deadline, key = heapq.heappop(self._heap)
            current = self._by_key.get(key)
            if current is not None and current[0] == deadline:
                del self._by_key[key]
                expired.append((key, current[1]))
        return expired

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)
