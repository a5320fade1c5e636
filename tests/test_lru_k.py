"""LRU-K against the paper: a naive reference model, the scan example, edges.

The property test drives the fast policy and the O(n) model in
`lru_k_reference.py` with the same reference strings through an engine-like
driver (evict until the new value fits a byte budget) and requires the same
victims in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachesvc.policy import EvictionPolicy, LRUPolicy, make_policy
from cachesvc.policy.lru_k import LRUKPolicy

from lru_k_reference import ReferenceLRUK


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Tier:
    """A byte-budget tier that asks its policy for victims, as the engine does."""

    policy: EvictionPolicy
    budget: int
    sizes: dict[bytes, int] = field(default_factory=dict)
    evicted: list[bytes] = field(default_factory=list)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def _evict_until(self, need: int) -> None:
        while self.used + need > self.budget:
            key = self.policy.victim()
            assert key is not None and key in self.sizes
            assert self.policy.victim() == key, "victim() changed without an event"
            self.policy.on_evict(key)
            del self.sizes[key]
            self.evicted.append(key)

    def put(self, key: bytes, size: int) -> None:
        if size > self.budget:
            return
        if key in self.sizes:
            self.sizes[key] = size
            self.policy.on_insert(key, size)
            self._evict_until(0)
            return
        self._evict_until(size)
        self.sizes[key] = size
        self.policy.on_insert(key, size)

    def get(self, key: bytes) -> bool:
        """A hit is a reference; a miss fills nothing (no lower tier)."""
        if key in self.sizes:
            self.policy.on_access(key)
            return True
        return False

    def delete(self, key: bytes) -> None:
        self.sizes.pop(key, None)
        self.policy.on_delete(key)


def key(i: int) -> bytes:
    return b"k%d" % i


# A reference string is a list of steps. Each step first moves the clock by
# `dt`, then acts. Small key universes give repeats; "scan" and "burst" steps
# give the two patterns LRU-K is built for.
_DT = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 1.0, 2.5, 7.0])
_step = st.one_of(
    st.tuples(st.just("put"), _DT, st.integers(0, 11), st.integers(1, 4)),
    st.tuples(st.just("get"), _DT, st.integers(0, 11), st.just(0)),
    st.tuples(st.just("delete"), _DT, st.integers(0, 11), st.just(0)),
    # Scans start at a few fixed places so that a later scan re-references
    # keys an earlier one evicted, and their retained history matters.
    st.tuples(st.just("scan"), _DT, st.sampled_from([100, 104, 200]), st.integers(2, 10)),
    st.tuples(st.just("burst"), _DT, st.integers(0, 11), st.integers(2, 5)),
)


def replay(tier: Tier, clock: FakeClock, steps: list[tuple[str, float, int, int]]) -> None:
    for op, dt, i, n in steps:
        clock.now += dt
        if op == "put":
            tier.put(key(i), n)
        elif op == "get":
            if not tier.get(key(i)):
                tier.put(key(i), 1 + i % 3)  # a fill from a lower tier
        elif op == "delete":
            tier.delete(key(i))
        elif op == "scan":
            for j in range(n):
                clock.now += 0.5
                tier.put(key(i + j), 1)
        else:  # burst: correlated re-references, then a put
            for _ in range(n):
                clock.now += 0.1
                tier.get(key(i))
            tier.put(key(i), 2)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(_step, min_size=1, max_size=200),
    k=st.integers(1, 3),
    crp=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    retained=st.sampled_from([None, None, 0, 1, 4, 1000]),
    retained_seconds=st.sampled_from([None, 2.0, 20.0]),
    budget=st.integers(4, 16),
)
def test_matches_reference_model(
    steps: list[tuple[str, float, int, int]],
    k: int,
    crp: float,
    retained: int | None,
    retained_seconds: float | None,
    budget: int,
) -> None:
    options = {
        "k": k,
        "correlated_period": crp,
        "retained_history": retained,
        "retained_seconds": retained_seconds,
    }
    clock = FakeClock(1000.0)
    fast = Tier(LRUKPolicy(clock=clock, **options), budget)  # type: ignore[arg-type]
    model = Tier(ReferenceLRUK(clock=clock, **options), budget)  # type: ignore[arg-type]
    # One clock drives both tiers: replay step by step, comparing as we go.
    for step in steps:
        start = clock.now
        replay(fast, clock, [step])
        end, clock.now = clock.now, start
        replay(model, clock, [step])
        assert clock.now == end
        assert fast.evicted == model.evicted
        assert fast.sizes == model.sizes
        assert len(fast.policy) == len(model.policy) == len(fast.sizes)
    for i in [*range(12), *range(100, 115), *range(200, 210)]:
        assert (key(i) in fast.policy) == (key(i) in model.policy)


def test_scan_does_not_push_out_keys_referenced_twice() -> None:
    # The paper's motivating case: a sequential scan of cold pages must not
    # flush pages with a history of re-reference. LRU loses all of them.
    clock = FakeClock()
    lru_k = Tier(LRUKPolicy(clock=clock, k=2, correlated_period=1.0), budget=10)
    lru = Tier(LRUPolicy(clock), budget=10)
    hot = [key(i) for i in range(5)]
    for tier in (lru_k, lru):
        for _ in range(2):
            for h in hot:
                clock.now += 2.0
                if not tier.get(h):
                    tier.put(h, 1)
        for j in range(100, 300):
            clock.now += 2.0
            tier.put(key(j), 1)
    assert all(h in lru_k.policy for h in hot)
    assert not any(h in lru.policy for h in hot)
    assert set(lru_k.evicted).isdisjoint(hot)


def test_correlated_burst_is_one_reference() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=5.0)
    policy.on_insert(b"burst", 1)
    for _ in range(10):
        clock.now += 1.0
        policy.on_access(b"burst")  # all within 5 s of the previous one
    clock.now += 1.0
    policy.on_insert(b"twice", 1)
    clock.now += 6.0
    policy.on_access(b"twice")
    clock.now += 6.0
    # "burst" saw eleven references but all correlated: still one
    # uncorrelated reference, infinite K-distance, so it goes first.
    assert policy.victim() == b"burst"


def test_uncorrelated_reference_shifts_history_by_the_burst() -> None:
    clock = FakeClock(100.0)
    policy = LRUKPolicy(clock=clock, k=3, correlated_period=2.0)
    model = ReferenceLRUK(clock=clock, k=3, correlated_period=2.0)
    for p in (policy, model):
        clock.now = 100.0
        p.on_insert(b"a", 1)
        for t in (101.0, 102.5, 104.0):  # burst: LAST moves to 104
            clock.now = t
            p.on_access(b"a")
        clock.now = 110.0
        p.on_access(b"a")  # uncorrelated: HIST = [110, 100 + 4, -]
        clock.now = 120.0
        p.on_access(b"a")  # HIST = [120, 110 + 0, 104 + 0]
    assert model.buffer[b"a"].hist == [120.0, 110.0, 104.0]
    assert policy._resident[b"a"].hist == [120.0, 110.0, 104.0]


def test_falls_back_to_lru_when_every_key_is_inside_its_crp() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=60.0)
    for i in range(3):
        clock.now += 1.0
        policy.on_insert(key(i), 1)
    clock.now += 1.0
    policy.on_access(key(0))
    assert policy.victim() == key(1)
    clock.now += 100.0  # everything eligible: infinite distances, LRU first
    policy.on_access(key(2))
    assert policy.victim() == key(1)


def test_victim_holds_until_the_next_event() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=10.0)
    policy.on_insert(b"a", 1)
    clock.now = 11.0
    policy.on_access(b"a")  # uncorrelated: a has a finite K-distance
    clock.now = 15.0
    policy.on_insert(b"b", 1)
    clock.now = 22.0
    assert policy.victim() == b"a"  # b is still inside its CRP
    clock.now = 30.0  # b, infinitely distant, is eligible now; no event yet
    assert policy.victim() == b"a"
    policy.on_insert(b"c", 1)
    assert policy.victim() == b"b"


def test_crp_zero_is_plain_lru_k() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0)
    policy.on_insert(b"a", 1)
    policy.on_access(b"a")  # same clock reading, still a second reference
    policy.on_insert(b"b", 1)
    assert policy.victim() == b"b"


def test_evicted_key_returns_with_its_history() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0, retained_history=10)
    policy.on_insert(b"old", 1)
    clock.now += 1.0
    policy.on_evict(b"old")
    clock.now += 1.0
    policy.on_insert(b"new", 1)
    clock.now += 1.0
    policy.on_insert(b"old", 1)  # second reference: finite K-distance
    assert policy.victim() == b"new"


def test_retained_history_is_bounded_by_count() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0, retained_history=2)
    for i in range(4):
        clock.now += 1.0
        policy.on_insert(key(i), 1)
    for i in range(4):
        policy.on_evict(key(i))
    assert set(policy._retained) == {key(2), key(3)}
    # key(0) lost its history: back with infinite distance, it goes first.
    clock.now += 1.0
    policy.on_insert(key(3), 1)
    clock.now += 1.0
    policy.on_insert(key(0), 1)
    assert policy.victim() == key(0)


def test_returning_key_shifts_its_history() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=3, correlated_period=0.0, retained_history=10)
    policy.on_insert(b"a", 1)
    clock.now = 10.0
    policy.on_access(b"a")
    policy.on_evict(b"a")
    clock.now = 30.0
    policy.on_insert(b"a", 1)
    assert policy._resident[b"a"].hist == [30.0, 10.0, 0.0]


def test_default_retained_history_follows_the_resident_count() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0)
    for i in range(4):
        clock.now += 1.0
        policy.on_insert(key(i), 1)
    for i in range(3):
        policy.on_evict(key(i))
    assert set(policy._retained) == {key(2)}  # one resident key, one history
    for i in (4, 5):
        clock.now += 1.0
        policy.on_insert(key(i), 1)
    policy.on_evict(key(3))  # resident: 4, 5; retained: 2, 3
    policy.on_delete(key(4))  # resident: 5; the bound is now 1
    clock.now += 1.0
    policy.on_insert(key(6), 1)  # trims the retained set before looking in it
    assert set(policy._retained) == {key(3)}
    clock.now += 1.0
    policy.on_insert(key(2), 1)
    assert policy._resident[key(2)].hist[1] == -math.inf
    for k in list(policy._resident):
        policy.on_evict(k)  # an empty tier keeps no history at all
    assert not policy._retained


def test_retained_history_is_bounded_by_time() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0, retained_history=100, retained_seconds=10.0)
    policy.on_insert(b"a", 1)
    policy.on_evict(b"a")
    clock.now = 11.0
    policy.on_insert(b"b", 1)
    clock.now = 12.0
    policy.on_insert(b"a", 1)  # history expired at t=10: a stranger again
    assert policy.victim() == b"b"  # both infinite; b referenced first
    assert not policy._retained
    # Exactly `retained_seconds` after its last reference, history is kept.
    policy.on_evict(b"b")
    clock.now = 21.0
    policy.on_insert(b"b", 1)
    assert policy._resident[b"b"].hist == [21.0, 11.0]


def test_delete_forgets_history() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.0, retained_history=100)
    policy.on_insert(b"a", 1)
    clock.now += 1.0
    policy.on_access(b"a")
    clock.now += 1.0
    policy.on_insert(b"b", 1)
    policy.on_delete(b"a")
    assert b"a" not in policy and len(policy) == 1
    clock.now += 1.0
    policy.on_insert(b"a", 1)  # no past: infinite distance, newest
    assert policy.victim() == b"b"
    policy.on_evict(b"b")
    policy.on_delete(b"b")  # deleting an evicted key drops its retained history
    assert b"b" not in policy._retained
    clock.now += 1.0
    policy.on_insert(b"b", 1)
    assert policy.victim() == b"a"


def test_victim_of_empty_policy_and_unknown_keys() -> None:
    policy = LRUKPolicy(clock=FakeClock())
    assert policy.victim() is None
    policy.on_access(b"nope")
    policy.on_evict(b"nope")
    policy.on_delete(b"nope")
    assert len(policy) == 0 and b"nope" not in policy


def test_heaps_stay_bounded_under_churn() -> None:
    clock = FakeClock()
    policy = LRUKPolicy(clock=clock, k=2, correlated_period=0.5, retained_history=50)
    tier = Tier(policy, budget=20)
    for step in range(20_000):
        clock.now += 0.1
        i = (step * 7919) % 97
        if not tier.get(key(i)):
            tier.put(key(i), 1)
    # Compaction runs on evictions; promotions since then add at most one
    # entry per resident key.
    assert len(policy._eligible) <= 3 * len(policy) + 64
    assert len(policy._retained) <= 50
    assert len(policy._retained_order) <= 2 * 50 + 64 + 1


def test_is_an_eviction_policy_built_by_make_policy() -> None:
    policy = make_policy("lru-k", FakeClock(), k=3, correlated_period=0.0)
    assert isinstance(policy, LRUKPolicy) and isinstance(policy, EvictionPolicy)
    assert policy.name == "lru-k"


@pytest.mark.parametrize(
    "options",
    [
        {"k": 0},
        {"k": 1.5},
        {"correlated_period": -1.0},
        {"correlated_period": math.nan},
        {"retained_history": -1},
        {"retained_seconds": 0.0},
    ],
)
def test_rejects_bad_parameters(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LRUKPolicy(clock=FakeClock(), **options)  # type: ignore[arg-type]
