"""Ranked placement (`PlacementMap.candidates`) and a server's ownership checks (`cachesvc.server.ownership`)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cacheclient.meta import PlacementMap
from cacheclient.wire import (
    OWNER_METADATA,
    PLACEMENT_VERSION_METADATA,
    ROUTE_FALLBACK,
    ROUTE_METADATA,
    cache_pb2,
    cache_pb2_grpc,
)
from cacheclient.wire.placement import parse_stamp
from cachesvc.engine import Engine
from cachesvc.errors import BehindPlacement, HoldersUnknown, NotOwner, Withheld
from cachesvc.policy.lru import LRUPolicy
from cachesvc.rpc import Health
from cachesvc.server.fences import Fences
from cachesvc.server.ownership import Ownership, replicas_by_prefix
from cachesvc.server.server import direct_reads_as_owner, follow_placement
from cachesvc.tiers.lmdb_tier import LMDBTier

from conftest import S3Server, read_directly, running_cluster

NODES = [("a:1", 100), ("b:1", 200), ("c:1", 300), ("d:1", 100)]
KEYS = [f"k/{i}".encode() for i in range(4000)]


def pmap(nodes: list[tuple[str, int]], version: int = 1) -> PlacementMap:
    static = PlacementMap.static([a for a, _ in nodes], [c for _, c in nodes])
    return PlacementMap(version, static.nodes, static.slots, static.capacities)


def test_the_next_candidate_is_the_owner_once_the_owner_leaves() -> None:
    full = pmap(NODES)
    without = {a: pmap([n for n in NODES if n[0] != a]) for a, _ in NODES}
    for key in KEYS:
        owner, second, *_ = full.candidates(key)
        assert owner == full.locate(key)
        assert without[owner].locate(key) == second


def test_candidates_without_capacities_name_only_the_owner() -> None:
    full = pmap(NODES)
    old = PlacementMap(1, full.nodes, full.slots)
    assert old.candidates(KEYS[0]) == (full.locate(KEYS[0]),)


def routed(version: int, *extra: tuple[str, str]) -> dict[str, str]:
    return {PLACEMENT_VERSION_METADATA: str(version), **dict(extra)}


def test_a_server_refuses_a_routed_key_it_does_not_own_naming_the_owner_and_its_version() -> None:
    placement = pmap(NODES, version=5)
    ownership = Ownership("a:1")
    ownership.update(placement)
    mine = [k for k in KEYS if placement.locate(k) == "a:1"]
    other = next(k for k in KEYS if placement.locate(k) != "a:1")
    ownership.check(mine, routed(5))  # owned: served
    ownership.check([other], {})  # a client of one server: served whatever it asks
    ownership.check([other], routed(5, (ROUTE_METADATA, ROUTE_FALLBACK)))  # the owner was lost: served
    suspected: list[bytes] = []
    ownership.check([other, *mine], routed(5, (ROUTE_METADATA, ROUTE_FALLBACK)), suspected.append)
    assert suspected == [other]  # a copy of a key not owned here, read as a fallback: checked against S3 first
    with pytest.raises(NotOwner):  # a client behind the server's map: sent to the owner, cached copy or not
        ownership.check([other], routed(4), suspected.append)
    with pytest.raises(NotOwner) as refused:
        ownership.check([*mine, other], routed(4), suspected.append)
    assert dict(refused.value.trailing_metadata()) == {
        OWNER_METADATA: placement.locate(other),
        PLACEMENT_VERSION_METADATA: "5",
    }


class Shard:
    """What `Ownership.fetch` reaches: the shard's current map (None: the shard does not answer), counted."""

    def __init__(self, placement: PlacementMap | None) -> None:
        self.placement = placement
        self.fetches = 0

    def fetch(self, timeout: float) -> PlacementMap | None:
        self.fetches += 1
        return self.placement


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_client_ahead_of_the_server_makes_it_fetch_the_shard_s_map_which_decides() -> None:
    v5 = pmap(NODES, version=5)
    v6 = pmap(NODES[:1], version=6)  # only a:1 is left: it owns every key
    shard, clock = Shard(v6), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock)
    ownership.update(v5)
    other = next(k for k in KEYS if v5.locate(k) != "a:1")
    ownership.check([other], routed(6))  # the shard bears the client out: a:1 owns it by v6
    assert shard.fetches == 1 and ownership.placement == v6
    ownership.update(pmap(NODES[:2], version=4))  # an older map never replaces a newer one
    assert ownership.placement == v6


