"""Value versions and vouching (issue 22): the engine-level guarantees, on two engines sharing one bucket prefix.

Two engines over one SeaweedFS prefix stand for a key's former owner (A) and
its new owner (B) after a move; B's first fill source is A itself
(`EnginePeer`: what `PeerFill` asks over RPC, here in process), so the tests
need no placement. Each scenario failed before versions: B's peer fill
brought a deleted or an overwritten value back, A's late upload overwrote
B's newer object, a restarted engine served its L2 copy of a key rewritten
while it was down, and a peer-filled dirty value read as uploaded.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from cacheclient.wire import checksum
from cacheclient.wire.record import open_record, pack_record
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.engine.versions import COUNTER_BITS, VersionClock, stamp
from cachesvc.errors import TierFull
from cachesvc.policy import LRUPolicy
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.base import Entry

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY, S3Server, read_directly, wait_until


def lru(_: str) -> LRUPolicy:
    return LRUPolicy()


class EnginePeer:
    """Engine A as engine B's first fill source and the target of its drops (`PeerFill` without the RPC)."""

    name = "peers"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.drops = 0

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Entry]:
        found = {}
        for key in keys:
            hit = self.engine.get_cached(key)
            if hit is not None:
                found[key] = Entry(hit.value, hit.checksum)
        return found

    def drop(self, key: bytes) -> None:
        self.drops += 1
        self.engine.drop_cached(key)

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class GatedS3(S3Tier):
    """An S3 tier whose version checks wait on `gate` once `armed` (a write-back upload held back)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.reached = threading.Event()
        self.gate = threading.Event()
        self.before_vouch: Callable[[], None] | None = None

    def head_version(self, key: bytes) -> int | None:
        if self.armed:
            self.reached.set()
            assert self.gate.wait(30)
        return super().head_version(key)

    def vouch(self, key: bytes, value: bytes, checksum: int) -> int | None:
        before, self.before_vouch = self.before_vouch, None
        if before is not None:
            before()  # runs once, between an upload's version check and its comparison of the bytes
        return super().vouch(key, value, checksum)


def s3_tier(s3: S3Server, prefix: str, cls: type[S3Tier] = S3Tier) -> S3Tier:
    return cls(
        endpoint=s3.endpoint, bucket=s3.bucket, prefix=prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY
    )


def engine(
    l3: S3Tier,
    l2: Path | None = None,
    peer: Engine | None = None,
    namespaces: Sequence[Namespace] = (),
    vouch_listings: int = 0,
) -> Engine:
    """An engine whose unvouched copies are checked one HEAD each at their first read (`vouch_listings=0`): the
    check every copy a listing cannot vouch for still takes (tests/test_restart_vouching.py: the bulk path)."""
    return Engine(
        l1=MemoryTier(8 << 20),
        l2=LMDBTier(l2, 16 << 20) if l2 is not None else None,
        l3=l3,
        fill_sources=[EnginePeer(peer)] if peer is not None else [],
        policy_factory=lru,
        namespaces=namespaces,
        vouch_listings=vouch_listings,
    )


WB = [Namespace(b"wb/", WriteMode.WRITE_BACK)]


@pytest.fixture
def closing() -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    yield engines
    for e in engines:
        e.close(flush_timeout=5.0)


def test_the_version_clock_never_goes_back_and_moves_past_what_it_sees() -> None:
    now = [100.0]
    clock = VersionClock(lambda: now[0], tag=5)
    first = clock.next()
    assert first == stamp(100_000, 0, 5)
    assert clock.next() == stamp(100_000, 1, 5)  # the same millisecond: the counter
    now[0] = 99.0  # the wall clock stepped back
    assert clock.next() == stamp(100_000, 2, 5)
    clock.observe(stamp(200_000, 7, 9))  # a version from a peer or object storage, ahead of this clock
    assert clock.next() == stamp(200_000, 8, 5)
    now[0] = 300.0
    assert clock.next() == stamp(300_000, 0, 5) and stamp(300_000, 0, 5) >> COUNTER_BITS == 300_000
    # Two clocks of one millisecond never hand out the same stamp (their tags differ).
    other = VersionClock(lambda: now[0], tag=6)
    assert other.next() != stamp(300_000, 0, 5)


def test_a_put_stamps_its_version_into_l2_and_the_object(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]
) -> None:
    l3 = s3_tier(s3, s3_prefix)
    e = engine(l3, tmp_path / "l2", namespaces=WB)
    closing.append(e)
    e.put(b"k", b"v1")
    e.put(b"k", b"v2")
    stored = l3.head_version(b"k")
    assert stored is not None and stored > 0
    assert e.versions.last == stored
    got = l3.get(b"k")
    assert got is not None and got.value == b"v2" and got.version == stored
    e.put(b"wb/k", b"dirty")  # write-back: kept in L2 too, with its version
    assert e.l2 is not None
    on_disk = e.l2.tier.get(b"wb/k")
    assert on_disk is not None and on_disk.version == e.versions.last
    assert {r.key: r.version for r in e.l2.tier.scan()}[b"wb/k"] == on_disk.version


def test_l2_records_keep_versions_and_older_records_still_read(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "l2", 4 << 20)
    try:
        tier.put(b"small", b"x" * 10, checksum(b"x" * 10), version=12345)  # packed
        tier.put(b"large", b"y" * 100_000, checksum(b"y" * 100_000), version=67890)
        assert tier.get(b"small") == Entry(b"x" * 10, checksum(b"x" * 10), False, 12345)
        large = tier.get(b"large")
        assert large is not None and large.version == 67890
    finally:
        tier.close()
    reopened = LMDBTier(tmp_path / "l2", 4 << 20)
    try:
        assert {r.key: r.version for r in reopened.scan()} == {b"small": 12345, b"large": 67890}
    finally:
        reopened.close()
    # A version 2 record (before versions): reads, as version 0.
    old = b"CV" + bytes([2, 0]) + checksum(b"v").to_bytes(8, "little") + bytes(2) + bytes(8) + b"v"
    opened = open_record(b"k", old)
    assert opened is not None and opened[0].version == 0 and bytes(opened[1]) == b"v"
    assert open_record(b"k", pack_record(b"k", b"v", checksum(b"v"), version=9)) is not None


def test_a_delete_through_the_new_owner_is_not_undone_by_peer_fill(
    s3: S3Server, s3_prefix: str, closing: list[Engine]
) -> None:
    a = engine(s3_tier(s3, s3_prefix))
    closing.append(a)
    a.put(b"k", b"old")
    b = engine(s3_tier(s3, s3_prefix), peer=a)
    closing.append(b)
    assert b.get(b"k") is not None  # moved: B reads A's copy, checked against the object
    assert b.delete(b"k")
    assert b.get(b"k") is None
    assert a.get_cached(b"k") is None  # A was told before the object went


def test_peer_fill_refuses_a_copy_the_object_no_longer_holds(
    s3: S3Server, s3_prefix: str, closing: list[Engine]
) -> None:
    """Overwrite through B, then evict on B: A's old copy is refused (its bytes are not the object's)."""
    a = engine(s3_tier(s3, s3_prefix))
    closing.append(a)
    a.put(b"k", b"old")
    b = engine(s3_tier(s3, s3_prefix), peer=a)
    closing.append(b)
    b.put(b"k", b"new")
    assert b.evict(b"k")
    hit = b.get(b"k")
    assert hit is not None and hit.value == b"new"
    assert b.stats()["counters"]["peer_fills_refused"] == 1
    # And a key deleted in object storage behind both (A not told) stays deleted.
    a.put(b"gone", b"x")
    s3_tier(s3, s3_prefix).delete(b"gone")
    assert b.get(b"gone") is None


def test_a_former_owners_late_upload_does_not_overwrite_a_newer_object(
    s3: S3Server, s3_prefix: str, closing: list[Engine]
) -> None:
    gated = s3_tier(s3, s3_prefix, GatedS3)
    assert isinstance(gated, GatedS3)
    gated.armed = True
    a = engine(gated, namespaces=WB)
    closing.append(a)
    a.put(b"wb/k", b"v1")  # acknowledged; its upload waits at the version check
    assert gated.reached.wait(20)
    b = engine(s3_tier(s3, s3_prefix), namespaces=[Namespace(b"wb/", WriteMode.WRITE_THROUGH)])
    closing.append(b)
    time.sleep(0.005)  # versions of two nodes order two puts a few ms apart (a move takes far longer)
    b.put(b"wb/k", b"v2")  # the key moved to B; the writer wrote it again there
    gated.armed = False
    gated.gate.set()
    wait_until(lambda: not a.dirty(b"wb/k"), 20, "A's upload to end")
    got = s3_tier(s3, s3_prefix).get(b"wb/k")
    assert got is not None and got.value == b"v2"
    assert a.stats()["counters"]["writeback_superseded"] == 1
    assert a.get_cached(b"wb/k") is None  # A's stale copy went with it


def replicas_of_one_put(s3: S3Server, s3_prefix: str, closing: list[Engine], tmp_path: Path) -> tuple[GatedS3, Engine]:
    """Engines A (L2 on disk) and B, the two replicas of write-back key b"wb/k", each take a put of b"same" and
    stamp it with its own clock. A's upload waits at its version check (its tier, returned with A, is gated)
    while B, stamped later, uploads first; A's upload goes on once the gate opens."""
    gated = s3_tier(s3, s3_prefix, GatedS3)
    assert isinstance(gated, GatedS3)
    gated.armed = True
    a = engine(gated, l2=tmp_path / "a", namespaces=WB)
    closing.append(a)
    b = engine(s3_tier(s3, s3_prefix), namespaces=WB)
    closing.append(b)
    a.put(b"wb/k", b"same")  # its upload waits at the version check
    assert gated.reached.wait(20)
    time.sleep(0.005)
    b.put(b"wb/k", b"same")
    wait_until(lambda: not b.dirty(b"wb/k"), 20, "B's upload")
    return gated, a


