"""The fill chain's contract, against the real sources: a cache server process as the peer, SeaweedFS as
object storage.

Every `FillSource` hands back the values it has among the keys asked, byte for byte and with their
checksum, and leaves out the ones it does not have; the chain asks its sources in order, each for what
the ones before it lacked, and says which one answered. A peer that cannot be reached is a miss (the
chain goes on to object storage); object storage that cannot be reached is the read's error.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from cacheclient.wire import checksum
from cacheclient.wire.placement import PlacementMap
from cachesvc.devcluster.procs import free_port
from cachesvc.engine import Engine, Hit
from cachesvc.engine.fillchain import FillChain, FillSource, ObjectStorageFill
from cachesvc.errors import TierUnavailable
from cachesvc.policy.lru import LRUPolicy
from cachesvc.server.ownership import Ownership
from cachesvc.server.peers import PeerFill
from cachesvc.tiers.memory import MemoryTier
from cachesvc.tiers.s3 import S3Tier

from conftest import S3_ACCESS_KEY, S3_SECRET_KEY, CacheServer, S3Server

pytestmark = pytest.mark.timeout(120)

ME = "127.0.0.1:1"
"""This node's address in the placements (never dialled: a fill source asks only other nodes)."""


def moved_from(peer: str) -> Ownership:
    """This node's placements after every key moved to it from `peer` (the peer owned all of them before)."""
    ownership = Ownership(ME)
    ownership.update(PlacementMap.static([peer]))
    ownership.update(PlacementMap(2, (ME,), PlacementMap.static([ME]).slots))
    return ownership


@pytest.fixture
def peer(cache_server: Any) -> CacheServer:
    """A cache server with nothing below its cache tiers: it holds only what a test puts there."""
    server: CacheServer = cache_server("--l1-bytes", "32MiB")
    return server


@pytest.fixture
def store(s3: S3Server, s3_prefix: str) -> Iterator[S3Tier]:
    tier = S3Tier(
        endpoint=s3.endpoint, bucket=s3.bucket, prefix=s3_prefix, access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY
    )
    yield tier
    tier.close()


def values(tag: str, count: int = 5) -> dict[bytes, bytes]:
    """`count` values of assorted sizes, one over a message chunk, under keys named by `tag`."""
    rng = random.Random(tag)
    sizes = [0 if i == 1 else rng.randrange(1, 50_000) for i in range(count - 1)] + [3 << 20]
    return {f"{tag}/{i}".encode(): rng.randbytes(size) for i, size in enumerate(sizes)}


def stocked_peer(peer: CacheServer, held: dict[bytes, bytes]) -> PeerFill:
    client = peer.client()
    try:
        client.put_many(held)
    finally:
        client.close()
    return PeerFill(moved_from(peer.address))


def stocked_store(store: S3Tier, held: dict[bytes, bytes]) -> ObjectStorageFill:
    for key, value in held.items():
        store.put(key, value, checksum(value))
    return ObjectStorageFill(store)


@pytest.fixture(params=["peers", "object storage"])
def stocked(request: pytest.FixtureRequest, store: S3Tier) -> Iterator[tuple[FillSource, dict[bytes, bytes]]]:
    """Each real source, holding the values of `values(...)`."""
    held = values(f"held-{request.param}")
    source: FillSource
    if request.param == "peers":
        source = stocked_peer(request.getfixturevalue("peer"), held)
    else:
        source = stocked_store(store, held)
    yield source, held
    source.close()


# ---------------------------------------------------------------------- every source


def test_a_source_returns_what_it_holds_byte_for_byte_and_leaves_out_the_rest(
    stocked: tuple[FillSource, dict[bytes, bytes]],
) -> None:
    source, held = stocked
    missing = [b"never-written/1", b"never-written/2"]
    found = source.fetch_many([*missing[:1], *held, *missing[1:]])
    assert sorted(found) == sorted(held)
    for key, entry in found.items():
        assert entry.value == held[key]
        assert entry.checksum == checksum(held[key])
        assert not entry.dirty


def test_a_source_asked_for_nothing_answers_nothing(stocked: tuple[FillSource, dict[bytes, bytes]]) -> None:
    source, _ = stocked
    assert source.fetch_many([]) == {}
    assert all(isinstance(value, int) for value in source.counters().values())


# ---------------------------------------------------------------------- the chain


def test_the_chain_asks_peers_first_then_object_storage_and_says_which_answered(
    peer: CacheServer, store: S3Tier
) -> None:
    on_peer = {b"chain/both": b"the peer's copy", b"chain/peer-only": b"only the peer has it"}
    in_store = {b"chain/both": b"object storage's copy", b"chain/store-only": b"only object storage has it"}
    chain = FillChain([stocked_peer(peer, on_peer), stocked_store(store, in_store)])
    try:
        found = chain.fetch_many([b"chain/both", b"chain/peer-only", b"chain/store-only", b"chain/nowhere"])
        assert {key: (filled.source, filled.entry.value) for key, filled in found.items()} == {
            b"chain/both": ("peers", b"the peer's copy"),
            b"chain/peer-only": ("peers", b"only the peer has it"),
            b"chain/store-only": ("l3", b"only object storage has it"),
        }
        assert chain.fetch(b"chain/nowhere") is None
        counters = chain.counters()
        assert counters["peer_fills"] == 2 and counters["peer_misses"] >= 2, counters
    finally:
        chain.close()