def test_a_forged_or_old_client_version_is_checked_against_the_shard_and_changes_nothing() -> None:
    v5 = pmap(NODES, version=5)
    shard, clock = Shard(v5), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock, sleep=clock.sleep)
    ownership.update(v5)
    others = [k for k in KEYS if v5.locate(k) != "a:1"]
    before = [ownership.previous_owners(k) for k in others[:200]]
    with pytest.raises(NotOwner) as refused:  # the shard has no version 1e9: decided by the map held
        ownership.check(others[:1], routed(10**9), lambda key: None)
    assert refused.value.version == 5 and shard.fetches == 1
    # A call that came as that fetch began shares it; one that came later waits out FETCH_GAP, then fetches:
    # however many calls name it, the shard is asked at most once per FETCH_GAP.
    with pytest.raises(NotOwner):
        ownership.check(others[1:2], routed(10**9))
    assert shard.fetches == 1
    clock.now += 0.01
    with pytest.raises(NotOwner):
        ownership.check(others[1:2], routed(10**9))
    assert shard.fetches == 2 and clock.now == pytest.approx(100.0 + Ownership.FETCH_GAP)
    assert ownership.placement == v5 and [ownership.previous_owners(k) for k in others[:200]] == before
    # The shard away: the call is served (the client's map is likely the newer) and nothing is believed of it.
    shard.placement = None
    clock.now += Ownership.FETCH_GAP
    ownership.check(others[2:3], routed(10**9))
    assert ownership.placement == v5 and [ownership.previous_owners(k) for k in others[:200]] == before


def test_a_write_routed_by_a_map_the_server_cannot_fetch_is_refused_not_taken_by_the_map_held() -> None:
    # A put back node still holding the drain's map would take the write by it, fence no earlier owner (that
    # map names none), and the old owner would go on serving its older copy (a fresh-clone CI run: 25 of 25).
    v5 = pmap(NODES, version=5)
    shard, clock = Shard(None), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock, sleep=clock.sleep)
    ownership.update(v5)
    mine = next(k for k in KEYS if v5.locate(k) == "a:1")
    ownership.check([mine], routed(6), lambda key: None)  # a read is served by the map held
    for held_by_shard in (v5, None):  # the shard's map older than the client's, or the shard away
        shard.placement = held_by_shard
        clock.now += Ownership.FETCH_GAP
        with pytest.raises(BehindPlacement, match="placement version 6.*holds version 5"):
            ownership.check([mine], routed(6), write=True)
    clock.now += 0.01  # within FETCH_GAP of a fetch the shard did not answer: refused without asking it again
    fetches, now = shard.fetches, clock.now
    with pytest.raises(BehindPlacement):
        ownership.check([mine], routed(6), write=True)
    assert shard.fetches == fetches and ownership.refused_behind_map == 3 and clock.now == now  # and not held
    ownership.check([mine], routed(5), write=True)  # by the map held: taken
    shard.placement = pmap(NODES, version=6)
    clock.now += Ownership.FETCH_GAP
    ownership.check([mine], routed(6), write=True)  # the shard bears the client out: decided by its map
    assert ownership.placement == shard.placement and ownership.refused_behind_map == 3


