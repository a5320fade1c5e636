"""Least-recently-used eviction: the baseline every other policy is held to."""

from __future__ import annotations

from collections import OrderedDict

from cachesvc.policy.base import Clock, monotonic_clock

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Evicts the resident key whose last reference is oldest.

    O(1) per event; about 100 bytes per resident key beyond the key itself
    (one OrderedDict entry).
    """

    name = "lru"

    def __init__(self, clock: Clock = monotonic_clock) -> None:
        # LRU needs only the order of events; the clock is accepted so every
        # policy is built the same way.
        del clock
        self._order: OrderedDict[bytes, int] = OrderedDict()

    def on_insert(self, key: bytes, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_evict(self, key: bytes) -> None:
        self._order.pop(key, None)

    def on_delete(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self) -> bytes | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
