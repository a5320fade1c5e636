"""The engine under the faults a review found: S3 errors during write-back, slow uploads,
full and pinned tiers, TTLs across restarts, clean stops, and greedy requests.

Each test names the defect it guards against; each failed on the engine before
the split (the closing note of issue 9 lists them).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from cacheclient.wire import checksum
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.errors import InvalidKey
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.memory import ENTRY_OVERHEAD

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from latency_proxy import LatencyProxy


def tier(endpoint: str, bucket: str, prefix: str) -> S3Tier:
    return S3Tier(endpoint=endpoint, bucket=bucket, prefix=prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY)


def lru(_: str) -> LRUPolicy:
    return LRUPolicy()


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_write_back_survives_a_missing_bucket_and_uploads_once_it_exists(
    tmp_path: Path, s3: Any, s3_prefix: str
) -> None:
    """An S3 error other than "unreachable" used to end the flusher thread for good.

    The bucket is restored by pointing the tier at one that exists (this
    SeaweedFS cannot grow volumes for a second bucket), as an operator would
    fix a bucket policy; the errors before that are the real server's.
    """
    l3 = tier(s3.endpoint, f"gone-{uuid.uuid4().hex[:10]}", s3_prefix)  # every upload is refused (403)
    engine = Engine(
        l1=MemoryTier(4 << 20),
        l2=LMDBTier(tmp_path / "l2", 8 << 20),
        l3=l3,
        policy_factory=lru,
        namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
    )
    values = {f"wb/{i}".encode(): os.urandom(3000) for i in range(20)}
    for key, value in list(values.items())[:10]:
        engine.put(key, value)
    wait_until(lambda: engine.stats()["counters"].get("writeback_errors", 0) >= 2, 20, "failed uploads")
    for key, value in list(values.items())[10:]:
        engine.put(key, value)  # the flusher is still alive and the queue still takes puts
    assert all(engine.get(key).value == value for key, value in values.items())
    l3.bucket = s3.bucket
    wait_until(lambda: engine.stats()["counters"]["dirty_keys"] == 0, 30, "every write-back value uploaded")
    reader = tier(s3.endpoint, s3.bucket, s3_prefix)
    for key, value in values.items():
        assert reader.get(key).value == value
    assert engine.stats()["counters"]["writebacks"] >= 20
    engine.close()
    reader.close()


def test_resident_gets_stay_fast_while_dirty_values_are_uploaded(s3: Any, s3_prefix: str) -> None:
    """A dirty victim used to be uploaded under the engine lock: every get waited for S3."""
    proxy = LatencyProxy(s3.endpoint.removeprefix("http://"), delay=0.4).start()
    try:
        slot = 2000 + 8 + ENTRY_OVERHEAD
        engine = Engine(
            l1=MemoryTier(12 * slot),
            l2=None,
            l3=tier(proxy.endpoint, s3.bucket, s3_prefix),
            policy_factory=lru,
            namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
        )
        engine.put(b"resident", b"r" * 2000, lease=600)  # pinned: always a cache hit
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                engine.put(b"wb/%05d" % i, os.urandom(2000))
                i += 1

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            wait_until(lambda: engine.stats()["counters"].get("writebacks", 0) >= 2, 30, "uploads under way")
            worst = 0.0
            for _ in range(40):
                started = time.monotonic()
                hit = engine.get(b"resident")
                worst = max(worst, time.monotonic() - started)
                assert hit is not None and hit.tier == "l1"
                time.sleep(0.02)
        finally:
            stop.set()
            thread.join(60)
        assert worst < 0.2, f"a cached read waited {worst:.3f}s behind a 0.4 s upload"
        engine.close(flush_timeout=120)
    finally:
        proxy.stop()


def test_a_delete_racing_write_back_leaves_nothing_in_s3(s3: Any, s3_prefix: str) -> None:
    """Puts evicting dirty victims while those victims are deleted: no deleted key may reappear in S3."""
    slot = 1000 + 10 + ENTRY_OVERHEAD
    l3 = tier(s3.endpoint, s3.bucket, s3_prefix)
    engine = Engine(
        l1=MemoryTier(6 * slot),
        l2=None,
        l3=l3,
        policy_factory=lru,
        namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
    )
    deleted: list[bytes] = []

    def churn(worker: int) -> None:
        for i in range(30):
            key = b"wb/%d-%03d" % (worker, i)
            engine.put(key, os.urandom(1000))
            if i % 2 == 0:
                engine.delete(key)
                deleted.append(key)

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    engine.close(flush_timeout=60)
    resurrected = [key for key in deleted if l3.contains(key)]
    assert not resurrected, f"deleted keys back in S3: {resurrected[:5]}"
    kept = [b"wb/%d-%03d" % (w, i) for w in range(3) for i in range(1, 30, 2)]
    assert all(l3.contains(key) for key in kept)


def test_a_full_pinned_l1_falls_through_to_l2(tmp_path: Path) -> None:
    slot = 1000 + 2 + ENTRY_OVERHEAD
    engine = Engine(l1=MemoryTier(3 * slot), l2=LMDBTier(tmp_path / "l2", 4 << 20), l3=None, policy_factory=lru)
    for i in range(3):
        engine.put(b"p%d" % i, b"P" * 1000, lease=60)
    engine.put(b"new", b"N" * 1000)  # L1 holds only leased values: used to raise TierFull
    hit = engine.get(b"new")
    assert hit is not None and hit.tier == "l2" and hit.value == b"N" * 1000
    assert all(engine.get(b"p%d" % i).tier == "l1" for i in range(3))
    engine.close()


def test_a_fill_that_cannot_be_cached_still_answers_every_waiting_reader(s3: Any, s3_prefix: str) -> None:
    """The fill leader raised after the S3 read and never resolved the fill: joiners hung for io_timeout."""
    l3 = tier(s3.endpoint, s3.bucket, s3_prefix)
    value = os.urandom(1000)
    l3.put(b"cold", value, checksum(value))
    slot = 1000 + 2 + ENTRY_OVERHEAD
    engine = Engine(l1=MemoryTier(2 * slot), l2=None, l3=l3, policy_factory=lru, io_timeout=30)
    for i in range(2):
        engine.put(b"p%d" % i, b"P" * 1000, lease=60)
    results: list[Any] = []
    readers = [threading.Thread(target=lambda: results.append(engine.get(b"cold"))) for _ in range(4)]
    started = time.monotonic()
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(20)
    assert [r.value for r in results] == [value] * 4
    assert time.monotonic() - started < 10
    engine.close()


@pytest.mark.parametrize("lease", [float("inf"), float("nan"), -1.0, 3601.0])
def test_lease_lengths_are_bounded(lease: float) -> None:
    engine = Engine(l1=MemoryTier(1 << 20), l2=None, l3=None, policy_factory=lru, max_lease_seconds=3600)
    with pytest.raises(InvalidKey, match="lease_seconds"):
        engine.put(b"k", b"v", lease=lease)
    with pytest.raises(InvalidKey, match="lease_seconds"):
        engine.put_many([(b"k", b"v", None)], lease=lease)
    assert engine.get(b"k") is None
    engine.close()


def test_an_expired_dirty_value_is_uploaded_not_lost(s3: Any, s3_prefix: str) -> None:
    """Expiry used to drop a dirty copy before its upload: an acknowledged write-back lost."""
    l3 = tier(s3.endpoint, f"gone-{uuid.uuid4().hex[:10]}", s3_prefix)
    clock = Clock()
    engine = Engine(
        l1=MemoryTier(1 << 20),
        l2=None,
        l3=l3,
        policy_factory=lru,
        namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
        clock=clock,
    )
    engine.put(b"wb/a", b"acknowledged", ttl=10)
    wait_until(lambda: engine.stats()["counters"].get("writeback_errors", 0) >= 1, 20, "a failed upload")
    clock.now += 11
    assert engine.get(b"wb/a") is None  # expired: never served, even while it awaits upload
    l3.bucket = s3.bucket
    wait_until(lambda: engine.stats()["counters"]["dirty_keys"] == 0, 30, "the upload")
    reader = tier(s3.endpoint, s3.bucket, s3_prefix)
    assert reader.get(b"wb/a").value == b"acknowledged"
    assert engine.contains(b"wb/a", cached_only=True) is None  # dropped from the cache once uploaded
    engine.close()
    reader.close()


def test_ttls_survive_a_restart(tmp_path: Path) -> None:
    """TTLs were not persisted: after a restart, TTL'd values in L2 never expired."""
    wall = Clock(1_700_000_000.0)

    def open_engine() -> Engine:
        return Engine(
            l1=None, l2=LMDBTier(tmp_path / "l2", 4 << 20), l3=None, policy_factory=lru, wall_clock=wall, clock=Clock()
        )

    engine = open_engine()
    engine.put(b"short", b"s", ttl=60)
    engine.put(b"long", b"l", ttl=3600)
    engine.put(b"forever", b"f")
    engine.close()
    wall.now += 120
    engine = open_engine()
    assert engine.get(b"short") is None
    assert engine.get(b"long").value == b"l"
    assert engine.get(b"forever").value == b"f"
    engine.close()