def test_a_replicas_upload_that_finds_the_same_value_under_a_later_stamp_keeps_its_copy(
    s3: S3Server, s3_prefix: str, closing: list[Engine], tmp_path: Path
) -> None:
    # The other replica's upload finds a newer object holding its own bytes: its copy is the object's value, so
    # it stays cached (clean), where a newer value would have been dropped.
    gated, a = replicas_of_one_put(s3, s3_prefix, closing, tmp_path)
    gated.armed = False
    gated.gate.set()
    wait_until(lambda: not a.dirty(b"wb/k"), 20, "A's upload to end")
    counters = a.stats()["counters"]
    assert counters.get("writeback_matched") == 1 and counters.get("writeback_superseded", 0) == 0
    cached = a.get_cached(b"wb/k")
    assert cached is not None and cached.value == b"same"
    got = s3_tier(s3, s3_prefix).get(b"wb/k")
    assert got is not None and got.value == b"same"
    # A's clock moved past the stamp it read, so its next put of the key is ordered after B's.
    stamped = s3_tier(s3, s3_prefix).head_version(b"wb/k")
    assert stamped and a.versions.last >= stamped
    # And its disk copy, clean now, carries the object's version (a restart reads it back from there).
    assert a.l2 is not None
    on_disk = a.l2.tier.get(b"wb/k")
    assert on_disk is not None and not on_disk.dirty and on_disk.version == stamped


