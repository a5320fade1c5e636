"""A restarted cache server vouches for its L2 copies from listings, not one HEAD per key (issue 49).

Real processes: SeaweedFS behind a request-counting proxy (`bench/latency_proxy.py`), `cachesvc serve`
stopped (SIGTERM) or killed (SIGKILL) and started again on its L2. And the pure core of
`cachesvc.engine.vouching` against a naive reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheclient.wire.record import checksum
from cachesvc.devcluster.seaweed import S3_ACCESS_KEY, S3_SECRET_KEY
from cachesvc.engine.versions import stamp
from cachesvc.engine.vouching import Copy, Verdict, before, covered, decide
from cachesvc.tiers import S3Tier
from cachesvc.tiers.base import ListedObject
from tests.conftest import CacheServer, S3Server, s3_args, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from latency_proxy import LatencyProxy

pytestmark = pytest.mark.timeout(180)


# -- the pure core --------------------------------------------------------------------------------------


def _listed(name: str, value: bytes, etag: str | None = None) -> ListedObject:
    return ListedObject(name, etag or hashlib.md5(value).hexdigest(), len(value), 0.0)


def test_a_listing_entry_vouches_only_for_the_same_bytes() -> None:
    value = b"v" * 100
    copy = Copy("p/k", len(value), hashlib.md5(value).hexdigest())
    assert decide(copy, _listed("p/k", value)) is Verdict.KEEP
    assert decide(copy, _listed("p/k", value, hashlib.md5(value).hexdigest().upper())) is Verdict.KEEP
    assert decide(copy, None) is Verdict.DROP  # gone
    assert decide(copy, _listed("p/k", b"w" * 100)) is Verdict.DROP  # rewritten, same size
    assert decide(copy, _listed("p/k", b"v" * 101)) is Verdict.DROP  # another size
    # Uploaded in parts: the ETag is no MD5 of the bytes; only a HEAD (our checksum metadata) can tell.
    assert decide(copy, _listed("p/k", value, "0123456789abcdef0123456789abcdef-3")) is Verdict.ASK


def test_a_page_decides_exactly_the_names_it_covers() -> None:
    """`covered` against a naive reference: a name is decided when it is after the page's start and not past
    a truncated page's last entry; `before(name)` always lists `name` itself."""
    rng = random.Random(49)
    alphabet = "ab/0é\u00ff"
    for _ in range(500):
        bucket = sorted({"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(0, 30))})
        ours = sorted(rng.sample(bucket, k=min(len(bucket), rng.randint(0, 10))))
        ours += sorted({"".join(rng.choices(alphabet, k=3)) for _ in range(3)} - set(bucket))  # gone
        ours = sorted(set(ours))
        if not ours:
            continue
        start = before(ours[0])
        assert start < ours[0]
        limit = rng.randint(1, 8)
        after = [n for n in bucket if n > start]
        page, more = after[:limit], len(after) > limit
        listed = [ListedObject(n, "", 0, 0.0) for n in page]
        done, found = covered(ours, start, listed, more)
        reference = [n for n in ours if not more or (page and n <= page[-1])]
        assert ours[:done] == reference
        for name in reference:
            assert (name in found) == (name in bucket)  # shown when it exists; absent (gone) when not


# -- real processes -------------------------------------------------------------------------------------


@pytest.fixture
def counted_s3(s3: S3Server) -> Iterator[tuple[S3Server, LatencyProxy]]:
    """The shared SeaweedFS behind a proxy that counts the HTTP requests sent to it (no delay)."""
    proxy = LatencyProxy(s3.endpoint.removeprefix("http://"), delay=0.0).start()
    try:
        yield S3Server(proxy.endpoint, s3.bucket, s3.weed), proxy
    finally:
        proxy.stop()


KEYS = 2000
REWRITTEN, DELETED = "r/000777", "r/001234"


def _server(s3: S3Server, prefix: str, l2: Path, logs: Path) -> CacheServer:
    args = ["--l1-bytes", "0", "--l2-path", str(l2), "--l2-bytes", "256MiB", *s3_args(s3, prefix)]
    return CacheServer(args, logs).start()


def _other_node(s3: S3Server, prefix: str) -> S3Tier:
    """Object storage as another node writes it (the key's owner while this one was down)."""
    return S3Tier(endpoint=s3.endpoint, bucket=s3.bucket, prefix=prefix, access_key=S3_ACCESS_KEY,
                  secret_key=S3_SECRET_KEY)  # fmt: skip


def _read_all(client: Any, keys: list[str]) -> dict[str, tuple[bytes, str] | None]:
    served: dict[str, tuple[bytes, str] | None] = {}
    for i in range(0, len(keys), 64):
        for key, hit in zip(keys[i : i + 64], client.get_many(keys[i : i + 64]), strict=True):
            served[key] = None if hit is None else (hit, "")
    return served


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_restarted_server_serves_its_l2_with_a_listing_per_page_and_nothing_stale(
    counted_s3: tuple[S3Server, LatencyProxy], s3_prefix: str, tmp_path: Path, how: str
) -> None:
    """2,000 keys in L2; while the server is down, one object is rewritten through another node and one is
    deleted, in the middle of the keys. After the restart every key reads right (the rewritten one new, the
    deleted one missing) with far fewer S3 requests than keys: listings, not a HEAD each."""
    s3, proxy = counted_s3
    server = _server(s3, s3_prefix, tmp_path / "l2", tmp_path / "logs")
    keys = [f"r/{i:06d}" for i in range(KEYS)]
    values = {key: os.urandom(1024) for key in keys}
    client = server.client()
    for i in range(0, KEYS, 200):
        client.put_many({k: values[k] for k in keys[i : i + 200]})
    assert {t["name"]: t for t in client.stats()["tiers"]}["l2"]["entries"] == KEYS  # every value is in L2
    if how == "sigterm":
        assert server.stop() == 0
    else:
        server.kill()
    other = _other_node(s3, s3_prefix)
    new = os.urandom(1024)  # the same size: only the bytes tell
    other.put(REWRITTEN.encode(), new, checksum(new), version=stamp(int(time.time() * 1000)))
    other.delete(DELETED.encode())
    other.close()

    before_requests = proxy.requests
    server = _server(s3, s3_prefix, tmp_path / "l2", tmp_path / "logs")
    client = server.client()
    served = _read_all(client, keys)
    requests = proxy.requests - before_requests
    assert served[REWRITTEN] == (new, "")
    assert served[DELETED] is None
    wrong = [k for k in keys if k not in (REWRITTEN, DELETED) and served[k] != (values[k], "")]
    assert not wrong, f"{len(wrong)} keys read wrong, e.g. {wrong[:3]}"
    counters = client.stats()["counters"]
    # A page per 1,000 keys (walked in the background and by the reads, which may overlap), plus the rewritten
    # and deleted keys' fills: not one HEAD per key (2,000 before).
    assert requests <= 20, f"{requests} S3 requests for {KEYS} keys"
    assert counters.get("vouch_checks", 0) == 0
    assert counters["vouch_listed"] == KEYS - 2 and counters["vouch_list_drops"] == 2
    assert counters["hits_l2"] >= KEYS - 2  # served from L2, not read again from S3
    # What an operator sees: the node's check of its copies, done, and the line it logged when it was.
    status = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", "--cache", server.address, "status", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    (node,) = json.loads(status.stdout)["nodes"]
    assert node["vouching"]["held"] == KEYS and node["vouching"]["checked"] == KEYS and node["vouching"]["done"]
    text = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", "--cache", server.address, "status"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert f"{KEYS:,} of {KEYS:,} cached copies checked against S3" in text.stdout, text.stdout
    wait_until(lambda: "every cached copy is vouched for" in server.log(), 10, "the node's log line")
    server.stop()


def test_with_s3_unreachable_at_restart_no_copy_is_served_unchecked(
    counted_s3: tuple[S3Server, LatencyProxy], s3_prefix: str, tmp_path: Path
) -> None:
    """S3 cannot be reached when the server comes back: its L2 copies are not served (UNAVAILABLE), the
    rewritten one included; once S3 is back, the reads vouch from listings and the rewritten key reads new."""
    from cacheclient.errors import UnavailableError

    s3, proxy = counted_s3
    server = _server(s3, s3_prefix, tmp_path / "l2", tmp_path / "logs")
    keys = [f"r/{i:06d}" for i in range(200)]
    values = {key: os.urandom(512) for key in keys}
    server.client().put_many(values)
    assert server.stop() == 0
    other = _other_node(s3, s3_prefix)
    new = os.urandom(512)
    other.put(keys[100].encode(), new, checksum(new), version=stamp(int(time.time() * 1000)))
    other.close()

    proxy.cut(refuse=True)
    server = _server(s3, s3_prefix, tmp_path / "l2", tmp_path / "logs")
    client = server.client(timeout=20.0)
    for key in (keys[100], keys[0]):
        with pytest.raises(UnavailableError):
            client.get(key)
    assert client.stats()["counters"].get("vouch_listed", 0) == 0
    proxy.heal()

    def read_new() -> bool:
        try:
            return client.get(keys[100]) == new
        except UnavailableError:
            return False  # the S3 tier's breaker is still open

    wait_until(read_new, 30, "the rewritten key read from S3 once it is back")
    assert [client.get(k) for k in keys if k != keys[100]] == [values[k] for k in keys if k != keys[100]]
    assert client.stats()["counters"]["vouch_listed"] == len(keys) - 1
    server.stop()


def test_an_immutable_namespace_refuses_an_overwrite_and_with_checkpoint_chunks_needs_no_s3_after_a_restart(
    counted_s3: tuple[S3Server, LatencyProxy], s3_prefix: str, tmp_path: Path
) -> None:
    """Keys of a namespace declared `immutable = true` are written once: a put over one is refused
    (FAILED_PRECONDITION), and after a restart its copies are served with no S3 request at all; so are
    content-addressed values (checkpoint chunks, named by their xxh3-128) in an ordinary namespace."""
    import grpc
    import xxhash

    from cacheclient.errors import CacheClientError

    s3, proxy = counted_s3
    config = tmp_path / "cachesvc.toml"
    config.write_text('[[namespaces]]\nprefix = "ds/"\nimmutable = true\n')
    args = ["--config", str(config), "--l1-bytes", "0", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "64MiB",
            *s3_args(s3, s3_prefix)]  # fmt: skip
    server = CacheServer(args, tmp_path / "logs").start()
    client = server.client()
    dataset = {f"ds/{i:05d}": os.urandom(700) for i in range(300)}
    client.put_many(dataset)
    chunks = {}
    for _ in range(100):
        value = os.urandom(900)
        chunks[f"ckpt/chunks/run/~/{xxhash.xxh3_128_hexdigest(value)}"] = value
    client.put_many(chunks)
    with pytest.raises(CacheClientError) as refused:
        client.put("ds/00007", b"another value")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "immutable" in str(refused.value)
    assert client.get("ds/00007") == dataset["ds/00007"]
    client.put("other/k", b"v1")
    client.put("other/k", b"v2")  # elsewhere, overwrites are as ever
    assert client.delete("other/k")  # (a copy of it would be checked after the restart: one listing)
    assert server.stop() == 0

    requests = proxy.requests
    server = CacheServer(args, tmp_path / "logs").start()
    client = server.client()
    keys = list(dataset) + list(chunks)
    served = _read_all(client, keys)
    assert all(served[k] == ((dataset | chunks)[k], "") for k in keys)
    counters = client.stats()["counters"]
    assert proxy.requests - requests == 0, f"{proxy.requests - requests} S3 requests"
    assert counters["vouch_by_content"] == len(chunks) and counters["hits_l2"] == len(keys)
    server.stop()


def test_a_write_back_put_that_finds_the_queue_full_is_refused_within_its_own_deadline(
    tmp_path: Path, cache_server: Any
) -> None:
    """S3 cannot take uploads, the write-back queue (2 keys) is full: the next put answers RESOURCE_EXHAUSTED
    before its own 3 s deadline, not after the server's 60 s io_timeout (nor as DEADLINE_EXCEEDED)."""
    import socket as sockets

    import grpc

    from cacheclient.errors import LimitExceededError

    with sockets.socket() as sock:  # a port nothing listens on: every upload fails and is retried
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = tmp_path / "cachesvc.toml"
    config.write_text('writeback_queue = 2\n[[namespaces]]\nprefix = "wb/"\nwrite_mode = "write-back"\n')
    server = cache_server("--config", str(config), "--l1-bytes", "16MiB", "--s3-endpoint", dead, "--s3-bucket", "b")
    client = server.client(timeout=3.0)
    refused: LimitExceededError | None = None
    for i in range(6):  # the queue holds 2, and the upload being tried (and failing) takes one out meanwhile
        began = time.monotonic()
        try:
            client.put(f"wb/{i}", b"value %d" % i)
        except LimitExceededError as exc:
            refused = exc
            break
    assert refused is not None, "6 puts were taken into a write-back queue of 2 that cannot drain"
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "write-back queue full" in str(refused)
    assert time.monotonic() - began < 3.0
    assert client.get("wb/0") == b"value 0"  # what was taken is still served


def test_a_node_back_from_a_lost_lease_rechecks_its_cached_copies_from_listings(
    counted_s3: tuple[S3Server, LatencyProxy], s3_prefix: str, tmp_path: Path
) -> None:
    """A rejoin (`Engine.suspect_cached`, what a cluster node calls when it is back after a lost lease or a
    heartbeat gap) rechecks 1,500 cached copies with listings: the key rewritten meanwhile reads new, the
    deleted one is a miss, the rest stay cached; far fewer S3 requests than keys."""
    from cachesvc.engine import Engine
    from cachesvc.policy import LRUPolicy
    from cachesvc.tiers import LMDBTier, MemoryTier

    s3, proxy = counted_s3
    node = Engine(
        l1=MemoryTier(1 << 20),
        l2=LMDBTier(tmp_path / "l2", 64 << 20),
        l3=_other_node(s3, s3_prefix),
        policy_factory=lambda _: LRUPolicy(),
    )
    try:
        keys = [f"j/{i:05d}".encode() for i in range(1500)]
        values = {key: os.urandom(1000) for key in keys}
        node.put_many([(key, value, None) for key, value in values.items()])
        other = _other_node(s3, s3_prefix)
        new = os.urandom(1000)
        other.put(keys[700], new, checksum(new), version=stamp(int(time.time() * 1000)))
        other.delete(keys[900])
        other.close()
        requests = proxy.requests
        node.suspect_cached()
        hits = list(node.get_many(keys))
        assert hits[700] is not None and hits[700].value == new
        assert hits[900] is None
        wrong = [k for k, hit in zip(keys, hits, strict=True) if k not in (keys[700], keys[900])
                 and (hit is None or hit.value != values[k])]  # fmt: skip
        assert not wrong
        assert proxy.requests - requests <= 10, f"{proxy.requests - requests} S3 requests for {len(keys)} keys"
        counters = node.stats()["counters"]
        assert counters["vouch_list_drops"] == 2 and counters["vouch_listed"] == len(keys) - 2
    finally:
        node.close()


class ListingHook(S3Tier):
    """An S3 tier that runs `after_listing` once, between a listing's answer and its use."""

    after_listing: Any = None

    def list_after(self, start_after: str, limit: int) -> tuple[list[ListedObject], bool]:
        listed = super().list_after(start_after, limit)
        hook, self.after_listing = self.after_listing, None
        if hook is not None:
            hook()
        return listed


def test_a_listing_taken_before_copies_were_unvouched_anew_vouches_for_none_of_them(
    s3: S3Server, s3_prefix: str
) -> None:
    """A slot moves away and back while a listing page is in flight, and another node rewrote a key meanwhile:
    the page (which shows the old object) must not vouch for that key's old copy; the walk lists again."""
    from cachesvc.engine import Engine
    from cachesvc.policy import LRUPolicy
    from cachesvc.tiers import MemoryTier

    tier = ListingHook(endpoint=s3.endpoint, bucket=s3.bucket, prefix=s3_prefix, access_key=S3_ACCESS_KEY,
                       secret_key=S3_SECRET_KEY)  # fmt: skip
    node = Engine(l1=MemoryTier(8 << 20), l2=None, l3=tier, policy_factory=lambda _: LRUPolicy())
    try:
        keys = [f"m/{i:03d}".encode() for i in range(50)]
        node.put_many([(key, b"old " + key, None) for key in keys])
        other = _other_node(s3, s3_prefix)
        new = b"new, written elsewhere"

        def moved_away_and_back() -> None:
            other.put(keys[20], new, checksum(new), version=stamp(int(time.time() * 1000)))
            node.unvouch_cached()  # the slot came back: every copy unvouched anew

        tier.after_listing = moved_away_and_back
        node.unvouch_cached()  # the slot moved away (the walk's first listing runs the hook)
        wait_until(lambda: node.stats()["counters"].get("vouch_list_drops", 0) >= 1, 20, "the stale copy dropped")
        hit = node.get(keys[20])
        assert hit is not None and hit.value == new
        assert [hit and hit.value for hit in node.get_many(keys[:20])] == [b"old " + key for key in keys[:20]]
        other.close()
    finally:
        node.close()


def test_an_undrained_node_fences_its_stand_in_before_a_listing_vouches_for_its_copies(
    s3: S3Server, tmp_path: Path
) -> None:
    """A drain undone gives a node back its keys with the copies it kept, unvouched, and its background walk
    vouches for them by listing with no client call to set off a fence. Until fenced, the stand-in may still
    take writes of those keys by the older map, which a listing sent before could miss (the Jepsen runs read a
    key's older value after an undrain so). So the walk fences the stand-in first: with no client call to the
    node, its fences go out and the stand-in counts them, and every value it then serves is the newest."""
    from tests.conftest import running_cluster

    with running_cluster(s3, tmp_path, "", [("16MiB", "64MiB"), ("16MiB", "64MiB")], meta_nodes=1) as cluster:
        a, b = cluster.servers
        client = cluster.client()
        try:
            rng = random.Random(49)
            values = {f"u/{i:04d}".encode(): rng.randbytes(2000) for i in range(400)}
            client.put_many(values)
            mine = [key for key in values if cluster.placement().locate(key) == a.address]
            assert len(mine) > 100

            def walked(since: dict[str, int], listed: bool) -> Callable[[], bool]:
                """Whether the node unvouched copies after `since` and its walk has finished (having listed some)."""

                def done() -> bool:
                    now = a.counters()
                    return (
                        now.get("unvouched", 0) > since.get("unvouched", 0)
                        and now.get("fences_sent", 0) > since.get("fences_sent", 0)  # its walk's, before any listing
                        and (not listed or now.get("vouch_listed", 0) > since.get("vouch_listed", 0))
                        and now.get("vouch_done") == 1
                    )

                return done

            start = a.counters()
            cluster.meta.set_node_state(a.address, "draining")
            cluster.wait_placement([b.address], "the drained node to leave the placement")
            # Its copies of the keys that moved away are unvouched and left to their first read: no listing.
            wait_until(walked(start, listed=False), 20, "the drained node's walk to finish")
            assert a.counters().get("vouch_listed", 0) == start.get("vouch_listed", 0)
            new = {key: rng.randbytes(2000) for key in mine[:20]}
            client.put_many(new)  # through the stand-in; the drained node keeps its older copies
            drained, fenced = a.counters(), b.counters().get("fenced", 0)

            cluster.meta.set_node_state(a.address, "up")
            cluster.wait_placement([a.address, b.address], "the node back in the placement")
            wait_until(walked(drained, listed=True), 20, "the node's copies vouched for by listing after the undrain")
            back = a.counters()
            assert back.get("fences_sent", 0) > drained.get("fences_sent", 0), "it listed before fencing its stand-in"
            assert b.counters().get("fenced", 0) > fenced
            assert back["vouch_list_drops"] - drained.get("vouch_list_drops", 0) == len(new)
            assert client.get_many(mine) == [new.get(key, values[key]) for key in mine]
        finally:
            client.close()
