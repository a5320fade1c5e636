"""The tier engine against a plain dict, and its races, on real tiers (memory, LMDB, SeaweedFS)."""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cacheclient.wire import checksum
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.engine.events import ReadFeed
from cachesvc.errors import Abandoned, InvalidKey, TierFull, ValueTooLarge
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.arena import ArenaTier

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY, wait_until
from linearizability import CheckResult, KvInput, Operation, check_operations, kv_model

KEYS = st.sampled_from([f"k{i}".encode() for i in range(6)] + [f"wb/k{i}".encode() for i in range(3)])
VALUES = st.binary(max_size=3000) | st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 40_000), st.integers(0, 255))


def s3_tier(s3: Any, prefix: str, cls: type = S3Tier) -> Any:
    return cls(
        endpoint=s3.endpoint, bucket=s3.bucket, prefix=prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY
    )


class EngineVsDict(RuleBasedStateMachine):
    """Random puts, gets, deletes and evictions; the engine must agree with a dict.

    Without object storage a get may miss, but only for a key that budget
    pressure could have pushed out; with object storage it may never miss.
    Either way a get never returns a value that is not the key's last put.
    """

    tmp_root: Path
    s3: Any = None

    @initialize()
    def setup(self) -> None:
        # A directory and an object prefix of their own: names built from id(self) were reused by a later
        # example once the earlier machine was freed, and its L2 (and then its S3 prefix, in a CI run)
        # opened holding that machine's values.
        path = Path(tempfile.mkdtemp(prefix="run", dir=self.tmp_root))
        self.l1 = MemoryTier(48 << 10)
        self.l2 = LMDBTier(path, 1 << 20)
        self.l3 = s3_tier(self.s3, f"prop/{uuid.uuid4().hex}/") if self.s3 is not None else None
        namespaces = [Namespace(b"wb/", WriteMode.WRITE_BACK)] if self.l3 is not None else []
        self.engine = Engine(
            l1=self.l1, l2=self.l2, l3=self.l3, policy_factory=lambda _: LRUPolicy(), namespaces=namespaces
        )
        self.model: dict[bytes, bytes] = {}
        self.pressured: set[bytes] = set()

    def _note_pressure(self) -> None:
        live = sum(self.l1.cost(k, len(v)) for k, v in self.model.items())
        if live > self.l1.capacity_bytes:
            self.pressured |= set(self.model)

    @rule(key=KEYS, value=VALUES)
    def put(self, key: bytes, value: bytes) -> None:
        self.engine.put(key, value, checksum(value))
        self.model[key] = value
        self.pressured.discard(key)
        self._note_pressure()

    @rule(key=KEYS)
    def get(self, key: bytes) -> None:
        hit = self.engine.get(key)
        if hit is None:
            assert key not in self.model or (self.l3 is None and key in self.pressured), f"unexplained miss of {key!r}"
        else:
            assert key in self.model, f"{key!r} was deleted or never put, yet the engine returned a value"
            assert hit.value == self.model[key], f"stale or wrong value for {key!r} from {hit.tier}"
            assert hit.checksum == checksum(hit.value)

    @rule(keys=st.lists(KEYS, max_size=6))
    def get_many(self, keys: list[bytes]) -> None:
        for key, hit in zip(keys, self.engine.get_many(keys), strict=True):
            if hit is not None:
                assert hit.value == self.model.get(key)
            else:
                assert key not in self.model or (self.l3 is None and key in self.pressured)

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        self.engine.delete(key)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def evict(self, key: bytes) -> None:
        self.engine.evict(key)
        if self.l3 is None:
            self.pressured.add(key)

    @invariant()
    def budgets_hold(self) -> None:
        if hasattr(self, "engine"):
            assert self.l1.used_bytes <= self.l1.capacity_bytes
            assert self.l2.used_bytes <= self.l2.capacity_bytes

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close(flush_timeout=10)


def test_engine_matches_dict_without_object_storage(tmp_path: Path) -> None:
    class Machine(EngineVsDict):
        tmp_root = tmp_path

    Machine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
    )
    Machine.TestCase().runTest()