def test_an_upload_that_matches_an_object_rewritten_between_its_two_heads_moves_its_clock_past_the_later_stamp(
    s3: S3Server, s3_prefix: str, closing: list[Engine], tmp_path: Path
) -> None:
    # As above, and a third writer puts the same bytes again between A's version check and its comparison of
    # the bytes: A's copy takes that later stamp, and so must A's clock (its next put is ordered after it).
    gated, a = replicas_of_one_put(s3, s3_prefix, closing, tmp_path)
    c = engine(s3_tier(s3, s3_prefix), namespaces=[Namespace(b"wb/", WriteMode.WRITE_THROUGH)])
    closing.append(c)
    first = s3_tier(s3, s3_prefix).head_version(b"wb/k")
    assert first

    def rewrite() -> None:
        time.sleep(0.005)
        c.put(b"wb/k", b"same")

    gated.before_vouch = rewrite
    gated.armed = False
    gated.gate.set()
    wait_until(lambda: not a.dirty(b"wb/k"), 20, "A's upload to end")
    assert a.stats()["counters"].get("writeback_matched") == 1
    later = s3_tier(s3, s3_prefix).head_version(b"wb/k")
    assert later and later > first
    assert a.l2 is not None
    on_disk = a.l2.tier.get(b"wb/k")
    assert on_disk is not None and on_disk.version == later
    assert a.versions.last >= later


