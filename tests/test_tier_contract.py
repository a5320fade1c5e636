"""One contract, every tier: memory, LMDB in a temp dir, S3 against the real SeaweedFS."""

from __future__ import annotations

import os
import stat
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from cacheclient.meta import TenantEntry
from cacheclient.wire import checksum, object_name
from cachesvc.errors import CorruptValue, TierFull, ValueTooLarge
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.arena import ArenaTier
from cachesvc.tiers.tenant_arenas import TenantArenas

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


TIERS = [
    "memory",
    "arena",
    "tenant-arenas",
    "lmdb",
    "s3",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="no CUDA device")]),
]


def make_tier(kind: str, tmp_path: Path, s3: Any, prefix: str, capacity: int = 64 << 20, **s3_options: Any) -> Any:
    if kind == "memory":
        return MemoryTier(capacity)
    if kind == "arena":
        return ArenaTier(capacity)
    if kind == "tenant-arenas":  # a tenant's keys (under "k") in a segment of their own, the rest in the main one
        arenas = TenantArenas(capacity)
        arenas.retable([TenantEntry("t", ("k",), token_sha256=b"h" * 32)])
        return arenas
    if kind == "lmdb":
        return LMDBTier(tmp_path / "l2", capacity)
    if kind == "cuda":
        from cachesvc.tiers.cuda import CudaMemoryTier

        return CudaMemoryTier(capacity)
    return S3Tier(
        endpoint=s3.endpoint,
        bucket=s3.bucket,
        prefix=prefix,
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
        **s3_options,
    )


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, tmp_path: Path, s3_prefix: str) -> Iterator[Any]:
    s3 = request.getfixturevalue("s3") if request.param == "s3" else None
    t = make_tier(request.param, tmp_path, s3, s3_prefix)
    yield t
    t.close()


def put(tier: Any, key: bytes, value: bytes) -> None:
    tier.put(key, value, checksum(value))


def test_round_trip_and_miss(tier: Any) -> None:
    assert tier.get(b"absent") is None
    for key, value in [(b"a", b""), (b"b", b"x"), (b"c", os.urandom(4096)), (b"d", os.urandom(1 << 20))]:
        put(tier, key, value)
        entry = tier.get(key)
        assert entry is not None and entry.value == value and entry.checksum == checksum(value)
        assert tier.contains(key)


def test_replace_and_delete(tier: Any) -> None:
    put(tier, b"k", b"old")
    put(tier, b"k", b"new value")
    assert tier.get(b"k").value == b"new value"
    assert tier.delete(b"k") is True
    assert tier.get(b"k") is None and not tier.contains(b"k")
    assert tier.delete(b"k") is False


@pytest.mark.parametrize("key", [b"\x00\xff binary \n key", "ünïcode/päth".encode(), b"~tilde", b"k" * 1024])
def test_any_key_bytes(tier: Any, key: bytes) -> None:
    put(tier, key, b"value of " + key[:10])
    assert tier.get(key).value == b"value of " + key[:10]
    assert key in {r.key for r in tier.scan()}
    # A neighbouring key does not alias it.
    assert tier.get(key[:-1] + bytes([key[-1] ^ 1])) is None


def test_scan_lists_every_key(tier: Any) -> None:
    keys = {f"scan/{i}".encode() for i in range(20)}
    for key in keys:
        put(tier, key, key * 3)
    assert keys <= {r.key for r in tier.scan()}
    assert sorted(tier.list_keys()) == sorted(r.key for r in tier.scan())  # the listing a move's recheck uses


def test_budgeted_tiers_refuse_past_budget_and_keep_old_value(tmp_path: Path) -> None:
    for t in (MemoryTier(64 << 10), LMDBTier(tmp_path / "l2", 1 << 20)):
        put(t, b"k", b"old")
        too_big = os.urandom(int(t.capacity_bytes))
        with pytest.raises(TierFull):
            put(t, b"k", too_big)
        assert t.get(b"k").value == b"old"
        assert t.used_bytes <= t.capacity_bytes
        t.close()


