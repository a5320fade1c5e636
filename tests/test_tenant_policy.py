"""`cachesvc.policy.tenants`: quotas per tier and priorities under one budget, as victims and admissions.

The wrapper against the policy it wraps (no tenants: the same victims, event for event), then each rule on
its own, then an engine with a real memory tier holding two tenants to their quotas through a noisy run.
"""

from __future__ import annotations

import math
import random

import pytest

from cacheclient.wire.placement import PlacementMap
from cachesvc.engine import Engine
from cachesvc.policy import make_policy
from cachesvc.policy.tenants import TenantPolicy, TenantShares, node_share
from cachesvc.tiers import MemoryTier


def _shares(*tenants: tuple[str, str, str, int]) -> TenantShares:
    """(name, prefix, priority, l1 quota) each."""
    shares = TenantShares()
    shares.replace([(name, [prefix], priority, {"l1": quota}) for name, prefix, priority, quota in tenants])
    return shares


def test_without_tenants_it_chooses_what_the_wrapped_policy_chooses() -> None:
    rng = random.Random(7)
    plain, wrapped = make_policy("lru-k"), TenantPolicy(lambda: make_policy("lru-k"), "l1", TenantShares())
    resident: set[bytes] = set()
    for _ in range(5000):
        key = f"k{rng.randrange(200)}".encode()
        event = rng.random()
        if key in resident and event < 0.5:
            plain.on_access(key)
            wrapped.on_access(key)
        elif event < 0.8:
            plain.on_insert(key, 100)
            wrapped.on_insert(key, 100)
            resident.add(key)
        elif resident:
            victim = plain.victim()
            assert wrapped.victim() == victim
            assert victim is not None
            plain.on_evict(victim)
            wrapped.on_evict(victim)
            resident.discard(victim)


def test_a_tenant_over_its_quota_gives_the_next_victims_until_it_is_back_under() -> None:
    shares = _shares(("a", "a/", "normal", 300))
    policy = TenantPolicy(lambda: make_policy("lru"), "l1", shares)
    for i in range(3):
        policy.on_insert(f"other/{i}".encode(), 100)
    for i in range(4):
        policy.on_insert(f"a/{i}".encode(), 100)
    assert policy.bytes["a"] == 400
    assert policy.excess() == b"a/0", "a's own least recent key, not the older keys of no tenant"
    policy.on_evict(b"a/0")
    assert policy.excess() is None
    assert policy.victim() == b"other/0"


def test_an_insert_at_the_quota_makes_room_from_its_own_keys() -> None:
    shares = _shares(("a", "a/", "high", 200))
    policy = TenantPolicy(lambda: make_policy("lru"), "l1", shares)
    policy.on_insert(b"low/0", 100)
    policy.on_insert(b"a/0", 100)
    policy.on_insert(b"a/1", 100)
    assert policy.admit(b"a/2", 100, full=True)
    assert policy.victim() == b"a/0"
    assert policy.admit(b"a/big", 300, full=False) is False, "larger than its whole quota"


def test_victims_come_from_the_lowest_priority_first_and_a_high_set_is_not_evicted_by_a_low_scan() -> None:
    shares = _shares(("hi", "hi/", "high", 0), ("lo", "lo/", "low", 0))
    policy = TenantPolicy(lambda: make_policy("lru"), "l1", shares)
    policy.on_insert(b"hi/0", 100)
    policy.on_insert(b"plain/0", 100)
    policy.on_insert(b"lo/0", 100)
    assert policy.victim() == b"lo/0", "the newest key, but the lowest priority"
    policy.on_evict(b"lo/0")
    assert policy.victim() == b"plain/0"
    policy.on_evict(b"plain/0")
    # Only high keys left: a low insert that needs room is not admitted; one with room is, and a high one is.
    assert policy.admit(b"lo/1", 100, full=True) is False
    assert policy.admit(b"lo/1", 100, full=False) is True
    assert policy.admit(b"hi/1", 100, full=True) is True
    assert policy.victim() == b"hi/0"