def test_a_delete_through_the_new_owner_reaches_a_value_the_old_owner_had_not_uploaded(
    s3: S3Server, s3_prefix: str, closing: list[Engine]
) -> None:
    gated = s3_tier(s3, s3_prefix, GatedS3)
    assert isinstance(gated, GatedS3)
    gated.armed = True
    a = engine(gated, namespaces=WB)
    closing.append(a)
    a.put(b"wb/k", b"v1")
    assert gated.reached.wait(20)
    b = engine(s3_tier(s3, s3_prefix), peer=a, namespaces=WB)
    closing.append(b)
    deleting = threading.Thread(target=b.delete, args=(b"wb/k",))
    deleting.start()  # B tells A first; A's drop waits for the upload it holds the key's lock for
    gated.armed = False
    gated.gate.set()
    deleting.join(20)
    assert not deleting.is_alive()
    wait_until(lambda: not a.dirty(b"wb/k") and not b.dirty(b"wb/k"), 20, "the uploads to end")
    assert s3_tier(s3, s3_prefix).get(b"wb/k") is None
    assert b.get(b"wb/k") is None


def test_a_peer_filled_write_back_value_is_uploaded_before_the_new_owner_keeps_it(
    s3: S3Server, s3_prefix: str, closing: list[Engine]
) -> None:
    gated = s3_tier(s3, s3_prefix, GatedS3)
    assert isinstance(gated, GatedS3)
    gated.armed = True
    a = engine(gated, namespaces=WB)
    closing.append(a)
    a.put(b"wb/k", b"v1")
    assert gated.reached.wait(20)  # A's flusher holds it back: dirty on A
    assert a.dirty(b"wb/k")
    b = engine(s3_tier(s3, s3_prefix), peer=a, namespaces=WB)
    closing.append(b)
    gated.armed = False
    gated.gate.set()
    hit = b.get(b"wb/k")
    assert hit is not None and hit.value == b"v1"
    assert b.uploaded(b"wb/k")  # `Contains.uploaded`: object storage has these bytes
    got = s3_tier(s3, s3_prefix).get(b"wb/k")
    assert got is not None and got.value == b"v1"


@pytest.mark.parametrize("listings", [0, 4], ids=["one-head-each", "listed"])
def test_a_restarted_engine_checks_its_l2_before_serving_it(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine], listings: int
) -> None:
    a = engine(s3_tier(s3, s3_prefix), tmp_path / "l2")
    a.put(b"same", b"kept")
    a.put(b"rewritten", b"old")
    a.put(b"deleted", b"old")
    a.close()
    other = engine(s3_tier(s3, s3_prefix))  # the keys' owner while A was down
    closing.append(other)
    other.put(b"rewritten", b"new")
    other.delete(b"deleted")
    a = engine(s3_tier(s3, s3_prefix), tmp_path / "l2", vouch_listings=listings)
    closing.append(a)
    hit = a.get(b"same")
    assert hit is not None and hit.value == b"kept" and hit.tier == "l2"  # checked, then served from L2
    hit = a.get(b"rewritten")
    assert hit is not None and hit.value == b"new"
    assert a.get(b"deleted") is None
    counters = a.stats()["counters"]
    if listings:  # one listing vouched for all three: one kept, two dropped, no HEAD
        assert counters["vouch_listed"] == 1 and counters["vouch_list_drops"] == 2 and "vouch_checks" not in counters
    else:
        assert counters["vouch_checks"] == 3 and counters["vouch_drops"] == 2
    assert a.get_many([b"same", b"rewritten"])[1] is not None  # checked once: no more checks
    after = a.stats()["counters"]
    for name in ("vouch_checks", "vouch_listed", "vouch_listings", "vouch_list_drops"):
        assert after.get(name, 0) == counters.get(name, 0), name


