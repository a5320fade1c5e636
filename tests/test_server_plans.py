"""Listing, evicting, server info and prefetch plans through a real server and SeaweedFS."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from cacheclient import CacheClient, InvalidRequestError
from cacheclient.errors import CacheClientError

from conftest import s3_args


def upload(s3: Any, prefix: str, names: list[str], size: int) -> dict[str, bytes]:
    raw = s3.client()
    data = {}
    for name in names:
        data[name] = os.urandom(size)
        raw.put_object(Bucket=s3.bucket, Key=prefix + name, Body=data[name])
    return data


def test_list_pages_through_object_storage(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    names = [f"ds/{i:04d}.bin" for i in range(25)] + ["other/x"]
    upload(s3, s3_prefix, names, 100)
    client = cache_server("--l1-bytes", "16MiB", *s3_args(s3, s3_prefix)).client()
    listed = list(client.list("ds/", page_size=7))
    assert [k for k, _ in listed] == [n.encode() for n in names[:25]]
    assert {size for _, size in listed} == {100}
    assert list(client.list("nothing-here/")) == []


def test_list_without_object_storage_is_a_clear_error(cache_server: Any) -> None:
    client = cache_server("--l1-bytes", "16MiB").client()
    with pytest.raises(CacheClientError, match="no object storage"):
        list(client.list("x"))


def test_evict_keeps_object_storage_and_info_reports_l2(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    server = cache_server("--l1-bytes", "16MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "32MiB",
                          *s3_args(s3, s3_prefix))  # fmt: skip
    client = server.client()
    client.put("k", b"value")
    assert client.evict("k") is True
    assert not client.contains("k", cached_only=True) and client.contains("k")
    assert client.get_with_tier("k") == (b"value", "l3")
    info = client.info()
    assert info["l2_path"] == str((tmp_path / "l2").resolve()) and info["l2_map_size"] == 32 << 20
    assert info["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_prefetch_plan_fills_ahead_within_its_window(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    names = [f"p/{i:03d}" for i in range(40)]
    data = upload(s3, s3_prefix, names, 50_000)
    client: CacheClient = cache_server("--l1-bytes", "64MiB", *s3_args(s3, s3_prefix)).client()
    window = 10 * 50_000
    with client.prefetch(names, window_bytes=window, sizes=[50_000] * len(names)) as plan:
        deadline = time.monotonic() + 30
        while plan.progress["fetched"] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        # Nothing was read: the plan stops at its window.
        assert plan.progress["fetched"] == 10
        assert plan.progress["window_used_bytes"] <= window
        tiers = []
        for name in names:  # read in plan order, as a training loop does
            value, tier = client.get_with_tier(name)
            assert value == data[name]
            tiers.append(tier)
            time.sleep(0.01)
        assert plan.wait(30)
    hits = tiers.count("l1")
    assert hits >= 30, f"only {hits} of 40 reads were prefetched: {tiers}"
    stats = client.stats()["counters"]
    assert stats["prefetches"] >= 30


def test_closing_a_plan_stops_fetching(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    names = [f"c/{i:03d}" for i in range(30)]
    upload(s3, s3_prefix, names, 10_000)
    client = cache_server("--l1-bytes", "64MiB", *s3_args(s3, s3_prefix)).client()
    plan = client.prefetch(names, window_bytes=5 * 10_000)
    deadline = time.monotonic() + 30
    while plan.progress["fetched"] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    plan.close()
    time.sleep(0.5)
    before = client.stats()["counters"].get("prefetches", 0)
    for name in names[:10]:
        client.get(name)  # reads would have let an open plan move on
    time.sleep(0.5)
    assert client.stats()["counters"].get("prefetches", 0) == before


def test_bad_plans_are_refused(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    client = cache_server("--l1-bytes", "16MiB", *s3_args(s3, s3_prefix)).client()
    with pytest.raises(InvalidRequestError, match="sizes"):
        client.prefetch(["a", "b"], window_bytes=100, sizes=[1])
    plan = client.prefetch(["a", ""], window_bytes=100)
    time.sleep(0.5)
    plan.close()
    assert isinstance(plan.error, InvalidRequestError) and "1..1024" in str(plan.error)
    assert client.get("a") is None  # the server kept serving


def test_list_refuses_another_bucket_and_info_names_the_storage(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    client = cache_server("--l1-bytes", "16MiB", *s3_args(s3, s3_prefix)).client()
    with pytest.raises(InvalidRequestError, match="not the one this server caches"):
        list(client.list("x", bucket="some-other-bucket"))
    assert list(client.list("x", bucket=s3.bucket)) == []
    info = client.info()
    assert (info["s3_endpoint"], info["s3_bucket"], info["s3_prefix"]) == (s3.endpoint, s3.bucket, s3_prefix)
    assert "secret" not in repr(info).lower()