def test_ttl_records_of_evicted_keys_do_not_accumulate() -> None:
    slot = 100 + 6 + ENTRY_OVERHEAD
    engine = Engine(l1=MemoryTier(10 * slot), l2=None, l3=None, policy_factory=lru)
    for i in range(2000):
        engine.put(b"k%05d" % i, b"v" * 100, ttl=3600)
    counters = engine.stats()["counters"]
    assert counters["ttl_keys"] <= 10, f"{counters['ttl_keys']} TTL records for 10 resident keys"
    engine.close()


@pytest.mark.parametrize("namespaces", [(), (Namespace(b"", WriteMode.CACHE_ONLY),)], ids=["no-s3", "cache-only"])
def test_a_clean_stop_keeps_the_warm_set_in_l2(tmp_path: Path, namespaces: Any) -> None:
    """On close, L1 used to be dropped: a restart of a cache without S3 lost every value it held."""

    def open_engine() -> Engine:
        return Engine(
            l1=MemoryTier(4 << 20),
            l2=LMDBTier(tmp_path / "l2", 16 << 20),
            l3=None,
            policy_factory=lru,
            namespaces=namespaces,
        )

    engine = open_engine()
    values = {f"kv/{i}".encode(): os.urandom(4000) for i in range(200)}
    for key, value in values.items():
        engine.put(key, value)
    engine.close()
    engine = open_engine()
    for key, value in values.items():
        hit = engine.get(key)
        assert hit is not None and hit.value == value, f"{key!r} lost across a clean stop"
    engine.close()