def test_lmdb_reopens_with_contents_indexed(tmp_path: Path) -> None:
    t = LMDBTier(tmp_path / "l2", 8 << 20)
    values = {f"k{i}".encode(): os.urandom(i * 100) for i in range(30)}
    for key, value in values.items():
        put(t, key, value)
    put(t, b"dirty", b"d")
    t.put(b"dirty", b"d", checksum(b"d"), dirty=True)
    used = t.used_bytes
    t.close()
    reopened = LMDBTier(tmp_path / "l2", 8 << 20)
    assert reopened.used_bytes == used
    assert {r.key for r in reopened.scan() if r.dirty} == {b"dirty"}
    for key, value in values.items():
        assert reopened.get(key).value == value
    reopened.close()


def test_lmdb_file_never_exceeds_its_budget(tmp_path: Path) -> None:
    budget = 4 << 20
    t = LMDBTier(tmp_path / "l2", budget)
    sizes = [100, 3000, 4096, 20_000, 70_000]
    i = 0
    with pytest.raises(TierFull):
        while True:  # fill it until the tier itself says no
            value = os.urandom(sizes[i % len(sizes)])
            put(t, f"k{i}".encode(), value)
            i += 1
    assert t.used_bytes <= t.capacity_bytes
    assert (tmp_path / "l2" / "data.mdb").stat().st_size <= budget
    t.close()


def test_lmdb_flipped_byte_reads_as_corrupt(tmp_path: Path) -> None:
    t = LMDBTier(tmp_path / "l2", 8 << 20)
    value = os.urandom(10_000)
    put(t, b"victim", value)
    t.close()
    env = lmdb.open(str(tmp_path / "l2"), map_size=8 << 20)
    with env.begin(write=True) as txn:
        record = bytearray(txn.get(b"kvictim"))
        record[-5] ^= 0xFF
        txn.put(b"kvictim", bytes(record))
    env.close()
    t = LMDBTier(tmp_path / "l2", 8 << 20)
    with pytest.raises(CorruptValue):
        t.get(b"victim")
    t.close()


def test_s3_large_values_use_parts_and_ranges(s3: Any, tmp_path: Path, s3_prefix: str) -> None:
    t = make_tier("s3", tmp_path, s3, s3_prefix, part_bytes=5 << 20, multipart_bytes=6 << 20)
    value = os.urandom(12 << 20)  # three parts up, three ranged GETs down
    put(t, b"big", value)
    head = s3.client().head_object(Bucket=s3.bucket, Key=object_name(s3_prefix, b"big"))
    assert head["ETag"].strip('"').endswith("-3")  # a three-part multipart upload
    assert t.get(b"big").value == value
    t.close()


def test_s3_reads_foreign_objects_and_catches_corruption(s3: Any, tmp_path: Path, s3_prefix: str) -> None:
    t = make_tier("s3", tmp_path, s3, s3_prefix)
    raw = s3.client()
    # Written by someone else (no checksum metadata): read as is, verified by ETag.
    raw.put_object(Bucket=s3.bucket, Key=s3_prefix + "dataset/0001.bin", Body=b"sample bytes")
    assert t.get(b"dataset/0001.bin").value == b"sample bytes"
    # Ours, then overwritten behind our back keeping our checksum: corrupt.
    put(t, b"mine", b"original")
    name = object_name(s3_prefix, b"mine")
    meta = raw.head_object(Bucket=s3.bucket, Key=name)["Metadata"]
    raw.put_object(Bucket=s3.bucket, Key=name, Body=b"tampered", Metadata=meta)
    with pytest.raises(CorruptValue):
        t.get(b"mine")
    t.close()


