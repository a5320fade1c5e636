"""Which keys this cache server owns, by the placement map its membership loop last fetched.

Only calls from routing clients are checked: they name the map version they
routed by (`PLACEMENT_VERSION_METADATA`). A call without it comes from a
client of this one server and is served whatever the placement says, as
before there were clusters.

A routed call is served when this server is one of the key's replicas (the
first R of its rendezvous candidates; R from the key's namespace), when the
client's map is newer than this server's (the client knows better; the
membership loop is asked to fetch the new map), or when the client marks the
call as a fallback (`ROUTE_FALLBACK`: the owners did not answer; this node
takes the keys the shard will move to it). A read of a key this server does
not own is still served when its bytes are in a cache tier here, so no read
misses needlessly while the placement moves. Anything else is refused with
`NotOwner`, which names the owner and this server's map version.

Batches are all or nothing: one refused key refuses the call (naming that
key's owner), before any key is read or written; the client re-splits the
batch by the newer map.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from cacheclient.wire import PLACEMENT_VERSION_METADATA, ROUTE_FALLBACK, ROUTE_METADATA
from cacheclient.wire.placement import PlacementMap
from cachesvc.errors import NotOwner

__all__ = ["Ownership", "replicas_by_prefix"]

log = logging.getLogger(__name__)


def replicas_by_prefix(prefixes: Sequence[tuple[bytes, int]]) -> Callable[[bytes], int]:
    """The replicas of a key: those of the longest of `prefixes` ((prefix, replicas) pairs) it starts with, else 1."""
    ordered = sorted(((p, max(1, r)) for p, r in prefixes), key=lambda x: -len(x[0]))

    def replicas(key: bytes) -> int:
        for prefix, count in ordered:
            if key.startswith(prefix):
                return count
        return 1

    return replicas


class Ownership:
    """This server's view of the placement; see the module docstring.

    Args:
        address: this server's address as registered in the shard.
        replicas: how many nodes hold a key (its namespace's `replicas`).
        on_newer: called when a client routes by a newer map than this
            server's (the membership loop fetches it then, not at its next beat).
    """

    HISTORY = 3
    """Earlier placements remembered for `previous_owners`."""

    def __init__(
        self,
        address: str,
        replicas: Callable[[bytes], int] | None = None,
        on_newer: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self._replicas = replicas or (lambda key: 1)
        self.on_newer = on_newer
        self._map: PlacementMap | None = None
        self._earlier: tuple[PlacementMap, ...] = ()
        """The maps before `_map` whose placement differed from the next one's, newest first (at most `HISTORY`)."""
        self._newest_seen = 0
        """The newest map version a client routed by: above `_map`'s, this server is behind its clients."""

    @property
    def placement(self) -> PlacementMap | None:
        """The map this server routes by (None until the first fetch)."""
        return self._map

    def update(self, placement: PlacementMap) -> None:
        """Adopt `placement` unless it is older than the one held."""
        current = self._map
        if current is None or placement.version > current.version:
            self._map = placement
            if current is not None and (current.nodes, current.slots) != (placement.nodes, placement.slots):
                self._earlier = (current, *self._earlier)[: self.HISTORY]
            if current is None or placement.nodes != current.nodes:
                mine = placement.nodes.index(self.address) if self.address in placement.nodes else -1
                share = placement.slots.count(mine)
                log.info(
                    "placement version %d: %d nodes; this server owns %d of %d slots",
                    placement.version,
                    len(placement.nodes),
                    share,
                    len(placement.slots),
                )

    def previous_owners(self, key: bytes) -> list[str]:
        """The nodes other than this one that held `key` by the last `HISTORY` placements before this one,
        most recent first: whom to ask for a key's bytes before object storage, after the placement moved it.

        A key this server does not own by its current map is read here for a
        client whose owners did not answer (a fallback): its current owners
        are left out, so a node that is hung or cut off, which the client has
        just waited on, is not waited on again (one peer deadline per fill).
        Unless clients route by a newer map than this server's (it has just
        joined, say, and not yet fetched the map that gives it the key): the
        key's owners by its current map are then the key's previous owners,
        asked first.
        """
        replicas = self._replicas(key)
        skip = {self.address}
        maps = self._earlier
        current = self._map
        if current is not None and not self.owns(current, key):
            if self._newest_seen > current.version:
                maps = (current, *maps)
            else:
                skip.update(current.candidates(key)[:replicas])
        found: list[str] = []
        for placement in maps:
            for node in placement.candidates(key)[:replicas]:
                if node not in skip and node not in found:
                    found.append(node)
        return found

    def known_nodes(self) -> set[str]:
        """Every node the current and the remembered placements name."""
        return {node for placement in (self._map, *self._earlier) if placement is not None for node in placement.nodes}

    def owns(self, placement: PlacementMap, key: bytes) -> bool:
        """Whether this server is one of `key`'s replicas by `placement`."""
        replicas = self._replicas(key)
        if replicas == 1:
            return placement.locate(key) == self.address
        return self.address in placement.candidates(key)[:replicas]

    def check(
        self,
        keys: Sequence[bytes],
        metadata: Mapping[str, str | bytes],
        held: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Raises `NotOwner` for the first of `keys` this server must not serve to the caller.

        Args:
            keys: the call's keys.
            metadata: the call's invocation metadata.
            held: for a read, whether a cache tier here holds a key (served
                then, owned or not); None for a write.
        """
        routed = metadata.get(PLACEMENT_VERSION_METADATA)
        placement = self._map
        if routed is None or placement is None or not placement.nodes:
            return
        if metadata.get(ROUTE_METADATA) == ROUTE_FALLBACK:
            return
        try:
            client_version = int(routed)
        except ValueError:
            return
        if client_version > placement.version:
            self._newest_seen = max(self._newest_seen, client_version)
            if self.on_newer is not None:
                self.on_newer()
            return
        # A node the map leaves out (stopping, drained, down) sends every caller to the map, held copy or not.
        held_here = held if self.address in placement.nodes else None
        for key in keys:
            if self.owns(placement, key) or (held_here is not None and held_here(key)):
                continue
            raise NotOwner(key, placement.locate(key) or "", placement.version)
