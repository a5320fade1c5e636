"""Object-storage faults between a real cache server and a real SeaweedFS (issue 14).

A fault-injecting proxy (`fault_proxy.FaultProxy`) sits between a
`cachesvc serve` process and the S3 server: added latency, connections reset
mid-body, bodies cut short of their Content-Length, 503 SlowDown answered by
the proxy, stalled responses, and S3 refusing connections. Under each, a read
gets the right bytes or a clear error, never wrong or partial bytes; once the
fault is gone the key reads right and the cache holds the right value.
Durations are printed (`-s`) for docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from fault_proxy import Fault, FaultProxy

from cacheclient import CacheClient
from cacheclient.errors import CacheClientError, CorruptValueError, DeadlineError, UnavailableError
from cacheclient.wire import checksum
from cacheclient.wire.ranges import range_key
from cachesvc.engine import Engine, Hit, Namespace, WriteMode
from cachesvc.errors import TierUnavailable
from cachesvc.policy import LRUPolicy
from cachesvc.server.peers import PeerFill
from cachesvc.tiers import MemoryTier, S3Tier

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY, S3Server, s3_args, wait_until

READ_TIMEOUT = 1.0
"""The servers' `s3.read_timeout` here, so a stalled response fails in a second, not 30."""
ATTEMPTS = 3
"""`s3.max_attempts`'s default: a stalled response is tried this many times, each timing out."""
BREAKER_SECONDS = 2.0
"""`s3.breaker_seconds`'s default: how long object storage is not tried again after it failed."""
SIZE = 300_000


@pytest.fixture
def proxy(s3: S3Server) -> Any:
    with FaultProxy(s3.endpoint).start() as running:
        yield running


def proxied_server(
    cache_server: Any, s3: S3Server, prefix: str, proxy: FaultProxy, *args: str, env: dict[str, str] | None = None
) -> Any:
    flags = s3_args(s3, prefix)
    flags[flags.index("--s3-endpoint") + 1] = proxy.endpoint
    env = {"CACHESVC_S3_READ_TIMEOUT": str(READ_TIMEOUT), "CACHESVC_S3_CONNECT_TIMEOUT": "1.0", **(env or {})}
    return cache_server("--l1-bytes", "64MiB", *flags, *args, env=env)


def put_object(s3: S3Server, name: str, value: bytes) -> str:
    """Writes an object straight to S3, as a dataset's producer would; returns its ETag."""
    response = s3.client().put_object(Bucket=s3.bucket, Key=name, Body=value)
    return str(response["ETag"])


def timed_get(client: CacheClient, key: str) -> tuple[bytes | CacheClientError | None, float]:
    began = time.monotonic()
    try:
        result: bytes | CacheClientError | None = client.get(key)
    except CacheClientError as exc:
        result = exc
    return result, time.monotonic() - began


def reads(client: CacheClient, key: str, value: bytes) -> bool:
    """Whether `key` reads as `value` now; any other bytes fail the test, an error is a "not yet"."""
    result, _ = timed_get(client, key)
    if isinstance(result, CacheClientError):
        return False
    assert result == value, f"{key}: other bytes than its object's"
    return True


# (fault, its settings, the words a failure's message names it by)
FAULTS: dict[str, tuple[Fault, dict[str, Any], str]] = {
    "latency": (Fault.LATENCY, {"delay": 0.3}, ""),
    "reset": (Fault.RESET, {"after": 1000}, "unreachable"),
    "truncate": (Fault.TRUNCATE, {"after": 1000}, "unreachable"),
    "503": (Fault.STATUS, {"status": 503}, "answered 503"),
    "stall": (Fault.STALL, {"after": 1000}, "unreachable"),
}