def test_s3_keys_with_an_empty_segment_read_other_tools_objects_never_another_key_s(
    s3: Any, tmp_path: Path, s3_prefix: str
) -> None:
    """The cache writes "a//b" under a name of its own (SeaweedFS folds "a//b" into "a/b"); it reads a dataset's
    "a//b" as is, but never the cache's own object of "a/b" that such a store hands back for it."""
    t = make_tier("s3", tmp_path, s3, s3_prefix)
    raw = s3.client()
    raw.put_object(Bucket=s3.bucket, Key=s3_prefix + "data//0001.bin", Body=b"a dataset's bytes")
    assert t.get(b"data//0001.bin").value == b"a dataset's bytes"
    assert t.contains(b"data//0001.bin")
    put(t, b"ours/x", b"the cache's value of ours/x")
    assert t.get(b"ours//x") is None  # the store answers "ours//x" with "ours/x": another key's object
    assert not t.contains(b"ours//x")
    put(t, b"ours//x", b"the cache's value of ours//x")  # under its own name: both kept apart
    assert t.get(b"ours//x").value == b"the cache's value of ours//x"
    assert t.get(b"ours/x").value == b"the cache's value of ours/x"
    t.close()


# -- expiry and info ---------------------------------------------------------------


def test_expiry_is_kept_with_the_value(tier: Any) -> None:
    later = time.time() + 3600.0
    tier.put(b"ttl", b"v", checksum(b"v"), expires_at=later)
    tier.put(b"forever", b"v", checksum(b"v"))
    found = {r.key: r.expires_at for r in tier.scan()}
    # Object storage keeps no expiry: it accepts one and drops it.
    assert found[b"ttl"] == (0.0 if isinstance(tier, S3Tier) else later)
    assert found[b"forever"] == 0.0
    tier.put(b"ttl", b"w", checksum(b"w"))  # replaced without one: the old expiry goes with the old value
    assert {r.key: r.expires_at for r in tier.scan()}[b"ttl"] == 0.0


def test_lmdb_keeps_expiry_and_dirty_across_reopen(tmp_path: Path) -> None:
    t = LMDBTier(tmp_path / "l2", 8 << 20)
    long_key = b"L" * 700  # held inside the record, under its digest
    t.put(b"short", b"a", checksum(b"a"), expires_at=1_900_000_000.5)
    t.put(long_key, b"b", checksum(b"b"), dirty=True, expires_at=2_000_000_000.25)
    t.put(b"plain", b"c", checksum(b"c"))
    t.close()
    reopened = LMDBTier(tmp_path / "l2", 8 << 20)
    found = {r.key: (r.expires_at, r.dirty) for r in reopened.scan()}
    assert found == {
        b"short": (1_900_000_000.5, False),
        long_key: (2_000_000_000.25, True),
        b"plain": (0.0, False),
    }
    assert reopened.get(long_key).value == b"b"
    reopened.close()


def test_lmdb_reads_records_of_the_older_header_as_never_expiring(tmp_path: Path) -> None:
    LMDBTier(tmp_path / "l2", 8 << 20).close()
    value = b"written by the previous version"
    v1_header = struct.pack("<2sBBQH", b"CV", 1, 0, checksum(value), 0)  # no expiry field
    env = lmdb.open(str(tmp_path / "l2"), map_size=8 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"kold", v1_header + value)
    env.close()
    t = LMDBTier(tmp_path / "l2", 8 << 20)
    assert t.get(b"old").value == value
    assert [(r.key, r.expires_at) for r in t.scan()] == [(b"old", 0.0)]
    t.close()


def test_info_says_what_the_tier_is(tier: Any) -> None:
    info = tier.info()
    assert all(isinstance(k, str) and isinstance(v, str | int) for k, v in info.items()), info
    if isinstance(tier, LMDBTier):
        assert info["path"] == str(tier.path.resolve()) and info["map_size"] == 64 << 20
    elif isinstance(tier, S3Tier):
        assert (info["endpoint"], info["bucket"], info["prefix"]) == (tier.endpoint, tier.bucket, tier.prefix)
    else:
        assert info["capacity_bytes"] == 64 << 20


