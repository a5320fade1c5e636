"""One contract, every tier: memory, LMDB in a temp dir, S3 against the real SeaweedFS."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from cachesvc.errors import CorruptValue, TierFull
from cachesvc.integrity import checksum
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.s3 import object_name

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


TIERS = [
    "memory",
    "lmdb",
    "s3",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="no CUDA device")]),
]


def make_tier(kind: str, tmp_path: Path, s3: Any, prefix: str, capacity: int = 64 << 20, **s3_options: Any) -> Any:
    if kind == "memory":
        return MemoryTier(capacity)
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
