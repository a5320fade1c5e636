"""A shared L1 in segments, one arena per tenant (`cachesvc.tiers.tenant_arenas`), in one process.

What a tenant's client maps (the descriptors `grant` hands its token) is read
here as the client reads it, through its own read-only mapping; the servers
and clients of a cluster are in tests/test_tenants.py.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import xxhash

from cacheclient.meta import TenantEntry
from cacheclient.wire.arena import ASK, ArenaView
from cacheclient.wire.scopes import token_sha256
from cachesvc.tiers.arena import Descriptors
from cachesvc.tiers.tenant_arenas import TenantArenas


def _tenant(name: str, *prefixes: str, token: str) -> TenantEntry:
    return TenantEntry(name, prefixes, token_sha256=token_sha256(token))


def _put(tier: TenantArenas, key: bytes, value: bytes) -> None:
    tier.put(key, value, xxhash.xxh3_64_intdigest(value))


def _mapped(shared: Descriptors) -> mmap.mmap:
    return mmap.mmap(shared.arena, shared.arena_bytes, prot=mmap.PROT_READ)


@pytest.fixture
def tier() -> Iterator[TenantArenas]:
    arenas = TenantArenas(1 << 20)
    yield arenas
    arenas.close()


A_VALUE, B_VALUE, PLAIN_VALUE = b"value of tenant A " * 300, b"value of tenant B " * 300, b"untenanted value " * 300


def test_each_token_is_handed_its_own_tenants_values_only(tier: TenantArenas) -> None:
    tier.retable([_tenant("a", "a/", token="tok-a"), _tenant("b", "b/", token="tok-b")])
    _put(tier, b"a/1", A_VALUE)
    _put(tier, b"b/1", B_VALUE)
    _put(tier, b"plain", PLAIN_VALUE)
    (a,) = tier.grant("tok-a")
    assert a.prefixes == (b"a/",)
    memory = _mapped(a)
    assert A_VALUE in memory[:] and B_VALUE[:64] not in memory[:] and PLAIN_VALUE[:64] not in memory[:]
    assert ArenaView(memoryview(memory)).get(b"a/1") == A_VALUE
    # The data token gets every segment, the main one first; another token none.
    assert [d.prefixes for d in tier.grant(None)] == [(), (b"a/",), (b"b/",)]
    assert tier.grant("tok-c") == []
    # One budget for every segment.
    assert tier.used_bytes == sum(
        tier.cost(k, len(v)) for k, v in [(b"a/1", A_VALUE), (b"b/1", B_VALUE), (b"plain", PLAIN_VALUE)]
    )


def test_keys_move_with_the_table_and_leave_nothing_behind(tier: TenantArenas) -> None:
    _put(tier, b"a/1", A_VALUE)  # before the tenant exists: in the main segment
    _put(tier, b"b/1", B_VALUE)
    tier.retable([_tenant("a", "a/", "b/", token="tok-a")])
    assert tier.segment_of(b"a/1") == "a" and tier.segment_of(b"b/1") == "a"
    (a,) = tier.grant("tok-a")
    memory = _mapped(a)
    view = ArenaView(memoryview(memory))
    assert view.get(b"a/1") is ASK and not tier.published(b"a/1"), "moved: concealed until served"
    tier.reveal(b"a/1")
    assert view.get(b"a/1") == A_VALUE
    # b/ goes to its own tenant: B's value leaves A's arena, its bytes zeroed there.
    tier.retable([_tenant("a", "a/", token="tok-a"), _tenant("b", "b/", token="tok-b")])
    assert tier.segment_of(b"b/1") == "b" and tier.get(b"b/1") is not None
    assert B_VALUE[:64] not in memory[:]
    assert A_VALUE in memory[:]
    # A rotated token: the old arena is wiped and closed under the mapping kept, the new token gets a new one.
    tier.retable([_tenant("a", "a/", token="tok-a2"), _tenant("b", "b/", token="tok-b")])
    assert not view.open and A_VALUE[:64] not in memory[:]
    assert tier.grant("tok-a") == [] and len(tier.grant("tok-a2")) == 1
    entry = tier.get(b"a/1")
    assert entry is not None and entry.value == A_VALUE, "the engine's copy survives the rotation"
    # A tenant removed: its keys go back to the main segment.
    tier.retable([])
    assert tier.segment_of(b"a/1") == "" and tier.segment_of(b"b/1") == ""
    assert sorted(tier.list_keys()) == [b"a/1", b"b/1"]
    assert len(tier.grant(None)) == 1


def test_a_change_of_segments_is_seen_by_clients_of_the_main_one(tier: TenantArenas) -> None:
    main = ArenaView(memoryview(_mapped(tier.grant(None)[0])))
    before = main.segments
    tier.retable([_tenant("a", "a/", token="tok-a")])
    assert main.segments == before + 1
    tier.retable([_tenant("a", "a/", token="tok-a")])  # the same tenants: nothing to map again
    assert main.segments == before + 1


def test_hits_of_every_segment_are_swept(tier: TenantArenas) -> None:
    tier.retable([_tenant("a", "a/", token="tok-a")])
    _put(tier, b"a/1", A_VALUE)
    _put(tier, b"plain", PLAIN_VALUE)
    counted = []
    for shared in tier.grant(None):
        hits = mmap.mmap(shared.hits, shared.hits_bytes)
        counted.append(ArenaView(memoryview(_mapped(shared)), memoryview(hits)))
    main, a = counted
    assert main.get(b"plain") == PLAIN_VALUE and a.get(b"a/1") == A_VALUE
    assert sorted(tier.take_hits()) == [b"a/1", b"plain"]
    assert tier.take_hits() == []