def test_one_request_cannot_take_the_whole_fill_pool(s3: Any, s3_prefix: str) -> None:
    """A get_many of many misses queued every fill ahead of other requests' misses."""
    l3 = tier(s3.endpoint, s3.bucket, s3_prefix)
    for i in range(64):
        l3.put(b"bulk%02d" % i, b"b", checksum(b"b"))
    l3.put(b"other1", b"o", checksum(b"o"))
    l3.put(b"other2", b"o", checksum(b"o"))
    proxy = LatencyProxy(s3.endpoint.removeprefix("http://"), delay=0.25).start()
    try:
        engine = Engine(
            l1=MemoryTier(8 << 20),
            l2=None,
            l3=tier(proxy.endpoint, s3.bucket, s3_prefix),
            policy_factory=lru,
            fill_concurrency=8,
        )
        bulk = threading.Thread(target=engine.get_many, args=([b"bulk%02d" % i for i in range(64)],))
        bulk.start()
        time.sleep(0.1)
        started = time.monotonic()
        hits = engine.get_many([b"other1", b"other2"])
        took = time.monotonic() - started
        bulk.join(60)
        assert [h.value for h in hits] == [b"o", b"o"]
        # 64 fills at 8 in flight take 8 rounds of 0.25 s each; a fair share answers in about one round.
        assert took < 1.2, f"a two-key request waited {took:.2f}s behind a 64-key one"
        engine.close()
    finally:
        proxy.stop()


_CRASHING_WRITER = """
import os, sys
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
l3 = S3Tier(endpoint=sys.argv[2], bucket="no-such-bucket-here", prefix="p/", access_key="a", secret_key="b")
engine = Engine(
    l1=MemoryTier(8 << 20), l2=LMDBTier(sys.argv[1], 16 << 20), l3=l3, policy_factory=lambda _: LRUPolicy(),
    namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
)
for i in range(50):
    engine.put(b"wb/%03d" % i, bytes([i]) * 3000)
print("acknowledged", flush=True)
os.kill(os.getpid(), 9)
"""


