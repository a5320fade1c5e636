"""Placement: which cache nodes hold a key, as the metadata shard, the servers and the clients compute it.

A key belongs to slot ``xxh3_64(key) % PLACEMENT_SLOTS``. Each slot ranks the
nodes that take placements by capacity-weighted rendezvous hashing
(Schindelhauer & Schomaker): the node with the highest score owns the slot,
the next ones are its replicas and, for a read whose owner cannot be
reached, the nodes that would own it if the owner left. A node of capacity c
wins about c/total of the slots, and adding or removing a node moves only the
slots it wins or loses.

The shard publishes the owner of every slot (`placement_slots`); servers and
clients rank further candidates with the same function (`rank_nodes`), so all
of them agree without asking each other. `PlacementMap` is one version of
that map, as the shard publishes it and every side looks keys up in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

__all__ = [
    "PLACEMENT_SLOTS",
    "PlacementMap",
    "parse_stamp",
    "placement_slots",
    "rank_nodes",
    "rendezvous_score",
    "slot_of",
]

PLACEMENT_SLOTS = 4096
"""Slots in the placement map: fine enough that each node's share tracks its capacity."""

_TWO_64 = float(1 << 64)


def slot_of(key: bytes, slots: int = PLACEMENT_SLOTS) -> int:
    """The slot of `key` in a map of `slots` slots."""
    return xxhash.xxh3_64_intdigest(key) % slots


def rendezvous_score(slot: int, address: str, weight: int) -> float:
    """The score of node `address` of capacity `weight` for `slot`; the highest score wins the slot.

    -w / ln(u) with u uniform in (0, 1) per (slot, node): a node's chance to
    win a slot is its weight over the total.
    """
    h = xxhash.xxh3_64_intdigest(address.encode(), seed=slot)
    u = (h + 0.5) / _TWO_64
    return -max(weight, 1) / math.log(u)


def rank_nodes(slot: int, nodes: Sequence[tuple[str, int]]) -> list[int]:
    """Indices into `nodes` ((address, capacity) pairs), best candidate for `slot` first."""
    scores = [rendezvous_score(slot, address, weight) for address, weight in nodes]
    return sorted(range(len(nodes)), key=lambda i: -scores[i])


def placement_slots(nodes: Sequence[tuple[str, int]], slots: int = PLACEMENT_SLOTS) -> list[int]:
    """The owner of each slot, as an index into `nodes` ((address, capacity) pairs); empty when `nodes` is."""
    if not nodes:
        return []
    owners = []
    for slot in range(slots):
        best, best_score = 0, -1.0
        for i, (address, weight) in enumerate(nodes):
            score = rendezvous_score(slot, address, weight)
            if score > best_score:
                best, best_score = i, score
        owners.append(best)
    return owners