def test_a_read_routed_by_a_map_fetched_just_after_the_servers_is_decided_by_that_map() -> None:
    # A fetched v1 just before a drain gave it a key; a reader with the drain's map asked it right after. A
    # fetch under FETCH_GAP ago used to decide the read by v1: refused (NotOwner, naming the drained node),
    # and the reader had no other node to ask (a fresh-clone CI run). Now the read waits out the gap and
    # fetches the shard's map.
    v1 = pmap(NODES, version=1)
    v2 = pmap(NODES[:1], version=2)  # every other node drained: a:1 owns every key
    other = next(k for k in KEYS if v1.locate(k) != "a:1")
    shard, clock = Shard(v1), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock, sleep=clock.sleep)
    ownership.update(v1)
    with pytest.raises(NotOwner):  # a forged version: A fetched, and the shard had nothing newer
        ownership.check([other], routed(2))
    shard.placement = v2  # the drain, right after that fetch
    clock.now += 0.05
    ownership.check([other], routed(2))  # served by v2
    assert ownership.placement == v2 and shard.fetches == 2
    assert clock.now == pytest.approx(100.0 + Ownership.FETCH_GAP)  # no sooner than FETCH_GAP after the last


def test_calls_that_came_before_a_fetch_began_share_it() -> None:
    v1, v2 = pmap(NODES, version=1), pmap(NODES[:1], version=2)
    others = [k for k in KEYS if v1.locate(k) != "a:1"][:8]
    release = threading.Event()
    fetching = threading.Event()
    fetches: list[float] = []

    def fetch(timeout: float) -> PlacementMap:
        fetches.append(timeout)
        fetching.set()
        assert release.wait(10.0), "the test did not release the fetch"
        return v2

    ownership = Ownership("a:1", fetch=fetch)
    ownership.update(v1)
    errors: list[BaseException] = []

    def read(key: bytes) -> None:
        try:
            ownership.check([key], routed(2))
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=read, args=(others[0],))
    first.start()
    assert fetching.wait(10.0)
    waiting = [threading.Thread(target=read, args=(k,)) for k in others[1:]]
    for thread in waiting:
        thread.start()
    release.set()
    for thread in (first, *waiting):
        thread.join(10.0)
    assert not errors and len(fetches) == 1 and ownership.placement == v2


def test_a_server_with_no_map_yet_fetches_one_before_a_routed_write_and_refuses_it_without() -> None:
    # A put back node whose first fetch found no map (its next heartbeat half an hour away) took every routed
    # write unchecked, fenced nobody, and the old owner served its older copy (a fresh-clone CI run).
    v6 = pmap(NODES, version=6)
    mine = next(k for k in KEYS if v6.locate(k) == "a:1")
    other = next(k for k in KEYS if v6.locate(k) != "a:1")
    shard, clock = Shard(None), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock)
    ownership.check([other], routed(6), lambda key: None)  # a read is served as before, by no map
    clock.now += Ownership.FETCH_GAP
    with pytest.raises(BehindPlacement, match="placement version 6.*holds version 0"):
        ownership.check([mine], routed(6), write=True)
    assert ownership.refused_behind_map == 1
    shard.placement = v6
    clock.now += Ownership.FETCH_GAP
    ownership.check([mine], routed(6), write=True)  # the map fetched first: decided by it
    assert ownership.placement == v6
    with pytest.raises(NotOwner):
        ownership.check([other], routed(6), write=True)


def test_a_map_of_a_rebuilt_shard_replaces_a_higher_version_of_the_old_one() -> None:
    static = pmap(NODES)
    old = PlacementMap(50, static.nodes, static.slots, static.capacities, epoch=111)
    rebuilt = PlacementMap(2, static.nodes[:3], pmap(NODES[:3]).slots, static.capacities[:3], epoch=222)
    assert rebuilt.supersedes(old) and not old.supersedes(PlacementMap(51, old.nodes, old.slots, epoch=111))
    shard, clock = Shard(rebuilt), Clock()
    ownership = Ownership("a:1", fetch=shard.fetch, clock=clock)
    ownership.update(old)
    ownership.update(rebuilt)
    assert ownership.placement == rebuilt
    ownership.update(PlacementMap(1, rebuilt.nodes, rebuilt.slots, rebuilt.capacities, epoch=222))  # older: kept
    assert ownership.placement == rebuilt
    # A client still routing by the old shard's map (version 50 > 2) names its epoch: checked, then refused.
    other = next(k for k in KEYS if rebuilt.locate(k) != "a:1")
    with pytest.raises(NotOwner):
        ownership.check([other], {PLACEMENT_VERSION_METADATA: old.stamp})
    assert shard.fetches == 1 and ownership.placement == rebuilt
    assert parse_stamp(old.stamp) == (50, 111) and parse_stamp("7") == (7, 0) and parse_stamp("x") is None