def test_a_peer_that_cannot_be_reached_is_a_miss_and_object_storage_answers(store: S3Tier) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    peers = PeerFill(moved_from(dead), timeout=1.0)
    chain = FillChain([peers, stocked_store(store, {b"dead-peer/k": b"from object storage"})])
    try:
        filled = chain.fetch(b"dead-peer/k")
        assert filled is not None and (filled.source, filled.entry.value) == ("l3", b"from object storage")
        assert peers.counters()["peer_errors"] == 1
        # Backing off: the dead peer is not asked again at once.
        assert chain.fetch(b"dead-peer/k") is not None
        assert peers.counters()["peer_errors"] == 1
    finally:
        chain.close()


def test_object_storage_that_cannot_be_reached_fails_the_read() -> None:
    down = S3Tier(
        endpoint=f"http://127.0.0.1:{free_port()}",
        bucket="b",
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
        connect_timeout=0.5,
        max_attempts=1,
    )
    chain = FillChain([ObjectStorageFill(down)])
    try:
        with pytest.raises(TierUnavailable):
            chain.fetch_many([b"k"])
    finally:
        chain.close()
        down.close()


def test_the_engine_fills_a_miss_through_the_chain_and_reports_its_counters(peer: CacheServer, store: S3Tier) -> None:
    peers = stocked_peer(peer, {b"engine/k": b"the peer's copy"})
    # A peer's copy is kept only when object storage holds those bytes (a listing page; issue 49).
    store.put(b"engine/k", b"the peer's copy", checksum(b"the peer's copy"))
    engine = Engine(
        l1=MemoryTier(1 << 20), l2=None, l3=store, fill_sources=[peers], policy_factory=lambda _: LRUPolicy()
    )
    try:
        hit = engine.get(b"engine/k")
        assert hit is not None and hit.value == b"the peer's copy"
        assert engine.get(b"engine/k") == Hit(hit.value, hit.checksum, "l1")
        counters = engine.stats()["counters"]
        assert counters["peer_fills"] == 1 and counters["fills"] == 1, counters
        assert counters["peer_fills_listed"] == 1 and "peer_fills_refused" not in counters, counters
    finally:
        engine.close()


def test_a_moves_copies_are_checked_a_listing_page_at_a_time_and_never_by_a_page_older_than_a_write(
    peer: CacheServer, store: S3Tier
) -> None:
    """A node given 300 keys by a move checks the copies their previous owner gives with listing pages (one
    request for up to 1,000 names), not a HEAD each; a copy older than its object is refused. A page
    shows object storage as it was when sent: after this node rewrites or deletes a key, a previous owner's
    older copy of it is refused however fresh the page (a new page is listed), never served."""
    held = {f"moved/{i:04d}".encode(): f"old value {i}".encode() * 20 for i in range(300)}
    stale = b"moved/0007"
    for key, value in held.items():
        stored = value if key != stale else b"rewritten in S3 after the peer cached it"
        store.put(key, stored, checksum(stored))
    peers = stocked_peer(peer, held)
    engine = Engine(
        l1=MemoryTier(8 << 20), l2=None, l3=store, fill_sources=[peers], policy_factory=lambda _: LRUPolicy()
    )
    try:
        hits = engine.get_many(list(held))
        assert [hit and hit.value for hit in hits] == [
            value if key != stale else b"rewritten in S3 after the peer cached it" for key, value in held.items()
        ]
        counters = engine.stats()["counters"]
        assert counters["peer_fills_listed"] == 300 and "peer_fills_checked" not in counters, counters
        # One page covers every name; fills running at once may each list before the first page is kept.
        assert counters["peer_fill_listings"] <= 8 and counters["peer_fills_refused"] == 1, counters

        # Rewritten through this node (the key's owner now); its previous owner still holds the older copy,
        # and the page listed above is still fresh.
        rewritten = b"moved/0100"
        engine.put(rewritten, b"new value")
        assert engine.evict(rewritten)  # the next read is a peer fill again
        hit = engine.get(rewritten)
        assert hit is not None and hit.value == b"new value"
        counters = engine.stats()["counters"]
        assert counters["peer_fills_refused"] == 2 and counters["peer_fill_listings"] >= 2, counters
    finally:
        engine.close()


def test_a_listed_page_decides_nothing_for_a_key_written_through_this_node_after_it(store: S3Tier) -> None:
    """`ListedPages`: a page shows object storage as it was when sent. A delete done through this node after
    it (`wrote`) makes it decide nothing for that key, so the next check lists anew and finds the key gone; a
    move (`moved`) makes every page before it decide nothing."""
    from cachesvc.engine.vouching import ListedPages, Verdict

    keys = [f"pages/{i:03d}".encode() for i in range(20)]
    for key in keys:
        store.put(key, b"v " + key, checksum(b"v " + key))
    pages = ListedPages(store)
    assert [pages.check(key, b"v " + key) for key in keys] == [Verdict.KEEP] * 20
    assert pages.listings == 1
    store.delete(keys[5])
    pages.wrote(keys[5])  # as the engine tells it once the delete is done
    assert pages.check(keys[5], b"v " + keys[5]) is Verdict.DROP
    assert pages.check(keys[6], b"v " + keys[6]) is Verdict.KEEP
    assert pages.listings == 2
    assert pages.check(keys[7], b"other bytes") is Verdict.DROP  # another size
    pages.moved()
    assert pages.check(keys[8], b"v " + keys[8]) is Verdict.KEEP and pages.listings == 3
