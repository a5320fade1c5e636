"""The write-back queue: keys whose newest value is only in the cache tiers.

A bounded set of keys in arrival order. `reserve` blocks a writer while the
queue is full (up to a deadline, then `Overloaded`), so a burst of write-back
puts slows down instead of growing without bound. The engine's flusher thread
drains it into object storage.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from cachesvc.errors import Overloaded

__all__ = ["WriteBackQueue"]


class WriteBackQueue:
    """Keys awaiting upload, at most `capacity` at a time; a key queued twice is uploaded once."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"write-back queue capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._reserved = 0
        self._cond = threading.Condition()

    def reserve(self, key: bytes, timeout: float) -> bool:
        """Waits for room for `key`; returns whether a slot was taken (False: already queued)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if key in self._keys:
                    return False
                if len(self._keys) + self._reserved < self.capacity:
                    self._reserved += 1
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(f"write-back queue full ({self.capacity} keys awaiting upload to object storage)")
                self._cond.wait(left)

    def push(self, key: bytes, reserved: bool) -> None:
        """Queues `key`, using the slot `reserve` took when `reserved`."""
        with self._cond:
            if reserved:
                self._reserved -= 1
            self._keys[key] = None
            self._keys.move_to_end(key)
            self._cond.notify_all()

    def release(self, reserved: bool) -> None:
        """Gives back a slot taken by `reserve` that was not used."""
        if reserved:
            with self._cond:
                self._reserved -= 1
                self._cond.notify_all()

    def pop(self, timeout: float) -> bytes | None:
        """The oldest queued key, or None if none arrived within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._keys:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            key, _ = self._keys.popitem(last=False)
            self._cond.notify_all()
            return key

    def discard(self, key: bytes) -> None:
        with self._cond:
            if self._keys.pop(key, 0) is None:
                self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._keys)
