"""The feed of demand reads: how the engine tells others what was read.

The engine publishes the keys of every demand read (not prefetches) to a
`ReadFeed` it is given; whoever builds both the engine and a consumer (the
server builds the engine and the prefetcher) subscribes the consumer. The
engine never knows who listens, so no layer calls back up into the one that
built it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

__all__ = ["ReadFeed", "ReadListener"]

log = logging.getLogger(__name__)

ReadListener = Callable[[Sequence[bytes]], None]
"""Called with the keys of one demand read, outside every engine lock."""


class ReadFeed:
    """Subscribers to demand reads. Thread-safe; a failing subscriber is logged, not raised."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: tuple[ReadListener, ...] = ()

    def subscribe(self, listener: ReadListener) -> Callable[[], None]:
        """Adds `listener`; returns the function that removes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(fn for fn in self._listeners if fn is not listener)

        return unsubscribe

    def publish(self, keys: Sequence[bytes]) -> None:
        """Hands `keys` to every subscriber (called by the engine after a demand read)."""
        for listener in self._listeners:
            try:
                listener(keys)
            except Exception:
                log.exception("a read subscriber failed")

    def __len__(self) -> int:
        return len(self._listeners)