def restarted_after_a_rewrite(s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]) -> Engine:
    """An engine restarted on its L2, whose copy of b"rewritten" (b"old" * 10) another engine, the key's owner
    while it was down, replaced with b"new" * 10."""
    a = engine(s3_tier(s3, s3_prefix), tmp_path / "l2")
    a.put(b"rewritten", b"old" * 10)
    a.close()
    other = engine(s3_tier(s3, s3_prefix))
    closing.append(other)
    other.put(b"rewritten", b"new" * 10)
    a = engine(s3_tier(s3, s3_prefix), tmp_path / "l2")
    closing.append(a)
    return a


def test_a_copy_its_check_drops_is_never_readable_from_l2s_file_on_its_way_out(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]
) -> None:
    """A restarted node's copy of a key rewritten meanwhile is marked in its L2 file until checked; the check
    finds it stale and drops it. Its marker must stay until the copy is gone: a co-located reader of the file
    between the two read the old value after the new one's put had returned (the Jepsen runs, after a drain
    was undone)."""
    a = restarted_after_a_rewrite(s3, s3_prefix, tmp_path, closing)
    assert read_directly(tmp_path / "l2", [b"rewritten"]) == [None]  # read back: marked until checked
    l2 = a._placement.levels[1].tier
    seen: list[bytes | None] = []
    delete = l2.delete

    def delete_after_a_direct_read(key: bytes) -> bool:
        seen.extend(read_directly(tmp_path / "l2", [key]))  # what a reader of the file gets just before
        return delete(key)

    l2.delete = delete_after_a_direct_read  # type: ignore[method-assign]
    hit = a.get(b"rewritten")
    assert hit is not None and hit.value == b"new" * 10
    assert a.stats()["counters"]["vouch_drops"] == 1
    assert seen == [None], f"a reader of the L2 file read the dropped copy: {seen}"


def test_a_stale_copy_l2_could_not_drop_is_checked_again_not_served(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]
) -> None:
    """The check of a restarted node's copy finds it stale, and L2 cannot delete it (its map full even for a
    delete): the read fails, and the next one checks the copy again rather than serving it as it is."""
    a = restarted_after_a_rewrite(s3, s3_prefix, tmp_path, closing)
    l2 = a._placement.levels[1].tier
    delete = l2.delete

    def full_once(key: bytes) -> bool:
        l2.delete = delete  # type: ignore[method-assign]
        raise TierFull("l2: LMDB map full (16777216 bytes) for a delete")

    l2.delete = full_once  # type: ignore[method-assign]
    with pytest.raises(TierFull):
        a.get(b"rewritten")
    assert read_directly(tmp_path / "l2", [b"rewritten"]) == [None]  # still marked for readers of the file
    hit = a.get(b"rewritten")
    assert hit is not None and hit.value == b"new" * 10