def test_l2_directory_is_private_unless_it_exists(tmp_path: Path) -> None:
    LMDBTier(tmp_path / "new" / "l2", 1 << 20).close()
    assert stat.S_IMODE((tmp_path / "new" / "l2").stat().st_mode) == 0o700
    (tmp_path / "mine").mkdir(mode=0o755)
    os.chmod(tmp_path / "mine", 0o755)  # whatever the umask
    LMDBTier(tmp_path / "mine", 1 << 20).close()
    assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o755


def test_s3_refuses_an_object_over_max_value_bytes_without_reading_it(
    s3: Any, tmp_path: Path, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = make_tier("s3", tmp_path, s3, s3_prefix, part_bytes=1 << 20, max_value_bytes=2 << 20)
    s3.client().put_object(Bucket=s3.bucket, Key=s3_prefix + "huge", Body=os.urandom(8 << 20))
    s3.client().put_object(Bucket=s3.bucket, Key=s3_prefix + "fits", Body=b"x" * (2 << 20))
    gets = spy_on_gets(monkeypatch)
    with pytest.raises(ValueTooLarge, match="over max_value_bytes"):
        t.get(b"huge")
    assert gets == [s3_prefix + "huge"]  # the first ranged GET only: none of the other seven parts
    assert t.get(b"fits").value == b"x" * (2 << 20)  # at the limit: read, in two ranges
    t.close()


def test_s3_object_replaced_while_its_ranges_are_read_is_read_again(
    s3: Any, tmp_path: Path, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = make_tier("s3", tmp_path, s3, s3_prefix, part_bytes=1 << 20)
    old, new = os.urandom(3 << 20), os.urandom(3 << 20)
    put(t, b"moving", old)
    gets = spy_on_gets(monkeypatch, after_first=lambda: put(t, b"moving", new))
    assert t.get(b"moving").value == new  # never half of one and half of the other
    assert len(gets) > 3  # the ranges pinned to the first ETag were refused, and the new object read whole
    t.close()


def test_s3_names_object_store_paths_cannot_hold_are_kept_exactly(s3: Any, tmp_path: Path, s3_prefix: str) -> None:
    """object_store refuses an empty path segment ("a//b") and drops a trailing "/"; the wire contract does neither.

    (SeaweedFS itself keeps no bytes under a name ending in "/", so that case is not run here.)
    """
    t = make_tier("s3", tmp_path, s3, s3_prefix)
    for key in (b"a//b", b"/lead", b"plain"):
        put(t, key, key * 3)
        head = s3.client().head_object(Bucket=s3.bucket, Key=object_name(s3_prefix, key))
        assert head["Metadata"]["xxh3"] == f"{checksum(key * 3):016x}"
        assert t.contains(key) and t.get(key).value == key * 3
        assert t.delete(key) and not t.contains(key) and t.get(key) is None
    t.close()


def spy_on_gets(monkeypatch: pytest.MonkeyPatch, after_first: Any = None) -> list[str]:
    """Records the object name of every obstore GET; runs `after_first()` once the first one has answered."""
    import obstore

    real_get = obstore.get
    gets: list[str] = []

    def get(store: Any, path: str, **kwargs: Any) -> Any:
        gets.append(path)
        result = real_get(store, path, **kwargs)
        if after_first is not None and len(gets) == 1:
            after_first()
        return result

    monkeypatch.setattr(obstore, "get", get)
    return gets


def test_s3_a_process_forked_after_requests_still_reads_and_writes(s3: Any, tmp_path: Path, s3_prefix: str) -> None:
    """obstore's runtime does not survive fork: a request from such a child used to hang; it goes through boto3."""
    import multiprocessing

    t = make_tier("s3", tmp_path, s3, s3_prefix)
    put(t, b"from-parent", b"p")  # the parent's obstore runtime is running now
    child = multiprocessing.get_context("fork").Process(target=_use_s3_tier, args=(t,))
    child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert t.get(b"from-child").value == b"c"
    t.close()


def _use_s3_tier(t: Any) -> None:
    assert t.get(b"from-parent").value == b"p"
    put(t, b"from-child", b"c")
    assert t.contains(b"from-child") and t.get(b"from-child").value == b"c"