def test_an_engine_holds_each_tenant_to_its_l1_quota_at_every_step() -> None:
    shares = _shares(("a", "a/", "high", 64 << 10), ("b", "b/", "low", 128 << 10))
    tiers: dict[str, TenantPolicy] = {}

    def policy(tier: str) -> TenantPolicy:
        tiers[tier] = TenantPolicy(lambda: make_policy("lru-k"), tier, shares)
        return tiers[tier]

    engine = Engine(l1=MemoryTier(256 << 10), l2=None, l3=None, policy_factory=policy)
    try:
        rng = random.Random(3)
        a_keys = [f"a/{i}".encode() for i in range(12)]  # 48 KiB: fits a's quota
        for step in range(3000):
            if rng.random() < 0.2:
                key = rng.choice(a_keys)
                if engine.get(key) is None:
                    engine.put(key, bytes(4096))
            else:
                engine.put(f"b/{step}".encode(), bytes(4096))  # a scan: each key once
            l1 = tiers["l1"]
            assert l1.bytes["a"] <= 64 << 10 and l1.bytes["b"] <= 128 << 10, (step, dict(l1.bytes))
        # a's working set stayed: every one of its keys is an L1 hit now.
        assert all(engine.get(key) is not None for key in a_keys)
        assert tiers["l1"].quota_evictions["b"] > 0 and tiers["l1"].quota_evictions["a"] == 0
    finally:
        engine.close()


def test_a_node_holds_a_tenant_to_the_cluster_quota_times_its_share_of_the_placement() -> None:
    # Capacities 3 : 1: the bigger node owns about three quarters of the slots, and the shares add up to one.
    placement = PlacementMap.static(["big:1", "small:1"], [3 << 30, 1 << 30])
    big, small = node_share(placement, "big:1"), node_share(placement, "small:1")
    assert big is not None and small is not None
    assert abs(big + small - 1.0) < 1e-9 and 0.7 < big < 0.8, (big, small)
    assert node_share(placement, "elsewhere:1") is None, "a node the map does not place keeps its share"

    shares = _shares(("a", "a/", "normal", 64 << 10), ("b", "b/", "normal", 0))
    policy = TenantPolicy(lambda: make_policy("lru"), "l1", shares)
    assert shares.quota("a", "l1") == 64 << 10 and policy.quotas() == {"a": 64 << 10}, "unplaced: the whole quota"
    shares.set_share(small)
    assert shares.quota("a", "l1") == math.ceil((64 << 10) * small) and shares.quota("b", "l1") == 0
    assert policy.quotas() == {"a": shares.quota("a", "l1")}, "no quota stays none"
    # The policy holds a to its share here: inserts past it evict a's own keys right after.
    for i in range(40):
        policy.on_insert(f"a/{i}".encode(), 1024)
        while (victim := policy.excess()) is not None:
            policy.on_evict(victim)
        assert policy.bytes["a"] <= shares.quota("a", "l1"), i
    assert policy.bytes["a"] > shares.quota("a", "l1") - 1024
    with pytest.raises(ValueError, match="share"):
        shares.set_share(0.0)


def test_tenant_figures_become_labelled_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from cachesvc.metrics import CacheServerCollector

    counters = {
        "tenant_bytes/l1/team-a": 4096,
        "tenant_hits/l1/team-a": 7,
        "tenant_misses/team-a": 3,
        "tenant_quota/l1/team-a": 8192,
        "gets": 10,
    }
    registry = CollectorRegistry()
    registry.register(CacheServerCollector(lambda: {"tiers": [], "counters": counters}))
    text = generate_latest(registry).decode()
    assert 'cachesvc_tenant_bytes{tenant="team-a",tier="l1"} 4096.0' in text
    assert 'cachesvc_tenant_hits_total{tenant="team-a",tier="l1"} 7.0' in text
    assert 'cachesvc_tenant_misses_total{tenant="team-a"} 3.0' in text
    assert 'cachesvc_tenant_quota_bytes{tenant="team-a",tier="l1"} 8192.0' in text
    assert "tenant_bytes/l1" not in text, "not also an engine event"


def test_it_keeps_the_whole_policy_contract() -> None:
    """Every method of `EvictionPolicy` (the engine asks `key in policy` when it releases a lease)."""
    from cachesvc.policy.base import EvictionPolicy

    policy = TenantPolicy(lambda: make_policy("lru-k"), "l1", _shares(("a", "a/", "high", 0)))
    assert isinstance(policy, EvictionPolicy)
    policy.on_insert(b"a/1", 10)
    assert b"a/1" in policy and b"b/1" not in policy and len(policy) == 1
    policy.on_delete(b"a/1")
    assert b"a/1" not in policy and policy.victim() is None
