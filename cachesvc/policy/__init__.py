"""Eviction policies for the cache tiers, and the factory that picks one.

`make_policy(name, clock, **options)` builds a policy by its config name.
"""

from __future__ import annotations

from typing import Any

from cachesvc.policy.base import Clock, EvictionPolicy, monotonic_clock
from cachesvc.policy.lru import LRUPolicy

__all__ = ["POLICY_NAMES", "Clock", "EvictionPolicy", "LRUPolicy", "make_policy", "monotonic_clock"]

POLICY_NAMES = ("lru", "lru-k")


def make_policy(name: str, clock: Clock = monotonic_clock, **options: Any) -> EvictionPolicy:
    """Builds the eviction policy named `name` ("lru" or "lru-k").

    Raises:
        ValueError: the name is not a known policy.
    """
    if name == "lru":
        return LRUPolicy(clock)
    if name == "lru-k":
        from cachesvc.policy.lru_k import LRUKPolicy

        return LRUKPolicy(clock=clock, **options)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
