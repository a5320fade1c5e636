"""Values a server has read and answered `streamed`, held until the caller fetches them.

A Get or GetMany whose values do not fit in one answer marks them
`streamed=true` under a hand-off token; the caller's follow-up (GetStream,
GetManyStream, or a GetMany for the values small enough to travel inline)
presents the token and is served the bytes already read, so a logical get
reads the engine once (one count, one eviction-policy touch, one lease
release). Holding is bounded three ways: bytes, hand-offs, and time. A value
that is gone (expired, or dropped to make room) is not an error: the server
reads its key again, as if no token had been sent: a key a token does not
hold (the token unknown, expired, or naming other keys) is checked for
ownership like any read before it is read, so a token never stands in for
that check (`CacheServicer._hits`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Handoffs"]

T = TypeVar("T")

_TOKEN_BYTES = 16


@dataclass(slots=True)
class _Held(Generic[T]):
    """One hand-off: the values of its keys (a key read twice holds two), how many, and their bytes."""

    values: dict[bytes, list[tuple[T, int]]]
    count: int
    size: int
    deadline: float


class Handoffs(Generic[T]):
    """A bounded table of read values waiting for their follow-up, by token.

    Args:
        max_bytes: bytes held at most; holding more drops the oldest hand-offs
            first. A single hand-off larger than this is held alone.
        seconds: how long a hand-off waits for its follow-ups.
        max_entries: hand-offs held at most.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self,
        max_bytes: int,
        seconds: float,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.seconds = seconds
        self.max_entries = max_entries
        self._clock = clock
        self._held: OrderedDict[bytes, _Held[T]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.counters = {"handoffs": 0, "handoff_misses": 0, "handoffs_dropped": 0}
        """handoffs: hand-offs held; handoff_misses: keys a follow-up named
        that were no longer held (read again); handoffs_dropped: hand-offs
        dropped before their time to make room."""

    def hold(self, items: Sequence[tuple[bytes, T, int]]) -> bytes:
        """Holds (key, value, size in bytes) for each item and returns the token that takes them."""
        values: dict[bytes, list[tuple[T, int]]] = {}
        for key, value, size in items:
            values.setdefault(key, []).append((value, size))
        size = sum(size for _, _, size in items)
        token = secrets.token_bytes(_TOKEN_BYTES)
        with self._lock:
            now = self._clock()
            self._drop_expired(now)
            while self._held and (self._bytes + size > self.max_bytes or len(self._held) >= self.max_entries):
                self._pop_oldest()
                self.counters["handoffs_dropped"] += 1
            self._held[token] = _Held(values, len(items), size, now + self.seconds)
            self._bytes += size
            self.counters["handoffs"] += 1
        return token

    def take(self, token: bytes, keys: Sequence[bytes]) -> list[T | None]:
        """The values held under `token` for `keys`, in order, each once; None for a key not held (read it)."""
        found: list[T | None] = []
        with self._lock:
            self._drop_expired(self._clock())
            held = self._held.get(token)
            for key in keys:
                queue = held.values.get(key) if held is not None else None
                if not queue:
                    self.counters["handoff_misses"] += 1
                    found.append(None)
                    continue
                value, size = queue.pop(0)
                assert held is not None
                held.count -= 1
                held.size -= size
                self._bytes -= size
                found.append(value)
            if held is not None and held.count == 0:
                del self._held[token]
        return found

    @property
    def held_bytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _drop_expired(self, now: float) -> None:
        # Every hand-off waits the same time, so insertion order is deadline order.
        while self._held and next(iter(self._held.values())).deadline <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, held = self._held.popitem(last=False)
        self._bytes -= held.size