def test_replicas_own_the_first_r_candidates_of_their_prefix() -> None:
    placement = pmap(NODES)
    ownership = Ownership("a:1", replicas_by_prefix([(b"rep/", 2), (b"rep/three/", 3)]))
    ownership.update(placement)
    for key in (b"rep/x", b"rep/three/x", b"plain"):
        replicas = 3 if key.startswith(b"rep/three/") else 2 if key.startswith(b"rep/") else 1
        assert ownership.owns(placement, key) == ("a:1" in placement.candidates(key)[:replicas])
    keys = [f"rep/{i}".encode() for i in range(400)]
    assert sum(ownership.owns(placement, k) for k in keys) > sum(placement.locate(k) == "a:1" for k in keys)


def test_a_joining_node_learns_each_moved_key_s_previous_owner() -> None:
    before = pmap(NODES[:3], version=1)
    after = pmap(NODES, version=2)  # d joins
    ownership = Ownership("d:1")
    ownership.update(before)
    assert all(ownership.previous_owners(k) == [] for k in KEYS[:50])  # nothing moved yet
    ownership.update(after)
    ownership.update(pmap(NODES, version=3))  # same placement, new version: not a move
    moved = [k for k in KEYS if after.locate(k) == "d:1"]
    assert moved and all(ownership.previous_owners(k) == [before.locate(k)] for k in moved)
    assert ownership.known_nodes() == {a for a, _ in NODES}
    # With 2 replicas, both earlier holders are named; this node never is.
    two = Ownership("a:1", replicas=lambda key: 2)
    two.update(before)
    two.update(after)
    for key in KEYS[:200]:
        earlier = [n for n in before.candidates(key)[:2] if n != "a:1"]
        if two.owns(after, key):
            assert two.previous_owners(key) == earlier
        else:  # a fallback read: the owners the client could not reach are not asked again
            assert two.previous_owners(key) == [n for n in earlier if n not in after.candidates(key)[:2]]


def test_a_node_back_from_a_lost_lease_or_past_maps_it_missed_counts_a_move_though_nothing_moved() -> None:
    # Keys given to others in maps this node never saw and given back: the map it fetches places them as its
    # last one did, but those others took writes of them meanwhile and may still serve them (a Jepsen run's
    # stale reads after a cut-off node was healed). Each such map is a move: its peers are fenced again.
    ownership = Ownership("a:1")
    moves: list[PlacementMap] = []
    ownership.on_moved = moves.append
    ownership.update(pmap(NODES[:3], version=1))
    ownership.update(pmap(NODES[:3], version=2))  # the next version, same placement: not a move
    assert [m.version for m in moves] == [1]
    ownership.rejoined()  # the lease renewed after a gap: fence at once, by the map held
    assert [m.version for m in moves] == [1, 2]
    ownership.update(pmap(NODES[:3], version=3))  # the first map after it, same placement: a move
    ownership.update(pmap(NODES[:3], version=4))
    assert [m.version for m in moves] == [1, 2, 3]
    ownership.update(pmap(NODES[:3], version=6))  # version 5 never seen: a move
    assert [m.version for m in moves] == [1, 2, 3, 6]
    assert pmap(NODES[:3], version=6).skips(pmap(NODES[:3], version=4))
    assert not pmap(NODES[:3], version=5).skips(pmap(NODES[:3], version=4))