def test_a_restarted_engines_dirty_value_superseded_meanwhile_is_neither_served_nor_uploaded(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on: every upload fails
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable = S3Tier(endpoint=dead, bucket=s3.bucket, prefix=s3_prefix, access_key="a", secret_key="b")
    a = engine(unreachable, tmp_path / "l2", namespaces=WB)
    a.put(b"wb/k", b"v1")
    a.put(b"wb/mine", b"only-here")
    a.close(flush_timeout=0.2)  # acknowledged, not uploaded: kept in L2, flagged dirty
    other = engine(s3_tier(s3, s3_prefix), namespaces=[Namespace(b"wb/", WriteMode.WRITE_THROUGH)])
    closing.append(other)
    other.put(b"wb/k", b"v2")  # the key's owner while A was down
    restarted = engine(s3_tier(s3, s3_prefix), tmp_path / "l2", namespaces=WB)
    closing.append(restarted)
    hit = restarted.get(b"wb/k")
    assert hit is not None and hit.value == b"v2"
    hit = restarted.get(b"wb/mine")
    assert hit is not None and hit.value == b"only-here"
    wait_until(lambda: not restarted.dirty(b"wb/mine"), 20, "the restarted engine's upload")
    got = s3_tier(s3, s3_prefix).get(b"wb/k")
    assert got is not None and got.value == b"v2"
    mine = s3_tier(s3, s3_prefix).get(b"wb/mine")
    assert mine is not None and mine.value == b"only-here"


def test_a_restarted_engines_dirty_value_uploaded_meanwhile_by_another_replica_is_kept_and_not_uploaded_again(
    s3: S3Server, s3_prefix: str, tmp_path: Path, closing: list[Engine]
) -> None:
    # A replicated put of b"same": A acknowledged it and went down before uploading; the other replica uploaded
    # the same bytes under its own, later stamp. A's restarted check finds a newer object holding its bytes: its
    # disk copy is served (no refill) and marked clean, with no second PUT of the object.
    with socket.socket() as sock:  # a port nothing listens on: every upload fails
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable = S3Tier(endpoint=dead, bucket=s3.bucket, prefix=s3_prefix, access_key="a", secret_key="b")
    a = engine(unreachable, tmp_path / "l2", namespaces=WB)
    a.put(b"wb/k", b"same" * 100)
    a.close(flush_timeout=0.2)  # acknowledged, not uploaded: kept in L2, flagged dirty
    other = engine(s3_tier(s3, s3_prefix), namespaces=[Namespace(b"wb/", WriteMode.WRITE_THROUGH)])
    closing.append(other)
    other.put(b"wb/k", b"same" * 100)
    stamped = s3_tier(s3, s3_prefix).head_version(b"wb/k")
    assert stamped
    restarted = engine(s3_tier(s3, s3_prefix), tmp_path / "l2", namespaces=WB)
    closing.append(restarted)
    hit = restarted.get(b"wb/k")
    assert hit is not None and hit.value == b"same" * 100 and hit.tier == "l2"  # its own copy, not a refill
    wait_until(lambda: not restarted.dirty(b"wb/k"), 20, "the restarted engine's write-back check")
    counters = restarted.stats()["counters"]
    assert counters.get("vouch_drops", 0) == 0 and counters.get("writeback_matched") == 1, counters
    assert s3_tier(s3, s3_prefix).head_version(b"wb/k") == stamped  # not uploaded again
    assert restarted.versions.last >= stamped  # its next put of the key is ordered after the other's
    assert restarted.l2 is not None
    on_disk = restarted.l2.tier.get(b"wb/k")
    assert on_disk is not None and not on_disk.dirty and on_disk.version == stamped


def test_keys_that_moved_away_and_back_are_checked_once(s3: S3Server, s3_prefix: str, closing: list[Engine]) -> None:
    a = engine(s3_tier(s3, s3_prefix))
    closing.append(a)
    a.put(b"k1", b"old")
    a.put(b"k2", b"same")
    other = engine(s3_tier(s3, s3_prefix))
    closing.append(other)
    other.put(b"k1", b"new")  # written while the slot was elsewhere
    a.unvouch_cached(lambda key: key == b"k1")  # the slot came back
    hit = a.get(b"k1")
    assert hit is not None and hit.value == b"new"
    hit = a.get(b"k2")
    assert hit is not None and hit.tier == "l1"
    assert a.stats()["counters"]["vouch_checks"] == 1
