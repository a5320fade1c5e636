"""The prefetch planner against a naive model: window never exceeded, plan order kept, everything fetched."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.prefetch import FetchScheduler, PrefetchPlanner, Priority
from cachesvc.prefetch.planner import Outcome


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 100), min_size=1, max_size=60),
    window=st.integers(100, 400),
    limit=st.integers(1, 6),
    script=st.lists(st.tuples(st.sampled_from(["finish", "read", "consume"]), st.integers(0, 10**6)), max_size=300),
)
def test_window_order_and_completion(sizes: list[int], window: int, limit: int, script: list[tuple[str, int]]) -> None:
    keys = [f"k{i}".encode() for i in range(len(sizes))]
    planner = PrefetchPlanner(window)
    planner.extend(keys, sizes)
    in_flight: list[int] = []
    started: list[int] = []
    read: set[int] = set()

    def step(action: str, n: int) -> None:
        for index, key in planner.next_fetches(limit - len(in_flight)):
            assert key == keys[index]
            in_flight.append(index)
            started.append(index)
        held = sum(sizes[i] for i in in_flight if i not in read)
        assert planner.progress().window_used_bytes <= window
        assert held <= window
        if action == "finish" and in_flight:
            index = in_flight.pop(n % len(in_flight))
            planner.on_fetched(index, sizes[index])
        elif action == "read":
            # A demand read somewhere near the front, as DataLoader workers do.
            candidates = [i for i in range(len(keys)) if i not in read][:4]
            if candidates:
                i = candidates[n % len(candidates)]
                read.add(i)
                planner.on_read(keys[i])
        elif action == "consume":
            upto = n % (len(keys) + 1)
            planner.on_consumed(upto)
            read.update(range(upto))

    for action, n in script:
        step(action, n)
    # Drain: finish every fetch and read everything in order.
    for _ in range(10 * len(keys) + 10):
        step("finish", 0)
        if not in_flight:
            nxt = [i for i in range(len(keys)) if i not in read]
            if not nxt:
                break
            read.add(nxt[0])
            planner.on_read(keys[nxt[0]])
    progress = planner.progress()
    assert progress.done and progress.consumed == len(keys) and progress.window_used_bytes == 0
    assert started == sorted(started), "fetches start in plan order"


def test_keys_read_before_their_turn_are_skipped() -> None:
    planner = PrefetchPlanner(window_bytes=1000)
    planner.extend([b"a", b"b", b"c"], [10, 10, 10])
    planner.on_read(b"b")
    assert [k for _, k in planner.next_fetches(10)] == [b"a", b"c"]


def test_without_sizes_the_window_is_exceeded_by_at_most_one_value() -> None:
    planner = PrefetchPlanner(window_bytes=100)
    planner.extend([f"k{i}".encode() for i in range(10)])
    (first,) = planner.next_fetches(10)  # one at a time until a size is known
    planner.on_fetched(first[0], 60)
    batch = planner.next_fetches(10)  # estimated at 60 bytes each: none fits beside the first
    assert batch == []
    planner.on_read(b"k0")
    assert len(planner.next_fetches(10)) == 1


def test_a_value_larger_than_the_window_is_left_to_the_read() -> None:
    planner = PrefetchPlanner(window_bytes=50)
    planner.extend([b"big", b"small"], [500, 10])
    assert planner.next_fetches(5) == [(1, b"small")]
    assert planner.progress().failed == 1


def test_a_key_planned_more_than_once_is_read_once_per_occurrence() -> None:
    planner = PrefetchPlanner(window_bytes=1000)
    planner.extend([b"a", b"b", b"a", b"c", b"a"], [10] * 5)
    for key in (b"a", b"b", b"a"):
        planner.on_read(key)
    assert planner.progress().consumed == 3 and planner.wants(b"a")
    assert [i for i, _ in planner.next_fetches(10)] == [3, 4]
    planner.on_read(b"a")
    assert not planner.wants(b"a") and planner.progress().consumed == 3  # index 3 (c) is still unread
    planner.on_consumed(5)
    assert planner.progress().consumed == 5 and planner.progress().window_used_bytes == 0


def test_reads_are_scored_useful_late_or_wasted() -> None:
    planner = PrefetchPlanner(window_bytes=1000)
    planner.extend([b"a", b"b", b"c", b"d", b"e"], [10] * 5)
    fetches = planner.next_fetches(3)  # a, b, c in flight
    planner.on_fetched(fetches[0][0], 10)  # a arrives
    planner.on_fetched(fetches[1][0], 0)  # b was already cached: prefetching did nothing for it
    planner.on_read(b"a")  # useful
    planner.on_read(b"b")  # neither
    planner.on_read(b"c")  # still in flight: late
    planner.on_read(b"e")  # never started: late
    planner.on_fetched(fetches[2][0], 10)  # c's fetch ends after its read: not wasted
    (d,) = planner.next_fetches(5)
    planner.on_fetched(d[0], 10)  # d fetched, never read
    # a and d brought bytes in time to count (b was cached, c ended after its read): 2 prefetched.
    assert planner.outcome(ended=False) == Outcome(useful=1, late=2, wasted=0, prefetched=2)
    assert planner.outcome(ended=True) == Outcome(useful=1, late=2, wasted=1, prefetched=2)


def test_a_value_evicted_before_its_fetch_reports_is_counted_evicted() -> None:
    planner = PrefetchPlanner(window_bytes=1000)
    planner.extend([b"a", b"b"], [10, 10])
    (a, b) = planner.next_fetches(2)
    planner.on_evicted(b"a")  # a landed in the cache and was evicted before its fetch returned
    planner.on_fetched(a[0], 10)
    planner.on_fetched(b[0], 10)
    planner.on_evicted(b"b")
    planner.on_read(b"a")
    planner.on_read(b"b")
    assert planner.outcome(ended=True) == Outcome(useful=0, late=0, wasted=0, evicted=2, prefetched=2)


def _plan(name: str, n: int, window: int = 1000, size: int = 10) -> PrefetchPlanner:
    planner = PrefetchPlanner(window)
    planner.extend([f"{name}{i}".encode() for i in range(n)], [size] * n)
    return planner


def test_a_high_priority_plans_keys_are_issued_before_a_low_priority_plans() -> None:
    scheduler: FetchScheduler[PrefetchPlanner] = FetchScheduler()
    low, high = _plan("low", 5), _plan("high", 5, window=30)
    scheduler.add(low, Priority.LOW)  # opened first: its turn would come first without priorities
    scheduler.add(high, Priority.HIGH)
    first = scheduler.issue(2)
    assert [key for _, _, key in first] == [b"high0", b"high1"]
    # The high plan's window holds 3 values: the rest of the slots go to the low plan.
    rest = scheduler.issue(3)
    assert [key for _, _, key in rest] == [b"high2", b"low0", b"low1"]
    # A high fetch done frees its window: the next slot is the high plan's again.
    high.on_fetched(0, 10)
    high.on_read(b"high0")
    assert [key for _, _, key in scheduler.issue(1)] == [b"high3"]
    scheduler.remove(high)
    assert [key for _, _, key in scheduler.issue(1)] == [b"low2"]


def test_plans_of_one_priority_take_turns() -> None:
    scheduler: FetchScheduler[PrefetchPlanner] = FetchScheduler()
    a, b, c = _plan("a", 3), _plan("b", 3), _plan("c", 1)
    for planner in (a, b, c):
        scheduler.add(planner, Priority.NORMAL)
    keys = [key for _, _, key in scheduler.issue(6)]
    assert keys == [b"a0", b"b0", b"c0", b"a1", b"b1", b"a2"]
    assert scheduler.issue(6) == [(b, 2, b"b2")]
    assert scheduler.issue(6) == []


def test_a_requests_priority_unknown_or_unspecified_is_normal() -> None:
    assert [Priority.of_wire(v) for v in (0, 1, 2, 3, 77)] == [
        Priority.NORMAL,
        Priority.LOW,
        Priority.NORMAL,
        Priority.HIGH,
        Priority.NORMAL,
    ]


@settings(max_examples=200, deadline=None)
@given(
    plans=st.lists(st.tuples(st.sampled_from(list(Priority)), st.integers(0, 6), st.integers(1, 4)), max_size=6),
    slots=st.lists(st.integers(0, 5), min_size=1, max_size=8),
)
def test_issue_follows_priority_then_turns(plans: list[tuple[Priority, int, int]], slots: list[int]) -> None:
    """The rule itself, on random plans: in each issue, priorities never rise; a slot left over, or one
    given to a lower priority, means the plans above had nothing to start; and within a priority no plan
    gets two fetches more than another that still had one to start."""
    scheduler: FetchScheduler[PrefetchPlanner] = FetchScheduler()
    level_of: dict[PrefetchPlanner, Priority] = {}
    for n, (level, keys, window_values) in enumerate(plans):
        planner = _plan(f"p{n}-", keys, window=10 * window_values)
        scheduler.add(planner, level)
        level_of[planner] = level

    def has_more(planner: PrefetchPlanner) -> bool:
        # Destructive only when it finds a fetch, and then the test fails anyway.
        return planner.next_fetches(1) != []

    for free in slots:
        chosen = scheduler.issue(free)
        assert len(chosen) <= free
        levels = [level_of[planner] for planner, _, _ in chosen]
        assert levels == sorted(levels, reverse=True)
        if free:
            lowest = levels[-1] if len(chosen) == free else Priority.LOW - 1
            assert not any(has_more(p) for p, level in level_of.items() if level > lowest)
        got = {planner: sum(1 for p, _, _ in chosen if p is planner) for planner in level_of}
        for planner, count in got.items():
            behind = [p for p, n in got.items() if level_of[p] == level_of[planner] and n <= count - 2]
            assert not any(has_more(p) for p in behind)
        for planner, index, key in chosen:  # every fetch lands and is read: windows free for the next round
            planner.on_fetched(index, 10)
            planner.on_read(key)
