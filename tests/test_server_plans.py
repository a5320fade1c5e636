"""Listing, evicting, server info and prefetch plans through a real server and SeaweedFS."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from fault_proxy import Fault, FaultProxy

from cacheclient import CacheClient, InvalidRequestError
from cacheclient.errors import LimitExceededError
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire import cache_pb2_grpc
from cacheclient.wire.limits import MAX_PLAN_KEYS, MAX_PLAN_MESSAGE_KEYS
from cachesvc.config import ServerConfig
from cachesvc.errors import InvalidKey, LimitReached
from cachesvc.prefetch import Prefetcher, Priority

from conftest import s3_args, wait_until


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


def test_a_server_without_object_storage_lists_its_cached_keys(cache_server: Any, tmp_path: Path) -> None:
    # A small L1 in front of L2: keys are listed from both tiers, each once, with their sizes.
    server = cache_server("--l1-bytes", "256KiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "64MiB")
    client = server.client()
    values = {f"kv/{i:03d}": bytes([i]) * (1000 + i) for i in range(60)} | {"other": b"x"}
    client.put_many(values)
    listed = list(client.list("kv/", page_size=7))
    assert listed == [(key.encode(), len(value)) for key, value in sorted(values.items()) if key.startswith("kv/")]
    assert [key for key, _ in client.list(start_after="kv/058")] == [b"kv/059", b"other"]
    client.delete("kv/010")
    assert b"kv/010" not in {key for key, _ in client.list("kv/", cached=True)}


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
        wait_until(lambda: plan.progress["fetched"] >= 10, 30, "the plan to fetch a window's worth (10 values)")
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
    # Every read in order: most found their prefetch done, none was fetched for nothing.
    assert stats["prefetch_useful"] >= 30 and stats["prefetch_useful"] + stats["prefetch_late"] <= 40
    assert stats["prefetch_wasted"] == 0


def test_closing_a_plan_stops_fetching(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    names = [f"c/{i:03d}" for i in range(30)]
    upload(s3, s3_prefix, names, 10_000)
    client = cache_server("--l1-bytes", "64MiB", *s3_args(s3, s3_prefix)).client()
    plan = client.prefetch(names, window_bytes=5 * 10_000)
    wait_until(lambda: plan.progress["fetched"] >= 5, 30, "the plan to fetch its first 5 values")
    plan.close()
    wait_until(lambda: client.stats()["counters"]["prefetch_plans_open"] == 0, 10, "the server to end the plan")
    # The plan fetched its window and nothing read it.
    assert client.stats()["counters"]["prefetch_wasted"] == 5
    before = client.stats()["counters"].get("prefetches", 0)
    for name in names[:10]:
        client.get(name)  # reads would have let an open plan move on
    time.sleep(0.5)
    assert client.stats()["counters"].get("prefetches", 0) == before


def test_bad_plans_are_refused(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    client = cache_server("--l1-bytes", "16MiB", *s3_args(s3, s3_prefix)).client()
    with pytest.raises(InvalidRequestError, match="sizes"):
        client.prefetch(["a", "b"], window_bytes=100, sizes=[1])
    with pytest.raises(InvalidRequestError, match="1..1024"):
        client.prefetch(["a", ""], window_bytes=100)
    with pytest.raises(InvalidRequestError, match="window_bytes"):
        client.prefetch(["a"], window_bytes=0)
    with pytest.raises(LimitExceededError, match="MAX_PLAN_KEYS"):
        client.prefetch([b"k"] * (MAX_PLAN_KEYS + 1), window_bytes=100)
    assert client.get("a") is None  # the server kept serving

    # What a client other than ours might send: a message over the key cap,
    # and a bad later message, which ends the plan with its error.
    stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(client.address))
    too_many = pb.PrefetchRequest(keys=[b"k%d" % i for i in range(MAX_PLAN_MESSAGE_KEYS + 1)], window_bytes=100)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Prefetch(iter([too_many]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "MAX_PLAN_MESSAGE_KEYS" in (refused.value.details() or "")
    later = [pb.PrefetchRequest(keys=[b"a"], window_bytes=100), pb.PrefetchRequest(keys=[b"b", b""])]
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Prefetch(iter(later), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1..1024" in (refused.value.details() or "")


def test_open_plans_leave_threads_for_demand_reads(cache_server: Any) -> None:
    """A plan holds a server thread while open: with every plan allowed open, a get still answers at once."""
    max_plans = ServerConfig().max_prefetch_plans
    assert max_plans > ServerConfig().workers  # the case that wedged a server: more plans than handler threads
    client = cache_server("--l1-bytes", "16MiB").client(timeout=10)
    client.put("k", b"v")
    plans = []
    try:
        for i in range(max_plans):
            # prefetch() returns once the server took the plan (it raises on refusal or no answer).
            plans.append(client.prefetch([f"plan{i}/{n}" for n in range(3)], window_bytes=1 << 20))
        started = time.monotonic()
        assert client.get("k", timeout=2) == b"v"
        assert time.monotonic() - started < 2
        with pytest.raises(LimitExceededError, match=f"max_prefetch_plans={max_plans}"):
            client.prefetch(["one-too-many"], window_bytes=100)
    finally:
        for plan in plans:
            plan.close()
    # Closed plans free their places.
    wait_until(lambda: _plan_accepted(client), 10, "a new plan to be accepted after the others closed")


def _plan_accepted(client: CacheClient) -> bool:
    try:
        client.prefetch(["again"], window_bytes=100).close()
    except LimitExceededError:
        return False
    return True


class _Engine:
    def prefetch(self, key: bytes) -> int | None:
        return 1


def test_a_plan_is_capped_and_closing_frees_its_place() -> None:
    prefetcher = Prefetcher(_Engine(), concurrency=2, max_plans=2, max_plan_keys=5)
    first, second = prefetcher.open(), prefetcher.open()
    with pytest.raises(LimitReached, match="max_prefetch_plans=2"):
        prefetcher.open()
    first.start(100, [b"a", b"b", b"c"], None)
    with pytest.raises(LimitReached, match="at most 5 keys"):
        first.extend([b"d", b"e", b"f"], None)
    first.extend([b"d", b"e"], None)
    with pytest.raises(InvalidKey, match="window_bytes"):
        second.start(0, [b"a"], None)
    first.close()
    second.close()
    assert prefetcher.open_plans == 0
    prefetcher.open().close()
    prefetcher.close()


class _GatedEngine:
    """Fetches in the order asked, one at a time, each once `gate` is open."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.order: list[bytes] = []

    def prefetch(self, key: bytes) -> int | None:
        assert self.gate.wait(10)
        self.order.append(key)
        return 1