@dataclass(frozen=True, slots=True)
class PlacementMap:
    """Which cache nodes hold which key, at one version of the shard's state.

    A key belongs to ``nodes[slots[xxh3_64(key) % len(slots)]]``, its owner;
    `candidates` ranks the other nodes after it by the same weighted
    rendezvous hashing (below): the owner's replicas,
    then the nodes that would own the key if those left.

    Versions count within one shard's life: `epoch` is the shard's
    identity, fixed by its first log entry, so a shard rebuilt from empty
    (whose versions start again at 1) has another. `supersedes` says which
    of two maps fetched from the shard to keep; a call names the map it was
    routed by with `stamp`.

    Attributes:
        version: The shard's placement version (0: a static map no shard made).
        nodes: The addresses of the nodes that take placements.
        slots: The owner of each slot, as an index into `nodes`.
        capacities: Each node's capacity, in the order of `nodes` (empty from
            a shard too old to send them: then only the owner is known).
        epoch: The identity of the shard that made it (0: a static map, or a
            shard too old to say).
        holders: The nodes, up or down, that may hold write-back values
            object storage lacks (each says so before it acknowledges one).
        absent: (address, capacity) of the holders that are down (`withheld`).
        layouts: The versions of the last change of `nodes` and `capacities` (so of `slots`) and of the
            change before it; (0, 0) when the shard does not say (`skips`).
        namespaces_version: The version of the shard's namespace table when the map was fetched (0: the
            shard has none); a node or client whose table is of another version fetches it.
    """

    version: int
    nodes: tuple[str, ...]
    slots: tuple[int, ...]
    capacities: tuple[int, ...] = ()
    epoch: int = 0
    holders: frozenset[str] = frozenset()
    absent: tuple[tuple[str, int], ...] = ()
    layouts: tuple[int, int] = (0, 0)
    namespaces_version: int = field(default=0, compare=False)
    _owner: tuple[str, ...] = field(default=(), repr=False, compare=False)
    _ranked: dict[int, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)
    _with_absent: dict[int, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # One address per slot, so a look-up is a hash and one index.
        object.__setattr__(self, "_owner", tuple(self.nodes[s] for s in self.slots))

    @classmethod
    def static(cls, nodes: Sequence[str], capacities: Sequence[int] | None = None) -> PlacementMap:
        """The map of a fixed list of nodes (equal capacities unless given), as the shard would make it."""
        caps = tuple(capacities) if capacities is not None else (1,) * len(nodes)
        if len(caps) != len(nodes):
            raise ValueError(f"{len(caps)} capacities for {len(nodes)} nodes")
        members = list(zip(nodes, caps, strict=True))
        return cls(0, tuple(nodes), tuple(placement_slots(members)), caps)

    def supersedes(self, held: PlacementMap | None) -> bool:
        """Whether this map, fetched from the shard, replaces `held`: none held, a later version, or
        another epoch (the shard was rebuilt from empty: its count started again; follow it), but not
        the empty map of a rebuilt shard that has applied nothing yet (epoch 0).

        Only maps fetched from the shard are compared: a version a caller
        names never replaces one (servers fetch the map to check a claim).
        """
        if held is None:
            return True
        if self.epoch != held.epoch:
            # A shard with no entry yet has no identity (and no nodes): it replaces no map of one that had.
            return self.epoch != 0
        return self.version > held.version

    def skips(self, held: PlacementMap | None) -> bool:
        """Whether a layout came between `held` and this map (same shard) that the holder of `held` never saw:
        the maps between may have moved its keys away and back (a lease lost and regained, a drain put back
        within one fetch), though this map places them as `held` did.

        By `layouts` when the shard says: the layout changed at most once
        since `held` when the change before the last one is not newer than
        `held` (versions between that changed only holders move nothing).
        Without it (0), any version skipped may have.
        """
        if held is None or self.epoch != held.epoch or self.version <= held.version + 1:
            return False
        layout, before = self.layouts
        return not layout or before > held.version

    def behind(self, version: int, epoch: int) -> bool:
        """Whether a caller that routed by map (`version`, `epoch`) claims a map this one has not caught up with:
        a later version of this shard, or one of another epoch (0: a caller that does not say)."""
        return (epoch != 0 and epoch != self.epoch) or version > self.version

    @property
    def stamp(self) -> str:
        """How a call names this map (`PLACEMENT_VERSION_METADATA`): "VERSION" or "VERSION:EPOCH"."""
        return f"{self.version}:{self.epoch}" if self.epoch else str(self.version)

    def locate(self, key: bytes | str) -> str | None:
        """The address of the node that holds `key`, or None when no node is up."""
        owner = self._owner
        if not owner:
            return None
        if isinstance(key, str):
            key = key.encode()
        return owner[xxhash.xxh3_64_intdigest(key) % len(owner)]

    def candidates(self, key: bytes | str) -> tuple[str, ...]:
        """Every node, best first for `key`: its owner, then the rest by rendezvous rank (empty: no node is up)."""
        if not self._owner:
            return ()
        if isinstance(key, str):
            key = key.encode()
        return self.slot_candidates(slot_of(key, len(self._owner)))

    def slot_candidates(self, slot: int) -> tuple[str, ...]:
        """`candidates` of the keys of `slot` (empty: no node is up)."""
        if not self._owner:
            return ()
        ranked = self._ranked.get(slot)
        if ranked is None:
            owner = self._owner[slot]
            if len(self.capacities) != len(self.nodes):
                ranked = (owner,)
            else:
                order = rank_nodes(slot, list(zip(self.nodes, self.capacities, strict=True)))
                # The shard's word on the owner comes first, whatever the ranking says.
                ranked = (owner, *(self.nodes[i] for i in order if self.nodes[i] != owner))
            self._ranked[slot] = ranked
        return ranked

    def withheld(self, key: bytes, replicas: int, address: str) -> str | None:
        """The holder `address` must not serve a write-back value of `key` without: None when there is none.

        Rank the slot's nodes as if the down holders (`absent`) were up. A
        node among the first `replicas` of that ranking was sent every
        write-back value of the key while it held the slot (a put goes to all
        replicas), so it serves its own. Any other node (one standing in for
        a down holder, or a fallback reader while the owner does not answer)
        may have only object storage's older value: when a holder is among
        those first `replicas`, the key is withheld until that node is back
        (its copy is then read from it) or removed from the shard.
        """
        if not self.holders or not self._owner:
            return None
        slot = slot_of(key, len(self._owner))
        if not self.absent or len(self.capacities) != len(self.nodes):
            top = self.slot_candidates(slot)
        else:
            ranked = self._with_absent.get(slot)
            if ranked is None:
                members = [*zip(self.nodes, self.capacities, strict=True), *self.absent]
                ranked = self._with_absent[slot] = tuple(members[i][0] for i in rank_nodes(slot, members))
            top = ranked
        first = top[:replicas]
        if address in first:
            return None
        return next((node for node in first if node in self.holders), None)


def parse_stamp(stamp: str | bytes) -> tuple[int, int] | None:
    """(version, epoch) of a `PlacementMap.stamp` (epoch 0 when it names none); None when it is not one."""
    text = stamp.decode("ascii", "replace") if isinstance(stamp, bytes) else stamp
    version, _, epoch = text.partition(":")
    try:
        return int(version), int(epoch or 0)
    except ValueError:
        return None