@pytest.mark.parametrize("name", list(FAULTS))
@pytest.mark.parametrize("client_kind", ["obstore", "boto3"])
def test_a_miss_under_a_fault_reads_the_right_bytes_or_fails_clearly(
    name: str, client_kind: str, cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """Both of the tier's S3 clients: obstore, and boto3 for names obstore cannot address ("a//b")."""
    fault, settings, named = FAULTS[name]
    separator = "/" if client_kind == "obstore" else "//"
    values = {f"{name}{separator}{i}": os.urandom(SIZE) for i in range(4)}
    for key, value in values.items():
        put_object(s3, s3_prefix + key, value)
    client = proxied_server(cache_server, s3, s3_prefix, proxy).client()
    keys = list(values)
    assert client.get(keys[2]) == values[keys[2]]  # the server's first S3 request opens its client
    result, seconds = timed_get(client, keys[3])
    assert result == values[keys[3]]
    print(f"\nno fault ({client_kind}): read in {seconds * 1000:.0f} ms")

    # Once: the tier's retries read the object whole.
    proxy.set(fault, methods=("GET",), times=1, **settings)
    result, seconds = timed_get(client, keys[0])
    assert result == values[keys[0]], f"{name} once: {result!r:.200}"
    assert proxy.injected[fault.value] == 1
    print(f"{name} once ({client_kind}): read right in {seconds * 1000:.0f} ms")

    # Every time: the right bytes (latency) or a clear error, never other bytes.
    proxy.set(fault, methods=("GET",), **settings)
    result, seconds = timed_get(client, keys[1])
    if fault is Fault.LATENCY:
        assert result == values[keys[1]]
    else:
        assert isinstance(result, UnavailableError | DeadlineError | CorruptValueError), repr(result)
        assert named in str(result), str(result)
    print(f"{name} always ({client_kind}): {type(result).__name__} in {seconds * 1000:.0f} ms")
    proxy.clear()

    # After: each key reads right, filled from S3 once (nothing partial was cached), then from memory.
    wait_until(lambda: reads(client, keys[1], values[keys[1]]), 3 * BREAKER_SECONDS, f"{keys[1]} after {name}")
    for key, value in values.items():
        assert client.get_with_tier(key) in ((value, "l3"), (value, "l1"))
        assert client.get_with_tier(key) == (value, "l1")


def test_a_bucket_that_throttles_uploads_still_serves_misses(
    cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """503 to every PUT opens the breaker for writes only: the next put fails fast, a miss still reads S3."""
    value = os.urandom(SIZE)
    put_object(s3, s3_prefix + "throttled/in-s3", value)
    client = proxied_server(cache_server, s3, s3_prefix, proxy).client()
    proxy.set(Fault.STATUS, methods=("PUT",), status=503)
    with pytest.raises(UnavailableError, match="answered 503"):
        client.put("throttled/new", b"refused")
    began = time.monotonic()
    with pytest.raises(UnavailableError, match="not tried again"):
        client.put("throttled/next", b"refused at once")
    assert time.monotonic() - began < BREAKER_SECONDS / 2
    assert client.get_with_tier("throttled/in-s3") == (value, "l3")
    proxy.clear()


@pytest.mark.parametrize("name", ["reset", "503"])
def test_a_put_whose_answer_is_lost_leaves_no_old_value_cached(
    name: str, cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """A write-through put that fails may still have reached S3: the cache must not keep serving the old bytes.

    The reset is injected after S3 stored the object, before its answer
    (the proxy forwards the whole request); a 503 is answered by the proxy,
    so there S3 keeps the old bytes. Either way, once the put has failed, a
    read returns what S3 holds.
    """
    client = proxied_server(cache_server, s3, s3_prefix, proxy).client()
    old, new = b"old " * 1000, b"new " * 1000
    client.put("k", old)
    assert client.get_with_tier("k") == (old, "l1")
    proxy.set(Fault.RESET if name == "reset" else Fault.STATUS, methods=("PUT",), after=-1)
    with pytest.raises(UnavailableError):
        client.put("k", new)
    proxy.clear()
    held = s3.client().get_object(Bucket=s3.bucket, Key=s3_prefix + "k")["Body"].read()
    assert held == (new if name == "reset" else old)
    wait_until(lambda: reads(client, "k", held), 3 * BREAKER_SECONDS, "the key read from S3 again")
    assert client.get_with_tier("k") == (held, "l1")
    assert client.stats()["counters"]["puts_failed_dropped"] == 1


def ranged_tier(endpoint: str, s3: S3Server, prefix: str) -> S3Tier:
    """The S3 tier reading in 100 kB ranges, so a 300 kB object takes three GETs (the server's is 8 MiB)."""
    return S3Tier(
        endpoint=endpoint,
        bucket=s3.bucket,
        prefix=prefix,
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
        read_timeout=READ_TIMEOUT,
        part_bytes=100_000,
    )


@pytest.mark.parametrize("name", [n for n in FAULTS if n != "latency"])
def test_a_fault_in_a_later_range_never_yields_a_stitched_or_short_value(
    name: str, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    fault, settings, named = FAULTS[name]
    value = os.urandom(SIZE)
    put_object(s3, s3_prefix + "big", value)
    once = ranged_tier(proxy.endpoint, s3, s3_prefix)
    proxy.set(fault, methods=("GET",), skip=1, times=1, **settings)
    entry = once.get(b"big")
    assert entry is not None and entry.value == value
    assert proxy.injected[fault.value] == 1
    always = ranged_tier(proxy.endpoint, s3, s3_prefix)
    proxy.set(fault, methods=("GET",), skip=1, **settings)
    with pytest.raises(TierUnavailable, match=named):
        always.get(b"big")
    proxy.clear()
    for tier in (once, always):
        tier.close()


def test_an_object_replaced_between_its_ranges_is_read_again_whole(
    s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """The later ranges are pinned to the first one's ETag: a replacement in between is never stitched in."""
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    put_object(s3, s3_prefix + "big", old)
    tier = ranged_tier(proxy.endpoint, s3, s3_prefix)
    proxy.set(Fault.LATENCY, methods=("GET",), skip=1, times=2, delay=1.0)  # the two later ranges wait
    result: list[Any] = []
    reader = threading.Thread(target=lambda: result.append(tier.get(b"big")))
    reader.start()
    wait_until(lambda: proxy.injected["latency"] == 2, 5, "both later ranges held")
    put_object(s3, s3_prefix + "big", new)
    reader.join(30)
    assert result and result[0] is not None and result[0].value == new
    assert proxy.requests["GET"] >= 6  # three ranges, then three again
    tier.close()


def test_a_stalled_miss_fails_after_its_attempts_time_out_and_the_next_misses_fail_fast(
    cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """The breaker: once a miss waited out its attempts' read timeouts, misses fail at once, not each waiting.

    For `s3.breaker_seconds` (3 here): then S3 is tried again.
    """
    breaker = 3.0
    for i in range(6):
        put_object(s3, f"{s3_prefix}cold/{i}", b"cold %d" % i)
    env = {"CACHESVC_S3_BREAKER_SECONDS": str(breaker)}
    client = proxied_server(cache_server, s3, s3_prefix, proxy, env=env).client()
    proxy.set(Fault.STALL, methods=("GET",))
    first, first_seconds = timed_get(client, "cold/0")
    opened = time.monotonic()  # the server opened its breaker just before answering
    assert isinstance(first, UnavailableError), repr(first)
    assert READ_TIMEOUT * ATTEMPTS * 0.9 < first_seconds < READ_TIMEOUT * ATTEMPTS + 2.0
    fast = []
    for i in range(1, 6):
        result, seconds = timed_get(client, f"cold/{i}")
        assert isinstance(result, UnavailableError) and "not tried again for 3 s" in str(result), repr(result)
        fast.append(seconds)
    assert max(fast) < READ_TIMEOUT / 10, fast
    print(f"\nstall: first miss failed in {first_seconds:.2f} s, the next in at most {max(fast) * 1000:.1f} ms")
    proxy.clear()
    wait_until(lambda: reads(client, "cold/1", b"cold 1"), 3 * breaker, "S3 read again after the breaker")
    assert time.monotonic() - opened > breaker - 0.5  # not before the breaker closed


def test_s3_down_hits_served_misses_fail_fast_and_write_back_uploads_on_return(
    cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    config = tmp_path / "cachesvc.toml"
    config.write_text('[[namespaces]]\nprefix = "wb/"\nwrite_mode = "write-back"\n')
    server = proxied_server(cache_server, s3, s3_prefix, proxy, "--config", str(config))
    client = server.client()
    hot = {f"hot/{i}": os.urandom(10_000) for i in range(8)}
    for key, value in hot.items():
        client.put(key, value)  # write-through: in S3 and cached
    put_object(s3, s3_prefix + "cold", b"never read before")

    proxy.set(Fault.DOWN)
    for key, value in hot.items():
        assert client.get_with_tier(key) == (value, "l1")
    misses = []
    for _ in range(5):
        result, seconds = timed_get(client, "cold")
        assert isinstance(result, UnavailableError) and "unreachable" in str(result), repr(result)
        misses.append(seconds)
    with pytest.raises(UnavailableError):
        client.put("hot/new", b"write-through needs S3")
    written = {f"wb/{i}": os.urandom(5_000 + i) for i in range(40)}
    for key, value in written.items():
        client.put(key, value)  # acknowledged from the cache
    for key, value in written.items():
        assert client.get(key) == value
    first, fast = misses[0] * 1000, max(misses[1:]) * 1000
    print(f"\nS3 down: first miss failed in {first:.0f} ms, the next in at most {fast:.1f} ms")
    assert misses[0] < 3.0 and max(misses[1:]) < 0.1, misses
    assert proxy.requests["PUT"] == len(hot)  # nothing reached S3 while it was down

    proxy.clear()
    s3_client = s3.client()

    def uploaded(key: str, value: bytes) -> bool:
        try:
            body = s3_client.get_object(Bucket=s3.bucket, Key=s3_prefix + key)["Body"].read()
        except s3_client.exceptions.NoSuchKey:
            return False
        assert body == value, f"{key}: S3 holds other bytes"
        return True

    began = time.monotonic()
    wait_until(lambda: all(uploaded(k, v) for k, v in written.items()), 60, "every acknowledged write-back value in S3")
    print(f"S3 back: {len(written)} write-back values uploaded within {time.monotonic() - began:.1f} s")
    wait_until(
        lambda: reads(client, "cold", b"never read before"), 3 * BREAKER_SECONDS, "a miss filled once S3 is back"
    )


def test_with_revalidation_off_a_replaced_object_is_served_from_the_cache_until_evicted(
    cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy
) -> None:
    """`s3.revalidate_seconds = 0` (the default): cached values are taken to be immutable, a hit never asks S3."""
    old, new = b"old " * 1000, b"new " * 1000
    old_etag = put_object(s3, s3_prefix + "replaced", old)
    client = proxied_server(cache_server, s3, s3_prefix, proxy).client()
    assert client.get_with_tier("replaced") == (old, "l3")
    new_etag = put_object(s3, s3_prefix + "replaced", new)
    assert new_etag == f'"{hashlib.md5(new).hexdigest()}"' != old_etag
    requests = sum(proxy.requests.values())
    assert client.get_with_tier("replaced") == (old, "l1")
    assert sum(proxy.requests.values()) == requests  # answered from memory, S3 not asked
    client.evict("replaced")
    assert client.get_with_tier("replaced") == (new, "l3")


def revalidating_server(
    cache_server: Any, s3: S3Server, prefix: str, proxy: FaultProxy, l2: Path, window: float, **env_extra: str
) -> Any:
    """A server behind `proxy` with its L2 in `l2`, revalidating what it serves every `window` seconds."""
    env = {"CACHESVC_S3_REVALIDATE_SECONDS": str(window), **env_extra}
    return proxied_server(cache_server, s3, prefix, proxy, "--l2-path", str(l2), "--l2-bytes", "64MiB", env=env)


def test_a_replaced_object_is_not_served_stale_past_revalidate_seconds(
    cache_server: Any, s3: S3Server, s3_prefix: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    window = 3.0  # wide enough that a loaded 2-core machine answers the first reads inside it
    server = revalidating_server(cache_server, s3, s3_prefix, proxy, tmp_path / "l2", window)
    client = server.client()
    values = {f"rv/{name}": os.urandom(20_000) for name in ("replaced", "same", "deleted", "ours")}
    for key, value in values.items():
        if key == "rv/ours":
            client.put(key, value)  # written through the cache: our checksum in its metadata
        else:
            put_object(s3, s3_prefix + key, value)
    filled_at = time.monotonic()
    assert client.get_many(list(values)) == list(values.values())
    new = os.urandom(20_000)
    put_object(s3, s3_prefix + "rv/replaced", new)
    s3.client().delete_object(Bucket=s3.bucket, Key=s3_prefix + "rv/deleted")

    # Inside the window: the cached bytes, S3 not asked.
    requests = sum(proxy.requests.values())
    assert client.get_with_tier("rv/replaced") == (values["rv/replaced"], "l1")
    assert time.monotonic() - filled_at < window, "the machine is too slow for this window"
    assert sum(proxy.requests.values()) == requests

    # Past it: one HEAD each; the replaced object is read again, the deleted one is a miss, the others stay.
    time.sleep(window)
    assert client.get_with_tier("rv/replaced") == (new, "l3")
    assert client.get("rv/deleted") is None
    began = time.monotonic()
    assert client.get_with_tier("rv/same") == (values["rv/same"], "l1")  # its HEAD matched
    checked = time.monotonic() - began
    began = time.monotonic()
    assert client.get_with_tier("rv/same") == (values["rv/same"], "l1")
    hit = time.monotonic() - began
    print(f"\nrevalidation: a due hit took {checked * 1000:.1f} ms, the next {hit * 1000:.1f} ms")
    assert client.get_many(["rv/ours"]) == [values["rv/ours"]]
    assert proxy.requests["HEAD"] == 4
    assert client.get_with_tier("rv/replaced") == (new, "l1")  # checked just now: no HEAD
    assert proxy.requests["HEAD"] == 4
    counters = client.stats()["counters"]
    assert (counters["revalidations"], counters["revalidation_refills"]) == (4, 2), counters

    # S3 down when a check is due: the cached value is served, and checked once S3 is back.
    time.sleep(window)
    proxy.set(Fault.DOWN)
    assert client.get_with_tier("rv/same") == (values["rv/same"], "l1")
    proxy.clear()
    wait_until(lambda: client.stats()["counters"]["revalidation_errors"] >= 1, 5, "the failed check counted")
    time.sleep(BREAKER_SECONDS)
    put_object(s3, s3_prefix + "rv/same", new)
    assert client.get_with_tier("rv/same") == (new, "l3")

    # A restart keeps L2 but not the record of when each value was checked: the first hit checks. Here with
    # one HEAD per copy (`s3.vouch_listings = 0`); the bulk check from listings, which would drop the rewritten
    # copy before anything asks, is tests/test_restart_vouching.py's.
    stopped = server.stop(grace=60.0)
    assert stopped == 0, f"the server did not stop cleanly (L1 is kept in L2 only then):\n{server.log()}"
    put_object(s3, s3_prefix + "rv/ours", new)
    restarted = revalidating_server(
        cache_server, s3, s3_prefix, proxy, tmp_path / "l2", window, CACHESVC_S3_VOUCH_LISTINGS="0"
    ).client()
    heads = proxy.requests["HEAD"]
    # The old bytes are in L2; asking whether they are uploaded checks the unvouched copy (one HEAD).
    assert restarted.contains("rv/ours", cached_only=True)
    assert restarted.get_with_tier("rv/ours") == (new, "l3")
    assert restarted.get_with_tier("rv/replaced") == (new, "l2")  # unchanged: served from L2 after its check
    assert proxy.requests["HEAD"] == heads + 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def clocked_engine(
    s3: S3Server, s3_prefix: str, clock: Clock, endpoint: str = "", l1_bytes: int = 8 << 20, **kwargs: Any
) -> Engine:
    """An engine on `clock` with an L1 of `l1_bytes` over `s3` (through `endpoint`, a proxy, when given)."""
    tier = S3Tier(
        endpoint=endpoint or s3.endpoint,
        bucket=s3.bucket,
        prefix=s3_prefix,
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
    )
    return Engine(
        l1=MemoryTier(l1_bytes), l2=None, l3=tier, policy_factory=lambda _: LRUPolicy(), clock=clock, **kwargs
    )


def test_the_engine_revalidates_on_its_clock_and_keeps_what_matches(s3: S3Server, s3_prefix: str) -> None:
    """The engine alone, on an injected clock: single gets and get_many, fills, puts and write-back."""
    clock = Clock()
    engine = clocked_engine(
        s3, s3_prefix, clock, namespaces=[Namespace(b"wb/", WriteMode.WRITE_BACK)], revalidate_seconds=10.0
    )
    try:
        for name in ("a", "b"):
            put_object(s3, f"{s3_prefix}{name}", b"old " + name.encode())
        engine.put(b"through", b"written through")
        engine.put(b"wb/back", b"written back")
        wait_until(lambda: engine.stats()["counters"]["dirty_keys"] == 0, 30, "the write-back upload")
        assert [hit and hit.tier for hit in engine.get_many([b"a", b"b"])] == ["l3", "l3"]
        for name in ("a", "b"):
            put_object(s3, f"{s3_prefix}{name}", b"new " + name.encode())

        clock.now += 9.0
        assert engine.get(b"a") == Hit(b"old a", checksum(b"old a"), "l1")
        assert engine.counters["revalidations"] == 0
        clock.now += 1.0
        assert engine.get(b"a") == Hit(b"new a", checksum(b"new a"), "l3")
        assert [hit and hit.value for hit in engine.get_many([b"b", b"through", b"wb/back"])] == [
            b"new b",
            b"written through",
            b"written back",
        ]
        assert (engine.counters["revalidations"], engine.counters["revalidation_refills"]) == (4, 2)
        # What matched stays cached and counts as checked now.
        assert [hit and hit.tier for hit in engine.get_many([b"through", b"wb/back"])] == ["l1", "l1"]
        assert engine.counters["revalidations"] == 4
    finally:
        engine.close()


def test_revalidation_needs_a_tier_that_can_tell() -> None:
    with pytest.raises(ValueError, match="revalidate_seconds"):
        Engine(
            l1=MemoryTier(1 << 20),
            l2=None,
            l3=MemoryTier(1 << 20, name="l3"),
            policy_factory=lambda _: LRUPolicy(),
            revalidate_seconds=1.0,
        )


def test_concurrent_hits_on_a_due_key_make_one_check(s3: S3Server, s3_prefix: str, proxy: FaultProxy) -> None:
    clock = Clock()
    engine = clocked_engine(s3, s3_prefix, clock, proxy.endpoint, l1_bytes=1 << 20, revalidate_seconds=5.0)
    try:
        put_object(s3, s3_prefix + "hot", b"hot value")
        assert engine.get(b"hot") is not None
        clock.now += 5.0
        proxy.set(Fault.LATENCY, methods=("HEAD",), delay=0.3)  # the check is slow: the others arrive during it
        with ThreadPoolExecutor(8) as pool:
            hits = list(pool.map(lambda _: engine.get(b"hot"), range(16)))
        assert all(hit is not None and hit.value == b"hot value" for hit in hits)
        assert proxy.requests["HEAD"] == 1
        assert engine.counters["revalidations"] == 1
    finally:
        engine.close()


def test_revalidation_works_with_peers_in_the_fill_chain(s3: S3Server, s3_prefix: str) -> None:
    """In a cluster the engine asks peers first on a miss (`PeerFill`); object storage still revalidates."""
    tier = S3Tier(endpoint=s3.endpoint, bucket=s3.bucket, prefix=s3_prefix)
    engine = Engine(
        l1=MemoryTier(1 << 20),
        l2=None,
        l3=tier,
        fill_sources=[PeerFill(cast(Any, None))],
        policy_factory=lambda _: LRUPolicy(),
        revalidate_seconds=1.0,
    )
    engine.close()


def test_a_missing_bucket_is_a_clear_error_not_a_miss(cache_server: Any, s3: S3Server, s3_prefix: str) -> None:
    """A server pointed at a bucket that does not exist (a typo, a bucket deleted under it) answers a read
    with FAILED_PRECONDITION naming the bucket, for whole objects and byte ranges alike, and a
    write-through put too, and keeps serving: a missing bucket read as a missing object would hand
    the user a miss for data that is only out of reach."""
    args = ["--s3-endpoint", s3.endpoint, "--s3-bucket", "no-such-bucket-here", "--s3-prefix", s3_prefix]
    server = cache_server(*args)
    with server.client() as client:
        for key in (b"an-object", range_key(b"an-object", 0, 99)) * 2:  # and again: the server goes on
            with pytest.raises(CacheClientError) as caught:
                client.get(key)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, caught.value
            assert "bucket 'no-such-bucket-here' does not exist" in str(caught.value), caught.value
        with pytest.raises(CacheClientError) as caught:
            client.put(b"a-write", b"v")  # write-through: it must reach the bucket
        # SeaweedFS refuses a PUT to a missing bucket (403 AccessDenied) rather than say it is missing.
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, caught.value
        assert "refused (AccessDenied) in bucket 'no-such-bucket-here'" in str(caught.value), caught.value
    assert server.process is not None and server.process.alive()
