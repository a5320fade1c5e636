"""LRU-K through a real server: the keys left resident are exactly those the paper's model predicts."""

from __future__ import annotations

import random
from typing import Any

from cachesvc.tiers.memory import ENTRY_OVERHEAD

from lru_k_reference import ReferenceLRUK


class Tick:
    """A clock that moves one step per event: the server's clock differs, but not its order."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += 1.0


def test_resident_keys_match_the_reference_model(cache_server: Any) -> None:
    capacity = 200_000
    server = cache_server("--l1-bytes", str(capacity), "--policy", "lru-k", "--lru-k", "2", "--lru-k-crp", "0")
    client = server.client()
    tick = Tick()
    model = ReferenceLRUK(tick, k=2, correlated_period=0.0)
    costs: dict[bytes, int] = {}
    rng = random.Random(1993)
    hot = [b"hot/%d" % i for i in range(8)]
    cold = [b"scan/%d" % i for i in range(60)]

    def put(key: bytes, size: int) -> None:
        tick.step()
        client.put(key, bytes(size))
        cost = len(key) + size + ENTRY_OVERHEAD
        if key in costs:
            model.on_evict(key)
            del costs[key]
        while sum(costs.values()) + cost > capacity:
            victim = model.victim()
            assert victim is not None
            model.on_evict(victim)
            del costs[victim]
        model.on_insert(key, cost)
        costs[key] = cost

    def get(key: bytes) -> None:
        tick.step()
        found = client.get(key) is not None
        assert found == (key in costs), f"server and model disagree on {key!r}"
        if found:
            model.on_access(key)

    for key in hot:
        put(key, rng.randrange(2_000, 12_000))
    for _ in range(3):
        for key in hot:
            get(key)
    for round_ in range(4):
        # A sequential scan over cold keys, interleaved with hot reads: the
        # paper's example. Twice-referenced hot keys must not be pushed out.
        for i, key in enumerate(cold):
            put(key, rng.randrange(1_000, 9_000))
            if i % 7 == 0:
                get(rng.choice(hot))
        if round_ == 0:
            resident = {k for k in hot if client.contains(k, cached_only=True)}
            assert resident == set(hot), "a scan of cold keys pushed out keys referenced twice"
        for _ in range(10):
            get(rng.choice(hot + cold))
        put(rng.choice(hot), rng.randrange(2_000, 12_000))  # a re-put is one more reference
    resident = {k for k in hot + cold if client.contains(k, cached_only=True)}
    assert resident == set(costs)
