"""Ranked placement (`PlacementMap.candidates`) and a server's ownership checks (`cachesvc.server.ownership`)."""

from __future__ import annotations

import pytest

from cacheclient.meta import PlacementMap
from cacheclient.wire import OWNER_METADATA, PLACEMENT_VERSION_METADATA, ROUTE_FALLBACK, ROUTE_METADATA
from cachesvc.errors import NotOwner
from cachesvc.server.ownership import Ownership, replicas_by_prefix

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
    ownership.check([other], routed(5), held=lambda key: True)  # a read of bytes held here: served
    with pytest.raises(NotOwner) as refused:
        ownership.check([*mine, other], routed(4), held=lambda key: False)
    assert dict(refused.value.trailing_metadata()) == {
        OWNER_METADATA: placement.locate(other),
        PLACEMENT_VERSION_METADATA: "5",
    }


def test_a_client_with_a_newer_map_is_served_and_wakes_the_server() -> None:
    woken: list[bool] = []
    ownership = Ownership("a:1", on_newer=lambda: woken.append(True))
    ownership.update(pmap(NODES, version=5))
    other = next(k for k in KEYS if ownership.placement and ownership.placement.locate(k) != "a:1")
    ownership.check([other], routed(6))
    assert woken == [True]
    ownership.update(pmap(NODES[:2], version=4))  # an older map never replaces a newer one
    assert ownership.placement is not None and ownership.placement.version == 5


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


def test_a_node_behind_its_clients_asks_the_owner_of_its_older_map() -> None:
    # "d" joined: the clients route by the map with d (version 2) while d still holds the one before it.
    before, after = pmap(NODES[:3], 1), pmap(NODES, 2)
    d = Ownership("d:1")
    d.update(before)
    moved = [k for k in KEYS if after.locate(k) == "d:1"]
    assert moved and all(d.previous_owners(k) == [] for k in moved)  # no map has moved a key yet, by d's
    d.check(moved[:1], routed(2))  # a client routed by the newer map: d is behind
    # Their owner by d's map is their previous owner: asked before S3.
    assert all(d.previous_owners(k) == [before.locate(k)] for k in moved)
    d.update(after)  # caught up: as after any join
    assert all(d.previous_owners(k) == [before.locate(k)] for k in moved)