def test_a_fallback_read_does_not_ask_the_owner_that_did_not_answer() -> None:
    # b was away a moment (c took keys from it) and is back; c still owns some keys it held in b's absence.
    ownership = Ownership("b:1")
    for version, nodes in enumerate([NODES[:3], [NODES[0], NODES[2]], NODES[:3]], start=1):
        ownership.update(pmap(nodes, version))
    current = pmap(NODES[:3], 3)
    of_c = [k for k in KEYS if current.locate(k) == "c:1"]
    # b reads them only as a fallback (c did not answer): c, their holder in every earlier map too, is not asked.
    assert of_c and all(ownership.previous_owners(k) == [] for k in of_c)
    # Keys b owns again: their holder while it was away is asked, as after any move.
    of_b = [k for k in KEYS if current.locate(k) == "b:1"]
    assert of_b and all(ownership.previous_owners(k) for k in of_b)


def test_a_node_behind_its_clients_fetches_the_map_then_asks_the_owner_of_its_older_map() -> None:
    # "d" joined: the clients route by the map with d (version 2) while d still holds the one before it.
    before, after = pmap(NODES[:3], 1), pmap(NODES, 2)
    d = Ownership("d:1", fetch=Shard(after).fetch)
    d.update(before)
    moved = [k for k in KEYS if after.locate(k) == "d:1"]
    assert moved and all(d.previous_owners(k) == [] for k in moved)  # no map has moved a key yet, by d's
    d.check(moved[:1], routed(2))  # a client routed by the newer map: d fetches it before it answers
    assert d.placement == after
    # Their owner by d's older map is their previous owner: asked before S3.
    assert all(d.previous_owners(k) == [before.locate(k)] for k in moved)


