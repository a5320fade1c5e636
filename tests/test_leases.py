"""Leases (pins) and TTLs in the engine, on a clock the test moves."""

from __future__ import annotations

import pytest

from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.errors import TierFull
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import MemoryTier
from cachesvc.tiers.memory import ENTRY_OVERHEAD


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with(clock: Clock, slots: int, **kwargs: object) -> Engine:
    # Room for exactly `slots` 1,000-byte values under 2-byte keys.
    l1 = MemoryTier(slots * (1000 + 2 + ENTRY_OVERHEAD))
    return Engine(l1=l1, l2=None, l3=None, policy_factory=lambda _: LRUPolicy(), clock=clock, **kwargs)  # type: ignore[arg-type]


def test_pinned_values_survive_pressure_until_read_with_release() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=4)
    for i in range(2):
        engine.put(b"p%d" % i, b"P" * 1000, lease=30)
    for i in range(10):  # pressure: unpinned values come and go
        engine.put(b"u%d" % i, b"U" * 1000)
    assert engine.get(b"p0") is not None and engine.get(b"p1") is not None
    assert sum(engine.get(b"u%d" % i) is not None for i in range(10)) == 2
    assert engine.get(b"p0", release=True) is not None  # the decode side read it: evictable now
    for i in range(10, 14):
        engine.put(b"u%d" % i, b"U" * 1000)
    assert engine.get(b"p0") is None  # evicted by the policy once released
    assert engine.get(b"p1") is not None  # still pinned


def test_all_pinned_means_a_clear_refusal_until_leases_expire() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=3)
    for i in range(3):
        engine.put(b"p%d" % i, b"P" * 1000, lease=10)
    with pytest.raises(TierFull):
        engine.put(b"new", b"N" * 1000)
    clock.now += 11  # the decode worker died: the leases run out
    engine.put(b"new", b"N" * 1000)
    assert engine.get(b"new") is not None
    assert engine.stats()["counters"]["leases_expired"] == 3


def test_ttl_forgets_values() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=8, namespaces=[Namespace(b"kv/", WriteMode.CACHE_ONLY, 0.0, 60.0)])
    engine.put(b"kv/a", b"x")
    engine.put(b"plain", b"y", ttl=5)
    engine.put(b"forever", b"z")
    clock.now += 6
    assert engine.get(b"plain") is None
    assert engine.get(b"kv/a") is not None and engine.get(b"forever") is not None
    clock.now += 60
    assert engine.get(b"kv/a") is None and engine.get(b"forever") is not None
    assert engine.l1 is not None and engine.l1.tier.used_bytes == engine.l1.tier.cost(b"forever", 1)


def test_namespace_default_lease_pins_without_asking() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=3, namespaces=[Namespace(b"kv/", WriteMode.CACHE_ONLY, 30.0, 0.0)])
    engine.put(b"kv/block", b"B" * 1000)
    for i in range(5):
        engine.put(b"u%d" % i, b"U" * 1000)
    assert engine.get(b"kv/block") is not None
    assert engine.stats()["counters"]["pinned_keys"] == 1


def test_a_value_leased_twice_needs_two_releases() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=3)
    engine.put(b"sh", b"S" * 1000, lease=30)  # prompt A's prefill
    engine.put(b"sh", b"S" * 1000, lease=30)  # prompt B's prefill, the same shared block
    engine.get(b"sh", release=True)  # A's decode
    for i in range(6):
        engine.put(b"u%d" % i, b"U" * 1000)
    assert engine.get(b"sh") is not None, "B's lease still pins the shared block"
    engine.get(b"sh", release=True)  # B's decode
    for i in range(6, 12):
        engine.put(b"u%d" % i, b"U" * 1000)
    assert engine.get(b"sh") is None


def test_contains_honours_ttl() -> None:
    clock = Clock()
    engine = engine_with(clock, slots=3)
    engine.put(b"t", b"x", ttl=5)
    assert engine.contains(b"t") == "l1"
    clock.now += 6
    assert engine.contains(b"t") is None
