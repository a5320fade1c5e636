"""The eviction-policy contract: events in, victims out.

A policy never touches bytes. The tier engine tells it what happened to a
tier (a key was inserted, hit, evicted or deleted) and asks it which resident
key should go next; only the engine moves or deletes bytes. Policies are pure:
no I/O, no threads, and time comes from an injected clock, so a policy replays
the same trace to the same victims every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "EvictionPolicy", "monotonic_clock"]

Clock = Callable[[], float]
"""Seconds as a float; only differences between readings matter."""


def monotonic_clock() -> float:
    """The default clock of a live server: `time.monotonic`."""
    return time.monotonic()


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the tier engine needs from an eviction policy.

    The engine calls these under its own lock; implementations need no
    locking of their own. Keys are the cache's keys (bytes); sizes are the
    bytes a key costs in its tier, as the tier accounts them.
    """

    def on_insert(self, key: bytes, size: int) -> None:
        """A key became resident (a put or a fill). Counts as a reference.

        Inserting a key that is already resident replaces its size and counts
        as a reference to it.
        """

    def on_access(self, key: bytes) -> None:
        """A resident key was hit. Unknown keys are ignored."""

    def on_evict(self, key: bytes) -> None:
        """The engine evicted a resident key (it may keep history of it)."""

    def on_delete(self, key: bytes) -> None:
        """The key was deleted by a user; forget it. Unknown keys are ignored."""

    def victim(self) -> bytes | None:
        """The resident key to evict next, or None when nothing is resident.

        Does not remove the key: the engine evicts it and then calls
        `on_evict`. Asking twice without an event in between returns the same
        key.
        """

    def __len__(self) -> int:
        """Number of resident keys."""

    def __contains__(self, key: object) -> bool:
        """Whether the key is resident."""