def test_a_hand_off_token_does_not_stand_in_for_the_ownership_check(s3: S3Server, tmp_path: Path) -> None:
    """A routed GetMany (or stream) with a hand-off token is served from the token's held values; any key
    the token does not hold is read, so it is checked like any read: a made-up token is refused NOT_OWNER."""
    with running_cluster(s3, tmp_path, "", [("16MiB", "0")] * 2, meta_nodes=1) as cluster:
        placement = cluster.placement()
        key = next(f"k/{i}".encode() for i in range(1000) if placement.locate(f"k/{i}") == placement.nodes[0])
        with cluster.client() as cache:
            cache.put(key, b"the owner's value")  # write-through: S3 has it too
        other = cluster.server(placement.nodes[1])
        routed_by = ((PLACEMENT_VERSION_METADATA, placement.stamp),)
        with grpc.insecure_channel(other.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            with pytest.raises(grpc.RpcError) as plain:
                stub.GetMany(cache_pb2.GetManyRequest(keys=[key]), metadata=routed_by, timeout=10)
            assert plain.value.code() == grpc.StatusCode.ABORTED, plain.value  # NOT_OWNER
            forged = cache_pb2.GetManyRequest(keys=[key], handoff=os.urandom(16))
            for call in (
                lambda: stub.GetMany(forged, metadata=routed_by, timeout=10),
                lambda: list(stub.GetManyStream(forged, metadata=routed_by, timeout=10)),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value
                assert dict(refused.value.trailing_metadata() or ())[OWNER_METADATA] == placement.nodes[0]


def test_a_down_holders_write_back_keys_are_withheld_by_all_but_their_replicas() -> None:
    full = pmap(NODES)
    without_a = pmap([n for n in NODES if n[0] != "a:1"], version=2)
    a_capacity = dict(NODES)["a:1"]
    down = PlacementMap(3, without_a.nodes, without_a.slots, without_a.capacities, holders=frozenset({"a:1"}),
                        absent=(("a:1", a_capacity),))  # fmt: skip
    a_keys = [k for k in KEYS if full.locate(k) == "a:1"]
    others = [k for k in KEYS if full.locate(k) != "a:1"]
    for key in a_keys:
        stand_in = down.locate(key)
        assert down.withheld(key, 1, stand_in) == "a:1"  # the stand-in has S3's value at best
        # With two replicas, a's second replica was sent every write-back value: it serves its own.
        second = full.candidates(key)[1]
        assert down.withheld(key, 2, second) is None
    assert all(down.withheld(k, 1, down.locate(k)) is None for k in others)  # not a's keys
    # Up and holding, a is its keys' owner: a fallback reader elsewhere withholds them, a itself serves them.
    up = PlacementMap(4, full.nodes, full.slots, full.capacities, holders=frozenset({"a:1"}))
    assert all(up.withheld(k, 1, "a:1") is None for k in a_keys)
    assert all(up.withheld(k, 1, "b:1") == "a:1" for k in a_keys)
    assert all(up.withheld(k, 1, "b:1") is None for k in others)
    assert all(full.withheld(k, 1, "b:1") is None for k in a_keys)  # no holder: nothing withheld


def test_a_write_back_key_of_another_node_is_judged_by_a_map_fetched_after_the_read_came() -> None:
    # b:1 holds a map in which a:1 holds nothing; a:1 has since told the shard it does (before its next
    # write-back put returned). A read at b:1 of a:1's write-back key (a fallback) is judged by the shard's map.
    quiet = pmap(NODES, version=4)
    holding = PlacementMap(5, quiet.nodes, quiet.slots, quiet.capacities, holders=frozenset({"a:1"}))
    a_keys = [k for k in KEYS if quiet.locate(k) == "a:1"]
    b_keys = [k for k in KEYS if quiet.locate(k) == "b:1"]
    shard, clock = Shard(holding), Clock()
    ownership = Ownership("b:1", fetch=shard.fetch, clock=clock)
    ownership.update(quiet)
    write_back = lambda key: True  # noqa: E731
    with pytest.raises(Withheld):
        ownership.withhold(a_keys[:3], write_back, check_fresh=True)
    assert shard.fetches == 1 and ownership.placement is holding  # one fetch for the whole batch, adopted
    ownership.withhold(b_keys, write_back, check_fresh=True)  # its own keys: no fetch, nothing withheld
    assert shard.fetches == 1
    ownership.update(pmap(NODES, version=6))  # the next heartbeat: a:1 uploaded everything and said so
    shard.placement = PlacementMap(7, quiet.nodes, quiet.slots, quiet.capacities, holders=frozenset({"a:1"}))
    clock.now += 1.0  # a read that came after the last fetch began fetches again
    with pytest.raises(Withheld):
        ownership.withhold(a_keys[:1], write_back, check_fresh=True)
    assert shard.fetches == 2
    with pytest.raises(Withheld):  # came before that fetch began: shares it
        ownership.withhold(a_keys[1:2], write_back, check_fresh=True)
    assert shard.fetches == 2
    ownership.update(pmap(NODES, version=8))
    ownership.withhold(a_keys, write_back)  # a peer's fill, a presence check: the map held decides
    assert shard.fetches == 2
    clock.now += 1.0
    shard.placement = None  # the shard does not answer: nothing vouches that a:1 holds nothing newer
    with pytest.raises(HoldersUnknown):
        ownership.withhold(a_keys[:1], write_back, check_fresh=True)
    ownership.withhold(a_keys, lambda key: False, check_fresh=True)  # not write-back: S3 has the newest


class SlowShard(Shard):
    """A shard whose map takes until `release` is set to arrive (a catch-up that rechecks a large L2)."""

    def __init__(self, placement: PlacementMap) -> None:
        super().__init__(placement)
        self.asked = threading.Event()
        self.release = threading.Event()

    def fetch(self, timeout: float) -> PlacementMap | None:
        self.asked.set()
        assert self.release.wait(30), "the test never let the map through"
        return super().fetch(timeout)


@contextlib.contextmanager
def fenced_while_catching_up(ownership: Ownership, shard: SlowShard, target: PlacementMap) -> Iterator[None]:
    """A peer fences the node of `ownership` with `target`, whose fetch `shard` holds back: the body runs while
    the node catches up; on leaving, the map is let through and the fence answered."""
    fences = Fences(ownership, lambda: 1, timeout=30.0)
    fenced = threading.Thread(target=fences.fenced, args=(target.version, target.epoch))
    fenced.start()
    try:
        assert shard.asked.wait(10)
        yield
    finally:
        shard.release.set()
        fenced.join(30)
        fences.close()


def test_a_fenced_node_refuses_calls_routed_by_older_maps_while_it_is_still_catching_up() -> None:
    # a:1 owns `key` by v5; by v6 another node does, and fences a:1 before its first write of it. Until a:1
    # holds v6 (following a map can take seconds: it rechecks what is cached of the keys that moved), a
    # reader still routed by v5 must be refused, not served a:1's copy from before that write.
    v5 = pmap(NODES, version=5)
    v6 = pmap(NODES[1:], version=6)
    key = next(k for k in KEYS if v5.locate(k) == "a:1")
    shard = SlowShard(v6)
    ownership = Ownership("a:1", fetch=shard.fetch, clock=Clock())
    ownership.update(v5)
    with fenced_while_catching_up(ownership, shard, v6):
        assert ownership.placement == v5  # still catching up
        with pytest.raises(NotOwner):
            ownership.check([key], routed(5))
    assert ownership.placement == v6
    with pytest.raises(NotOwner):
        ownership.check([key], routed(6))  # it moved: refused by the map itself now


def test_a_fenced_node_serves_no_direct_reads_until_it_followed_the_fences_map(tmp_path: Path) -> None:
    # a:1 owns both keys by v5 and holds them in L2; by v6 (a join) `moving` is e:1's, which fences a:1 before
    # its first write of it. Following v6 marks a:1's copy of `moving` in its L2 file, but that can take longer
    # than e:1 waits for its fence (a large L2's scan), and e:1 then takes writes: until a:1 holds v6, a
    # co-located reader still routed by v5 must read nothing from a:1's file (it read the old copy before).
    v5 = pmap(NODES, version=5)
    v6 = pmap([*NODES, ("e:1", 400)], version=6)
    moving = next(k for k in KEYS if v5.locate(k) == "a:1" and v6.locate(k) == "e:1")
    staying = next(k for k in KEYS if v5.locate(k) == "a:1" and v6.locate(k) == "a:1")
    engine = Engine(l1=None, l2=LMDBTier(tmp_path / "l2", 8 << 20), l3=None, policy_factory=lambda _: LRUPolicy())
    shard = SlowShard(v6)
    health = Health()

    def fetch(timeout: float) -> PlacementMap | None:
        placement = shard.fetch(timeout)
        if placement is not None:
            follow_placement(placement, ownership, health, engine)  # as `Membership.fetch_placement` does
        return placement

    ownership = Ownership("a:1", fetch=fetch, clock=Clock())
    follow_placement(v5, ownership, health, engine)
    direct_reads_as_owner(engine, ownership)
    engine.put(moving, b"M" * 100)
    engine.put(staying, b"S" * 100)
    assert read_directly(tmp_path / "l2", [moving, staying]) == [b"M" * 100, b"S" * 100]
    with fenced_while_catching_up(ownership, shard, v6):
        assert ownership.placement == v5  # still catching up
        assert read_directly(tmp_path / "l2", [moving, staying]) == [None, None]
        engine.put(staying, b"T" * 100)  # a write meanwhile: readable once the hold ends, not marked for good
        assert read_directly(tmp_path / "l2", [staying]) == [None]
    assert ownership.placement == v6
    assert read_directly(tmp_path / "l2", [moving, staying]) == [None, b"T" * 100]  # e:1's now; still a:1's
    engine.close()


def test_a_fences_floor_lifts_once_the_node_holds_that_map_or_a_rebuilt_shards() -> None:
    # A floor holds direct reads off (`below_floor`): it must lift, or the node's co-located clients read
    # through gRPC for good.
    static = pmap(NODES)
    ownership = Ownership("a:1")
    ownership.update(PlacementMap(5, static.nodes, static.slots, static.capacities, epoch=111))
    assert not ownership.below_floor()
    ownership.raise_floor(6, 111)
    assert ownership.below_floor()
    ownership.update(PlacementMap(6, static.nodes, static.slots, static.capacities, epoch=111))
    assert not ownership.below_floor()
    ownership.raise_floor(9, 111)
    ownership.update(PlacementMap(1, static.nodes, static.slots, static.capacities, epoch=222))  # rebuilt shard
    assert not ownership.below_floor()
    ownership.raise_floor(3, 222)  # a peer already further along the rebuilt shard's maps
    assert ownership.below_floor()
