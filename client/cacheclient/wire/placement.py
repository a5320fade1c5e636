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
of them agree without asking each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

__all__ = ["PLACEMENT_SLOTS", "placement_slots", "rank_nodes", "rendezvous_score", "slot_of"]

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
