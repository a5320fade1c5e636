"""Plan-aware eviction through a real server and SeaweedFS: loops larger than L1, two plans, closing one.

L1 holds 10 values of 100 kB here (no L2). A loop of reads over more keys
than that makes LRU and LRU-K fetch every value from object storage on every
pass; with a plan that describes the loop, the server keeps a stable subset
resident (Belady's MIN on the plan), so each pass fetches only the rest.
"""

from __future__ import annotations

import os
from typing import Any

from cacheclient import CacheClient

from conftest import s3_args, wait_until

SIZE = 100_000
L1_BYTES = 1_100_000  # 10 values of SIZE with their entry overhead


def upload(s3: Any, prefix: str, names: list[str], size: int) -> dict[str, bytes]:
    raw = s3.client()
    data = {}
    for name in names:
        data[name] = os.urandom(size)
        raw.put_object(Bucket=s3.bucket, Key=prefix + name, Body=data[name])
    return data


def fills(client: CacheClient) -> int:
    return int(client.stats()["counters"].get("fills", 0))


def run_pass(client: CacheClient, names: list[str], data: dict[str, bytes]) -> tuple[int, set[str]]:
    """Reads `names` in order; returns the values fetched from object storage and the keys L1 answered."""
    before = fills(client)
    hits = set()
    for name in names:
        value, tier = client.get_with_tier(name)
        assert value == data[name]
        if tier == "l1":
            hits.add(name)
    return fills(client) - before, hits


def test_a_planned_loop_larger_than_l1_keeps_a_stable_subset(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    plain = [f"plain/{i:02d}" for i in range(30)]
    looped = [f"loop/{i:02d}" for i in range(30)]
    data = upload(s3, s3_prefix, plain + looped, SIZE)
    client = cache_server("--l1-bytes", str(L1_BYTES), *s3_args(s3, s3_prefix)).client()

    # No plan: LRU-K thrashes; every pass fetches all 30 values.
    fetched = [run_pass(client, plain, data)[0] for _ in range(3)]
    assert fetched[1] >= 28 and fetched[2] >= 28, fetched

    passes = 4
    with client.prefetch(looped * passes, window_bytes=SIZE, sizes=[SIZE] * 30 * passes) as plan:
        results = [run_pass(client, looped, data) for _ in range(passes)]
        counters = client.stats()["counters"]
        number = max(int(k.split("_")[2]) for k in counters if k.startswith("prefetch_plan_"))
    fetched_with_plan = [f for f, _ in results]
    # Each pass after the first keeps most of L1: at most 30 - 7 values fetched (Belady: 30 - 9; one
    # slot holds the window, one turns over).
    assert all(f <= 23 for f in fetched_with_plan[1:]), fetched_with_plan
    hit_sets = [hits for _, hits in results]
    assert all(len(hits) >= 7 for hits in hit_sets[1:]), [len(h) for h in hit_sets]
    # A stable subset: the same keys hit pass after pass.
    assert len(hit_sets[2] & hit_sets[3]) >= 6, (sorted(hit_sets[2]), sorted(hit_sets[3]))
    assert plan.error is None

    name = f"prefetch_plan_{number}_"
    assert counters[name + "prefetched"] > 0
    assert counters[name + "used_in_time"] + counters[name + "used_late"] > 0
    assert counters[name + "evicted_before_use"] == 0  # a value in the window is never the victim here
    wait_until(lambda: client.stats()["counters"]["prefetch_plans_open"] == 0, 10, "the server to end the plan")
    after = client.stats()["counters"]
    assert after[name + "wasted"] == 0  # every planned key was read; the closed plan is still listed
    assert after["prefetch_prefetched"] >= counters[name + "prefetched"]


def test_two_plans_share_l1_and_closing_one_frees_its_keys(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    a = [f"a/{i}" for i in range(8)]
    b = [f"b/{i}" for i in range(8)]
    data = upload(s3, s3_prefix, a + b, SIZE)
    server = cache_server("--l1-bytes", str(L1_BYTES), *s3_args(s3, s3_prefix))
    client = server.client()
    other = server.client()
    passes = 3
    interleaved = [key for pair in zip(a, b, strict=True) for key in pair]
    plan_b = other.prefetch(b * (passes + 2), window_bytes=SIZE, sizes=[SIZE] * 8 * (passes + 2))
    with client.prefetch(a * passes, window_bytes=SIZE, sizes=[SIZE] * 8 * passes):
        # Two jobs reading their own loops at the same pace: 16 keys through a 10-value L1.
        results = [run_pass(client, interleaved, data) for _ in range(passes)]
        counters = client.stats()["counters"]
    assert all(f <= 16 - 5 for f, _ in results[1:]), [f for f, _ in results]
    numbers = sorted({int(k.split("_")[2]) for k in counters if k.startswith("prefetch_plan_")})
    assert len(numbers) == 2
    for number in numbers:  # each plan is counted on its own
        assert counters[f"prefetch_plan_{number}_prefetched"] > 0
    wait_until(lambda: client.stats()["counters"]["prefetch_plans_open"] == 1, 10, "the server to end plan a")

    # Plan a closed: its keys are no plan's now and go first, so b's loop (8 values) fits L1 whole.
    run_pass(other, b, data)
    fetched, hits = run_pass(other, b, data)
    plan_b.close()
    assert fetched == 0 and hits == set(b), (fetched, sorted(hits))


def test_a_window_larger_than_l1_counts_values_evicted_before_use(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    names = [f"w/{i:02d}" for i in range(20)]
    upload(s3, s3_prefix, names, SIZE)
    client = cache_server("--l1-bytes", str(L1_BYTES), *s3_args(s3, s3_prefix)).client()
    plan = client.prefetch(names, window_bytes=15 * SIZE, sizes=[SIZE] * 20)
    wait_until(lambda: plan.progress["fetched"] >= 15, 30, "the plan to fetch its 15-value window")
    counters = client.stats()["counters"]
    number = max(int(k.split("_")[2]) for k in counters if k.startswith("prefetch_plan_"))
    name = f"prefetch_plan_{number}_"
    # 15 values fetched into a 10-value L1: every resident value is in the window, so the ones
    # read furthest ahead make room, 5 of them, and the plan stops at its window.
    assert counters[name + "prefetched"] == 15 and counters[name + "evicted_before_use"] == 5
    assert counters["prefetch_evicted_before_use"] >= 5
    plan.close()
    wait_until(lambda: client.stats()["counters"]["prefetch_plans_open"] == 0, 10, "the server to end the plan")
    after = client.stats()["counters"]
    assert after[name + "wasted"] == 10  # the 10 still resident, never read
    assert after[name + "used_in_time"] == after[name + "used_late"] == 0