def test_engine_matches_dict_with_s3_and_write_back(tmp_path: Path, s3: Any) -> None:
    class Machine(EngineVsDict):
        tmp_root = tmp_path

    Machine.s3 = s3
    Machine.TestCase.settings = settings(
        max_examples=12, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    Machine.TestCase().runTest()


class GatedS3(S3Tier):
    """The real S3 tier, with a gate after each fetch so a test can line up a race."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetches = 0
        self.fetched = threading.Event()
        self.gate = threading.Event()

    def get(self, key: bytes) -> Any:
        self.fetches += 1
        entry = super().get(key)
        self.fetched.set()
        assert self.gate.wait(20)
        return entry


def _engine(l3: Any, reads: ReadFeed | None = None) -> Engine:
    return Engine(l1=MemoryTier(8 << 20), l2=None, l3=l3, policy_factory=lambda _: LRUPolicy(), reads=reads)


def test_concurrent_misses_cause_one_fetch(s3: Any, s3_prefix: str) -> None:
    l3 = s3_tier(s3, s3_prefix, GatedS3)
    value = os.urandom(100_000)
    S3Tier.put(l3, b"hot", value, checksum(value))
    engine = _engine(l3)
    results: list[Any] = []
    readers = [threading.Thread(target=lambda: results.append(engine.get(b"hot"))) for _ in range(8)]
    for reader in readers:
        reader.start()
    assert l3.fetched.wait(20)
    l3.gate.set()
    for reader in readers:
        reader.join(20)
    assert [r.value for r in results] == [value] * 8
    assert l3.fetches == 1
    assert engine.get(b"hot").tier == "l1"
    engine.close()


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "memory-and-disk"])
@pytest.mark.parametrize("write", ["delete", "put"])
def test_write_racing_a_fill_is_never_undone(
    s3: Any, s3_prefix: str, write: str, on_disk: bool, tmp_path: Path
) -> None:
    l3 = s3_tier(s3, s3_prefix, GatedS3)
    S3Tier.put(l3, b"key", b"old", checksum(b"old"))
    l2 = LMDBTier(tmp_path / "l2", 4 << 20) if on_disk else None
    engine = Engine(l1=MemoryTier(8 << 20), l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy())
    reader = threading.Thread(target=engine.get, args=(b"key",))
    reader.start()
    assert l3.fetched.wait(20)  # the fill has read "old" from S3 and not installed it yet
    # The fill is parked inside its S3 read (the gate only holds reads), so the
    # write below lands while the fill still holds "old" and has not installed it.
    if write == "delete":
        engine.delete(b"key")
    else:
        engine.put(b"key", b"new")
    assert reader.is_alive(), "the fill finished before the write: nothing raced"
    l3.gate.set()
    reader.join(20)
    expected = None if write == "delete" else b"new"
    hit = engine.get(b"key")
    assert (hit.value if hit else None) == expected
    assert engine.contains(b"key", cached_only=True) == (None if write == "delete" else "l1")
    if l2 is not None:  # the fill's disk copy was kept out too
        on_l2 = l2.get(b"key")
        assert on_l2 is None or on_l2.value == expected
    engine.close()


class GatedLMDB(LMDBTier):
    """The real LMDB tier; once `armed` ("get" or "put"), its next read or write of a key parks after it is
    done, so a test can line up a race."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = ""
        self.read = threading.Event()
        self.gate = threading.Event()

    park_seconds = 20.0

    def _park(self, call: str) -> None:
        if self.armed == call:
            self.armed = ""
            self.read.set()
            assert self.gate.wait(self.park_seconds)

    def get(self, key: bytes) -> Any:
        entry = super().get(key)
        self._park("get")
        return entry

    def put(self, key: bytes, value: bytes, checksum: int, **kwargs: Any) -> None:
        super().put(key, value, checksum, **kwargs)
        self._park("put")


@pytest.mark.parametrize("write", ["delete", "put"])
def test_disk_reads_run_outside_the_engine_lock_and_never_undo_a_write(tmp_path: Path, write: str) -> None:
    """A read of L2 in flight does not hold up a write of its key, and the copy it read is not promoted after it."""
    l2 = GatedLMDB(tmp_path / "l2", 4 << 20)
    engine = Engine(l1=MemoryTier(64 << 10), l2=l2, l3=None, policy_factory=lambda _: LRUPolicy())
    try:
        engine.put(b"key", b"old" * 3000)
        for i in range(8):  # push it out of L1 into L2
            engine.put(f"other/{i}".encode(), os.urandom(10_000))
        assert engine.contains(b"key") == "l2"
        l2.armed = "get"
        answers: list[Any] = []
        reader = threading.Thread(target=lambda: answers.append(engine.get(b"key")))
        reader.start()
        assert l2.read.wait(20)  # the reader has the old bytes and is parked outside the lock
        writer = threading.Thread(
            target=(lambda: engine.delete(b"key")) if write == "delete" else (lambda: engine.put(b"key", b"new"))
        )
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "the write waited for a disk read"
        l2.gate.set()
        reader.join(20)
        assert answers[0] is not None and answers[0].value == b"old" * 3000  # the read overlapped the write
        hit = engine.get(b"key")
        assert (hit.value if hit else None) == (None if write == "delete" else b"new")
        assert engine.contains(b"key", cached_only=True) == (None if write == "delete" else "l1")
    finally:
        l2.gate.set()
        engine.close()


@pytest.mark.parametrize("write", ["delete", "put"])
def test_a_fill_is_answered_before_its_l2_write_and_a_write_meanwhile_keeps_it_out(
    s3: Any, s3_prefix: str, tmp_path: Path, write: str
) -> None:
    """A cold read's L2 write waits behind the read (`l2.fill_behind_bytes`): the reader has its value while
    the disk is busy; a write of the key before that L2 write runs keeps the filled copy out of L2 for good,
    so once L1 lets the key go its next read is the write's, not the fill's."""
    l3 = s3_tier(s3, s3_prefix)
    for key in (b"first", b"key"):
        S3Tier.put(l3, key, b"old " + key * 3000, checksum(b"old " + key * 3000))
    l2 = gated = GatedLMDB(tmp_path / "l2", 4 << 20)
    engine = Engine(l1=MemoryTier(64 << 10), l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy())
    try:
        gated.armed = "put"  # the first L2 write (the fill of b"first") parks: the disk is busy
        answers: list[Any] = []
        reader = threading.Thread(target=lambda: answers.extend([engine.get(b"first"), engine.get(b"key")]))
        reader.start()
        assert gated.read.wait(20)
        reader.join(10)
        assert not reader.is_alive(), "a cold read waited for its L2 write"
        assert [a.value for a in answers] == [b"old " + b"first" * 3000, b"old " + b"key" * 3000]
        # The fill of b"key" waits to be written to L2; the write lands first.
        if write == "delete":
            engine.delete(b"key")
        else:
            engine.put(b"key", b"new")
        gated.gate.set()
        wait_until(lambda: gated.contains(b"first"), 10.0, "the parked L2 write done")
        wait_until(lambda: engine.stats()["counters"]["l2_fills_behind"] == 2, 10.0, "both fills' L2 writes done")
        assert engine.stats()["counters"]["l2_fills_behind_bytes"] == 0
        engine.close()
        l2 = LMDBTier(tmp_path / "l2", 4 << 20)
        on_l2 = l2.get(b"key")
        # A clean close demotes L1 into L2: the put's value, or nothing after the delete; never the fill's.
        assert (on_l2.value if on_l2 else None) == (None if write == "delete" else b"new")
    finally:
        gated.gate.set()
        engine.close()
        l2.close()


class FullLMDB(GatedLMDB):
    """A `GatedLMDB` whose writes fail, as a full disk's would, while `full` is set."""

    full = False
    park_seconds = 300.0  # the test's S3 calls on a loaded machine outlasted 20 s

    def put(self, key: bytes, value: bytes, checksum: int, **kwargs: Any) -> None:
        if self.full:
            raise TierFull(f"{self.name}: the disk is full (this test)")
        super().put(key, value, checksum, **kwargs)


def test_a_fill_whose_l2_write_waits_is_not_joined_after_the_key_moved(s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    """A fill stays in the fills table until its L2 write (behind the read) is done, so a reader that misses
    can join it. After a move (`unvouch_cached`: while the key was elsewhere, others wrote it), a reader must
    not: when L1 dropped the value without demoting it (the disk refused it), the reader got the fill's older
    value, which no check a move calls for had seen."""
    l3 = s3_tier(s3, s3_prefix)
    old, new = b"old " + b"key" * 3000, b"new " + b"key" * 3000
    S3Tier.put(l3, b"first", b"first" * 3000, checksum(b"first" * 3000))
    S3Tier.put(l3, b"key", old, checksum(old))
    l2 = FullLMDB(tmp_path / "l2", 4 << 20)
    engine = Engine(l1=MemoryTier(64 << 10), l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy())
    try:
        l2.armed = "put"  # the first L2 write (the fill of b"first") parks: the disk is busy
        assert engine.get(b"first").value == b"first" * 3000
        assert l2.read.wait(20)
        assert engine.get(b"key").value == old  # in L1; its L2 write waits behind the parked one
        engine.unvouch_cached()  # the key's slot moved away and back (a drain and its cancel)
        S3Tier.put(l3, b"key", new, checksum(new))  # meanwhile the node that held it took a write
        l2.full = True  # and this node's disk fills: L1 drops what it evicts
        # Keys off the stripe the parked write holds (a put of one on it would wait for that write).
        others = [k for k in (b"other/%d" % i for i in range(200)) if engine._locks(k) is not engine._locks(b"first")]
        for other in others[:8]:
            engine.put(other, os.urandom(10_000))
        assert engine.contains(b"key", cached_only=True) is None
        assert engine.stats()["counters"]["l2_fills_behind"] == 0, "the parked L2 write went on: nothing waits"
        hit = engine.get(b"key")
        assert hit is not None and hit.value == new
    finally:
        l2.full = False
        l2.gate.set()
        engine.close()


def _filled_engine(
    s3: Any,
    s3_prefix: str,
    tmp_path: Path,
    l1_bytes: int,
    idle: float,
    n: int,
    size: int,
    shared: bool = True,
    vouch_listings: int = 4,
) -> Any:
    """An engine with `l2.fill_idle_seconds` of `idle`, L1 shared with co-located readers (`shared`), over
    object storage holding `n` values of `size`."""
    l3 = s3_tier(s3, s3_prefix)
    for i in range(n):
        value = bytes([i]) * size
        S3Tier.put(l3, b"k%d" % i, value, checksum(value))
    l2 = LMDBTier(tmp_path / "l2", 8 << 20)
    l1 = ArenaTier(l1_bytes) if shared else MemoryTier(l1_bytes)
    engine = Engine(
        l1=l1, l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy(), fill_idle_seconds=idle, vouch_listings=vouch_listings
    )
    return engine, l2


def test_fills_while_a_shared_l1_has_room_reach_l2_once_nothing_was_read_for_fill_idle_seconds(
    s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    """A cold pass over data that fits in half of a shared L1, and a warm pass after it, write no L2 copy
    while they run (each fill and each read restarts the wait); once nothing was read for
    `fill_idle_seconds`, every value is copied from L1 into L2, bit for bit, with the version it was filled
    at, so a restarted server keeps what was read."""
    engine, l2 = _filled_engine(s3, s3_prefix, tmp_path, 1 << 20, idle=3.0, n=5, size=20_000)
    try:
        for i in [*range(5), *range(5), 0, 1, 2]:  # fills, then hits (to 6.5 s), every 0.5 s: never 3 s without one
            assert engine.get(b"k%d" % i).value == bytes([i]) * 20_000
            time.sleep(0.5)
        on_l2 = [i for i in range(5) if l2.contains(b"k%d" % i)]
        assert on_l2 == [], f"L2 copies written while reads kept coming: {on_l2}"
        assert engine.stats()["counters"]["l2_fills_deferred"] == 5
        wait_until(lambda: engine.stats()["counters"].get("l2_fills_later", 0) == 5, 20.0, "the 5 deferred L2 copies")
        assert engine.stats()["counters"]["l2_fills_deferred"] == 0
        for i in range(5):
            entry = l2.get(b"k%d" % i)
            assert entry is not None and entry.value == bytes([i]) * 20_000
            assert entry.version == engine._state.version(b"k%d" % i), entry.version
    finally:
        engine.close()


def test_fills_past_half_of_l1_go_to_l2_at_once_and_take_the_waiting_ones_with_them(
    s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    """Once a fill takes L1 past half full, its L2 copy is written behind the read at once, and so are the
    copies waiting for quiet, so the values L1 evicts next are on disk already (nothing to demote under the
    engine lock)."""
    engine, l2 = _filled_engine(s3, s3_prefix, tmp_path, 100_000, idle=120.0, n=3, size=20_000)
    try:
        engine.get(b"k0"), engine.get(b"k1")  # 40% of L1: both wait
        assert engine.stats()["counters"]["l2_fills_deferred"] == 2
        assert engine.get(b"k2").value == b"\x02" * 20_000  # 60%
        wait_until(lambda: all(l2.contains(b"k%d" % i) for i in range(3)), 20.0, "all three on L2 (not 120 s)")
        counters = engine.stats()["counters"]
        assert counters.get("l2_fills_later") == 2 and counters["l2_fills_deferred"] == 0, counters
    finally:
        engine.close()


def test_fills_into_a_private_l1_go_to_l2_behind_the_read_at_once(s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    """Without a shared L1, co-located clients read L2's file directly: a fill's L2 copy does not wait."""
    engine, l2 = _filled_engine(s3, s3_prefix, tmp_path, 1 << 20, idle=120.0, n=2, size=20_000, shared=False)
    try:
        engine.get(b"k0"), engine.get(b"k1")
        wait_until(lambda: l2.contains(b"k0") and l2.contains(b"k1"), 20.0, "both on L2 (not 120 s)")
        assert engine.stats()["counters"].get("l2_fills_deferred", 0) == 0
    finally:
        engine.close()


@pytest.mark.parametrize("write", ["delete", "put", "move"])
def test_a_deferred_l2_copy_never_brings_back_a_value_written_over(
    s3: Any, s3_prefix: str, tmp_path: Path, write: str
) -> None:
    """A key written (or deleted) after its fill's L2 copy was deferred: the copy, when its time comes, writes
    nothing of the filled value; L2 ends with the write's value, or nothing. Nor after a move (the node's
    copies unvouched: others may have written the key meanwhile; checked at its first read here, since the
    bulk check from listings would vouch for it again first, and a copy vouched for may go to L2)."""
    engine, l2 = _filled_engine(s3, s3_prefix, tmp_path, 1 << 20, idle=0.5, n=1, size=20_000, vouch_listings=0)
    try:
        assert engine.get(b"k0").value == b"\x00" * 20_000
        assert engine.stats()["counters"]["l2_fills_deferred"] == 1
        if write == "delete":
            engine.delete(b"k0")
        elif write == "put":
            engine.put(b"k0", b"new")
        else:
            engine.unvouch_cached()
        wait_until(lambda: engine.stats()["counters"]["l2_fills_deferred"] == 0, 20.0, "the deferred copy's turn")
        assert engine.stats()["counters"].get("l2_fills_later", 0) == 0
        on_l2 = l2.get(b"k0")
        assert (on_l2.value if on_l2 else None) in ((None, b"new") if write == "put" else (None,))
    finally:
        engine.close()


@pytest.mark.parametrize("with_l2", [False, True], ids=["l1", "l1-and-l2"])
def test_stats_report_the_gauges_the_metrics_export(tmp_path: Path, with_l2: bool) -> None:
    l2 = LMDBTier(tmp_path / "l2", 4 << 20) if with_l2 else None
    engine = Engine(l1=MemoryTier(1 << 20), l2=l2, l3=None, policy_factory=lambda _: LRUPolicy())
    try:
        engine.put(b"k", b"v")
        counters = engine.stats()["counters"]
        for gauge in ("pinned_keys", "ttl_keys", "fills_in_flight", "dirty_keys"):
            assert counters[gauge] == 0, gauge
    finally:
        engine.close()


def test_bad_requests_are_typed_errors(tmp_path: Path) -> None:
    engine = Engine(l1=MemoryTier(1 << 20), l2=None, l3=None, policy_factory=lambda _: LRUPolicy(), max_value_bytes=100)
    with pytest.raises(InvalidKey):
        engine.get(b"")
    with pytest.raises(InvalidKey):
        engine.put(b"x" * 1025, b"v")
    with pytest.raises(ValueTooLarge, match="max_value_bytes=100"):
        engine.put(b"k", b"v" * 101)
    engine.put(b"k", b"v" * 100)
    assert engine.get(b"k").value == b"v" * 100


def test_l1_victims_demote_to_l2_and_promote_back(tmp_path: Path) -> None:
    l1, l2 = MemoryTier(64 << 10), LMDBTier(tmp_path / "l2", 4 << 20)
    engine = Engine(l1=l1, l2=l2, l3=None, policy_factory=lambda _: LRUPolicy())
    values = {f"k{i}".encode(): os.urandom(10_000) for i in range(20)}
    for key, value in values.items():
        engine.put(key, value)
    assert engine.counters["demotions"] > 0 and l1.used_bytes <= l1.capacity_bytes
    first = engine.get(b"k0")
    assert first.tier == "l2" and first.value == values[b"k0"]
    assert engine.get(b"k0").tier == "l1"  # promoted by the previous hit
    engine.close()


def test_write_back_is_flushed_on_clean_close(tmp_path: Path, s3: Any, s3_prefix: str) -> None:
    l3 = s3_tier(s3, s3_prefix)
    engine = Engine(
        l1=MemoryTier(1 << 20),
        l2=LMDBTier(tmp_path / "l2", 4 << 20),
        l3=l3,
        policy_factory=lambda _: LRUPolicy(),
        namespaces=[Namespace(b"kv/", WriteMode.WRITE_BACK)],
    )
    values = {f"kv/{i}".encode(): os.urandom(5000) for i in range(50)}
    for key, value in values.items():
        engine.put(key, value)
    engine.close(flush_timeout=60)
    reader = s3_tier(s3, s3_prefix)
    for key, value in values.items():
        assert reader.get(key).value == value
    reader.close()


class HeldS3(S3Tier):
    """The real S3 tier, whose fetch of one chosen key waits on a gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = b""
        self.gate = threading.Event()

    def get(self, key: bytes) -> Any:
        entry = super().get(key)
        if key == self.held:
            assert self.gate.wait(20)
        return entry


def test_iter_many_sends_values_in_order_while_later_fills_are_in_flight(s3: Any, s3_prefix: str) -> None:
    l3 = s3_tier(s3, s3_prefix, HeldS3)
    values = {f"p/{i:02d}".encode(): os.urandom(1000 + i) for i in range(12)}
    for key, value in values.items():
        S3Tier.put(l3, key, value, checksum(value))
    reads = ReadFeed()
    published: list[bytes] = []
    reads.subscribe(published.extend)
    engine = _engine(l3, reads)
    try:
        cached = list(values)[1]
        engine.put(cached, values[cached])
        keys = [*values, b"p/absent"]
        l3.held = keys[6]
        stream = engine.iter_many(keys)
        # The first six arrive while the seventh's fill is held: the answer is pipelined with the fills.
        first = [next(stream) for _ in range(6)]
        assert [h.value if h else None for h in first] == [values[k] for k in keys[:6]]
        assert first[1] is not None and first[1].tier == "l1" and first[0] is not None and first[0].tier == "l3"
        assert published == []
        l3.gate.set()
        rest = [next(stream) for _ in keys[6:]]
        assert [h.value if h else None for h in rest] == [values.get(k) for k in keys[6:]]
        # The demand reads reach the prefetch plans once the last hit is out, whether or not the caller
        # asks for more (a server's reader stops at the last key).
        assert published == keys
        assert next(stream, None) is None and published == keys
        # A caller that stops early publishes the reads it was given.
        published.clear()
        early = engine.iter_many(keys[:4])
        next(early), next(early)
        early.close()
        assert published == keys[:2]
        # The same answers as one get per key, now that every value is cached.
        assert [h.value if h else None for h in engine.get_many(keys)] == [values.get(k) for k in keys]
    finally:
        l3.gate.set()
        engine.close()


def test_iter_many_stops_waiting_and_starting_fills_once_its_caller_left(s3: Any, s3_prefix: str) -> None:
    """Reads whose `stop` is done (their RPC was cancelled or expired) stop waiting at once: `Abandoned`, the
    fills not yet started are cancelled, and those already fetching finish and are cached. A single miss too."""
    l3 = s3_tier(s3, s3_prefix, GatedS3)
    values = {f"s/{i}".encode(): os.urandom(100) for i in range(6)}
    for key, value in values.items():
        S3Tier.put(l3, key, value, checksum(value))
    engine = Engine(l1=MemoryTier(8 << 20), l2=None, l3=l3, policy_factory=lambda _: LRUPolicy(), request_fills=2)
    keys = list(values)
    try:
        for wanted, fetching in ((keys[:5], 2), (keys[5:], 1)):
            l3.gate.clear()
            l3.fetched.clear()
            before = l3.fetches
            stop: Future[None] = Future()
            reads = engine.iter_many(wanted, stop=stop)
            outcome: list[tuple[BaseException, float]] = []

            def read(reads: Any = reads, outcome: list[tuple[BaseException, float]] = outcome) -> None:
                try:
                    next(reads)
                except Abandoned as exc:
                    outcome.append((exc, time.perf_counter()))

            reader = threading.Thread(target=read)
            reader.start()
            assert l3.fetched.wait(10)
            stop.set_result(None)
            left = time.perf_counter()
            reader.join(5)
            assert outcome, "the read did not end when its caller left"
            assert outcome[0][1] - left < 0.1
            l3.gate.set()
            wait_until(lambda: engine.stats()["counters"]["fills_in_flight"] == 0, 10, "the fills in flight")
            assert l3.fetches - before == fetching  # none started after the caller left
            assert engine.get_cached(wanted[0]) is not None  # what was fetched is cached
    finally:
        l3.gate.set()
        engine.close()


def test_a_fill_writes_local_disk_outside_the_engine_lock(s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    """While a filled value is written to L2, hits and writes of other keys go on; then L2 holds it."""
    l3 = s3_tier(s3, s3_prefix)
    l3.put(b"cold", b"from S3", checksum(b"from S3"))
    l2 = GatedLMDB(tmp_path / "l2", 4 << 20)
    engine = Engine(l1=MemoryTier(1 << 20), l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy())
    try:
        engine.put(b"hot", b"in memory")
        l2.armed = "put"
        answers: list[Any] = []
        reader = threading.Thread(target=lambda: answers.append(engine.get(b"cold")))
        reader.start()
        assert l2.read.wait(20)  # the fill is parked after its L2 write
        hit = engine.get(b"hot")
        assert hit is not None and hit.value == b"in memory"
        engine.put(b"other", b"written meanwhile")
        assert engine.get(b"cold") is not None  # L1 has it already; the fill's readers need not wait
        l2.gate.set()
        reader.join(20)
        assert answers[0] is not None and answers[0].value == b"from S3"
        on_disk = l2.get(b"cold")
        assert on_disk is not None and on_disk.value == b"from S3"
    finally:
        l2.gate.set()
        engine.close()


def test_concurrent_reads_and_writes_through_small_tiers_are_linearizable(
    s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    """Threads put, delete and get 40 keys through tiers far smaller than the keys' values, so reads race
    evictions, demotions, promotions, disk reads outside the engine lock and fills; the history, checked per
    key (a delete is a write of "no value"), is linearizable."""
    engine = Engine(
        l1=MemoryTier(96 << 10),
        l2=LMDBTier(tmp_path / "l2", 1 << 20),
        l3=s3_tier(s3, s3_prefix),
        policy_factory=lambda _: LRUPolicy(),
        namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
    )
    keys = [f"k{i}".encode() for i in range(32)] + [f"wb/k{i}".encode() for i in range(8)]
    history: list[Operation] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        rng = random.Random(n)
        for i in range(80):
            key = rng.choice(keys)
            roll = rng.random()
            call = time.monotonic()
            if roll < 0.3:
                tag = f"{n}-{i}"
                engine.put(key, tag.encode().ljust(30_000, b"."))
                op = KvInput("put", key.decode(), tag)
                output = None
            elif roll < 0.4:
                engine.delete(key)
                op, output = KvInput("put", key.decode(), None), None
            else:
                hit = engine.get(key)
                op = KvInput("get", key.decode())
                output = hit.value.rstrip(b".").decode() if hit is not None else None
            with lock:
                history.append(Operation(n, op, call, output, time.monotonic()))

    try:
        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(history) == 4 * 80
        counters = engine.stats()["counters"]
        assert counters.get("evictions_l2", 0) > 0 and counters.get("promotions", 0) > 0, counters
        result, bad = check_operations(kv_model(), history)
        assert result is CheckResult.OK, sorted(bad, key=lambda op: op.call)
    finally:
        engine.close()
