"""The linearizability checker: hand-made histories, a brute-force reference, and
histories of simulated clients against the Raft cluster under faults.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linearizability import CheckResult, KvInput, Operation, check_operations, kv_model
from raft_sim import Cluster, KvClient


def put(client: int, key: str, value: str, call: float, ret: float) -> Operation:
    return Operation(client, KvInput("put", key, value), call, None, ret)


def get(client: int, key: str, value: str | None, call: float, ret: float) -> Operation:
    return Operation(client, KvInput("get", key), call, value, ret)


def verdict(history: Sequence[Operation]) -> CheckResult:
    return check_operations(kv_model(), history)[0]


# ---------------------------------------------------------------------- hand-made histories


def test_sequential_history_is_linearizable() -> None:
    h = [put(0, "x", "1", 0, 1), get(1, "x", "1", 2, 3), put(0, "x", "2", 4, 5), get(1, "x", "2", 6, 7)]
    assert verdict(h) is CheckResult.OK


def test_concurrent_operations_may_take_effect_in_either_order() -> None:
    # The read overlaps both writes, so it may see either.
    for seen in ("1", "2", None):
        h = [put(0, "x", "1", 0, 10), put(1, "x", "2", 1, 9), get(2, "x", seen, 2, 8)]
        assert verdict(h) is CheckResult.OK, seen


def test_stale_read_is_not_linearizable() -> None:
    h = [put(0, "x", "1", 0, 1), put(0, "x", "2", 2, 3), get(1, "x", "1", 4, 5)]
    result, part = check_operations(kv_model(), h)
    assert result is CheckResult.ILLEGAL
    assert {op.input.key for op in part} == {"x"}


def test_reads_may_not_go_back_in_time() -> None:
    # Both reads overlap the write, but once one read saw "1" a later one cannot see None.
    h = [put(0, "x", "1", 0, 10), get(1, "x", "1", 1, 2), get(2, "x", None, 3, 4)]
    assert verdict(h) is CheckResult.ILLEGAL


def test_read_of_a_value_never_written_is_not_linearizable() -> None:
    assert verdict([put(0, "x", "1", 0, 1), get(1, "x", "3", 2, 3)]) is CheckResult.ILLEGAL


def test_unanswered_write_may_or_may_not_take_effect() -> None:
    pending = put(0, "x", "1", 0, math.inf)
    assert verdict([pending, get(1, "x", None, 5, 6)]) is CheckResult.OK
    assert verdict([pending, get(1, "x", "1", 5, 6)]) is CheckResult.OK
    # But once seen, it cannot be unseen.
    assert verdict([pending, get(1, "x", "1", 5, 6), get(1, "x", None, 7, 8)]) is CheckResult.ILLEGAL


def test_keys_are_checked_independently() -> None:
    ok_x = [put(0, "x", "1", 0, 1), get(1, "x", "1", 2, 3)]
    bad_y = [put(0, "y", "1", 4, 5), put(0, "y", "2", 6, 7), get(1, "y", "1", 8, 9)]
    result, part = check_operations(kv_model(), ok_x + bad_y)
    assert result is CheckResult.ILLEGAL
    assert {op.input.key for op in part} == {"y"}


def test_search_budget_gives_unknown() -> None:
    h = [put(i, "x", str(i), 0, 100) for i in range(12)] + [get(99, "x", "nope", 0, 100)]
    assert check_operations(kv_model(), h, max_steps=50)[0] is CheckResult.UNKNOWN


# ---------------------------------------------------------------------- brute-force reference


def brute_force(history: Sequence[Operation]) -> bool:
    """Try every order: linearizable iff some permutation respects real time and the model."""
    for order in itertools.permutations(range(len(history))):
        pos = {op: k for k, op in enumerate(order)}
        if any(
            history[a].return_time < history[b].call and pos[a] > pos[b]
            for a in range(len(history))
            for b in range(len(history))
        ):
            continue
        state: dict[str, str | None] = {}
        legal = True
        for k in order:
            op = history[k]
            if op.input.op == "put":
                state[op.input.key] = op.input.value
            elif state.get(op.input.key) != op.output:
                legal = False
                break
        if legal:
            return True
    return False


@st.composite
def histories(draw: st.DrawFn) -> list[Operation]:
    n = draw(st.integers(1, 6))
    ops = []
    for i in range(n):
        call = draw(st.integers(0, 20))
        ret = call + draw(st.integers(0, 10))
        key = draw(st.sampled_from(["x", "y"]))
        if draw(st.booleans()):
            pending = draw(st.integers(0, 5)) == 0
            ops.append(put(i, key, str(i), call, math.inf if pending else ret))
        else:
            seen = draw(st.sampled_from([None, *[str(j) for j in range(n)]]))
            ops.append(get(i, key, seen, call, ret))
    return ops


@settings(max_examples=300, deadline=None)
@given(histories())
def test_checker_agrees_with_brute_force(history: list[Operation]) -> None:
    expected = brute_force(history)
    got = verdict(history)
    assert got is (CheckResult.OK if expected else CheckResult.ILLEGAL), history


# ---------------------------------------------------------------------- against the simulated cluster


def run_clients(c: Cluster, seconds: float, clients: int = 5, keys: int = 3) -> list[Operation]:
    """Clients read and write while a nemesis partitions leaders and crashes nodes."""
    rng = random.Random(f"{c.seed}/nemesis")
    history: list[Operation] = []
    key_names = [f"k{k}" for k in range(keys)]
    cs = [KvClient(c, k, key_names, history) for k in range(clients)]
    c.check_one_leader()
    for client in cs:
        client.start()
    crashed: list[int] = []
    end = c.now + seconds * 1000
    while c.now < end:
        c.run_for(rng.uniform(300, 900))
        r = rng.random()
        leaders = c.leaders()
        if r < 0.45 and leaders:
            leader = leaders[max(leaders)][0]
            others = [i for i in c.nodes if i != leader]
            c.partition((leader, *rng.sample(others, rng.randrange(len(c.nodes) // 2))))
        elif r < 0.6 and not crashed:
            victim = rng.choice(sorted(c.nodes))
            c.crash(victim)
            crashed.append(victim)
        else:
            c.heal()
            while crashed:
                c.restart(crashed.pop())
    for client in cs:
        client.stop()
    c.heal()
    while crashed:
        c.restart(crashed.pop())
    c.run_for(2000)
    return history


def check_cluster_history(seed: int, reorder: bool, seconds: float) -> None:
    with Cluster(5, seed, unreliable=True, snapshot_every=20) as c:
        c.long_reordering = reorder
        history = run_clients(c, seconds=seconds, clients=8)
        reads = [op for op in history if op.input.op == "get"]
        writes = [op for op in history if op.input.op == "put" and op.return_time != math.inf]
        # The test means something only if plenty of operations completed.
        assert len(reads) > 100 and len(writes) > 100, (len(reads), len(writes))
        result, part = check_operations(kv_model(), history)
        assert result is CheckResult.OK, f"not linearizable on key {part[0].input.key} (seed={seed})"


@pytest.mark.parametrize(("seed", "reorder"), [(1, False), (2, False), (3, True), (4, True)])
def test_raft_kv_histories_are_linearizable(seed: int, reorder: bool) -> None:
    check_cluster_history(seed, reorder, seconds=30)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_raft_kv_histories_are_linearizable_soak(seed: int) -> None:
    check_cluster_history(seed, reorder=seed % 2 == 1, seconds=120)


@pytest.mark.parametrize("seed", [1, 2])
def test_stale_local_reads_are_caught(seed: int) -> None:
    """A leader serving reads from its own state, with no ReadIndex round, gives
    stale reads once deposed; the checker must say so."""
    with Cluster(5, seed, unreliable=True, check_quorum=False, local_reads=True) as c:
        history = run_clients(c, seconds=15)
        result, _ = check_operations(kv_model(), history)
        assert result is CheckResult.ILLEGAL, f"stale reads went unnoticed (seed={seed})"