def test_a_high_priority_plans_fetches_go_before_a_low_priority_plans_opened_first() -> None:
    engine = _GatedEngine()
    prefetcher = Prefetcher(engine, concurrency=1, max_plans=4, max_plan_keys=100)
    stop = threading.Event()
    threads = []
    for name, priority in (("low", Priority.LOW), ("high", Priority.HIGH)):
        plan = prefetcher.open()
        plan.start(100, [f"{name}{i}".encode() for i in range(4)], [1] * 4, priority)
        reports = prefetcher.run(plan, lambda: not stop.is_set(), report_every=0.05)
        next(reports)  # the plan is scheduled (and the low plan's first fetch is held at the gate)
        threads.append(threading.Thread(target=lambda reports=reports: [None for _ in reports], daemon=True))
        threads[-1].start()
    engine.gate.set()
    wait_until(lambda: len(engine.order) == 8, 10, "both plans to fetch every key")
    # The low plan's first fetch had started; every other slot went to the high plan while it had keys.
    assert engine.order == [b"low0", b"high0", b"high1", b"high2", b"high3", b"low1", b"low2", b"low3"]
    stop.set()
    for thread in threads:
        thread.join(5)
    prefetcher.close()


def test_a_high_priority_plan_lands_before_a_low_priority_plan_opened_first(
    cache_server: Any, s3: Any, s3_prefix: str
) -> None:
    """Through a server with one fetch slot, each GET held 20 ms: once the high plan is open, the low one waits."""
    low_names = [f"low/{i:03d}" for i in range(30)]
    high_names = [f"high/{i:03d}" for i in range(30)]
    upload(s3, s3_prefix, low_names + high_names, 1000)
    with FaultProxy(s3.endpoint).start() as proxy:
        proxy.set(Fault.LATENCY, delay=0.02)
        flags = s3_args(s3, s3_prefix)
        flags[flags.index("--s3-endpoint") + 1] = proxy.endpoint
        client = cache_server("--l1-bytes", "64MiB", *flags, env={"CACHESVC_PREFETCH_CONCURRENCY": "1"}).client()
        window = 64 << 20
        with client.prefetch(low_names, window_bytes=window, sizes=[1000] * 30, priority="low") as low:
            wait_until(lambda: low.progress["fetched"] >= 1, 30, "the low plan to start fetching")
            with client.prefetch(high_names, window_bytes=window, sizes=[1000] * 30, priority="high") as high:
                low_before = low.progress["fetched"]
                wait_until(lambda: high.progress["done"], 60, "the high plan to fetch every key")
                low_after = low.progress["fetched"]
            # The low plan's fetch under way when the high one opened may land; no more. Without
            # priorities the plans would take turns, and the low one, ahead, would finish first.
            assert low_before < 30 and low_after - low_before <= 2, (low_before, low_after)
            assert low.wait(60)


def test_list_refuses_another_bucket_and_info_names_the_storage(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    client = cache_server("--l1-bytes", "16MiB", *s3_args(s3, s3_prefix)).client()
    with pytest.raises(InvalidRequestError, match="not the one this server caches"):
        list(client.list("x", bucket="some-other-bucket"))
    assert list(client.list("x", bucket=s3.bucket)) == []
    info = client.info()
    assert (info["s3_endpoint"], info["s3_bucket"], info["s3_prefix"]) == (s3.endpoint, s3.bucket, s3_prefix)
    assert "secret" not in repr(info).lower()


def test_a_routed_client_lists_every_nodes_cached_keys_once(cache_server: Any) -> None:
    first, second = cache_server("--l1-bytes", "16MiB"), cache_server("--l1-bytes", "16MiB")
    client = CacheClient(nodes=[first.address, second.address])
    try:
        keys = [f"kv/{i:03d}" for i in range(40)]
        client.put_many({key: key.encode() for key in keys})
        # Both nodes own some of them, and one more copy of a key on the other node is listed once.
        assert all(list(server.client().list("kv/")) for server in (first, second))
        second.client().put(keys[0], b"kv/000")
        assert list(client.list("kv/", cached=True, page_size=7)) == [(key.encode(), 6) for key in keys]
    finally:
        client.close()