def test_acknowledged_write_back_values_survive_a_crash(tmp_path: Path, s3: Any) -> None:
    """Write-back values used to live in L1 alone until uploaded: SIGKILL lost every acknowledged one."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(tmp_path / "l2"), s3.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "acknowledged" and done.returncode == -9, done.stderr[-2000:]
    l2 = LMDBTier(tmp_path / "l2", 16 << 20)
    resident = {r.key: r for r in l2.scan()}
    for i in range(50):
        key = b"wb/%03d" % i
        assert key in resident and resident[key].dirty, f"{key!r} lost or not flagged for upload"
        assert l2.get(key).value == bytes([i]) * 3000
    l2.close()


def test_an_uploaded_value_is_not_uploaded_again_after_a_restart(tmp_path: Path, s3: Any, s3_prefix: str) -> None:
    """The L2 copy of an uploaded write-back value kept its dirty flag: every restart re-uploaded it."""

    def open_engine() -> Engine:
        return Engine(
            l1=MemoryTier(4 << 20),
            l2=LMDBTier(tmp_path / "l2", 16 << 20),
            l3=tier(s3.endpoint, s3.bucket, s3_prefix),
            policy_factory=lru,
            namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
        )

    engine = open_engine()
    for i in range(20):
        engine.put(b"wb/%02d" % i, os.urandom(2000))
    wait_until(lambda: engine.stats()["counters"]["dirty_keys"] == 0, 30, "every value uploaded")
    engine.close()
    engine = open_engine()
    assert engine.stats()["counters"]["dirty_keys"] == 0
    assert all(engine.get(b"wb/%02d" % i) is not None for i in range(20))
    engine.close()


_CRASH_IN_A_REWRITE = """
import os, sys
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
path, endpoint, l1_bytes, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
l3 = S3Tier(endpoint=endpoint, bucket="no-such-bucket-here", prefix="p/", access_key="a", secret_key="b")
l2 = LMDBTier(path, 16 << 20)
engine = Engine(
    l1=MemoryTier(l1_bytes), l2=l2, l3=l3, policy_factory=lambda _: LRUPolicy(),
    namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)],
)
engine.put(b"wb/k", b"A" * 3000)
print("acknowledged", flush=True)
writes = 0

def crashing(write):
    def wrapped(*args, **kwargs):
        global writes
        if writes == crash_at:
            os.kill(os.getpid(), 9)
        writes += 1
        return write(*args, **kwargs)
    return wrapped

l2.put, l2.delete = crashing(l2.put), crashing(l2.delete)
engine.put(b"wb/k", b"B" * 3000)
print("rewritten", writes, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("l1_bytes", [8 << 20, 1024], ids=["in-memory-and-on-disk", "on-disk-only"])
def test_a_kill_while_a_write_back_value_is_rewritten_keeps_one_of_the_two(
    tmp_path: Path, s3: Any, l1_bytes: int
) -> None:
    """A put of a write-back key dropped the old value's L2 copy, then wrote the new one: a kill between
    the two lost a value acknowledged earlier that object storage did not have (the crash loop's wrong read
    in CI). The process is killed before each L2 write of the second put in turn."""
    import subprocess

    crash_at, rewritten = 0, False
    while not rewritten:
        l2_path = tmp_path / f"l2-{crash_at}"
        done = subprocess.run(
            [sys.executable, "-c", _CRASH_IN_A_REWRITE, str(l2_path), s3.endpoint, str(l1_bytes), str(crash_at)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = done.stdout.split("\n")
        assert lines[0] == "acknowledged" and done.returncode == -9, done.stderr[-2000:]
        rewritten = lines[1].startswith("rewritten")
        l2 = LMDBTier(l2_path, 16 << 20)
        entry = l2.get(b"wb/k")
        l2.close()
        assert entry is not None, f"killed before L2 write {crash_at} of the rewrite: the acknowledged value is gone"
        assert entry.dirty and entry.value in (b"A" * 3000, b"B" * 3000)
        if rewritten:
            assert entry.value == b"B" * 3000
        crash_at += 1
    assert crash_at > 1, "the rewrite made no L2 write to crash before"
