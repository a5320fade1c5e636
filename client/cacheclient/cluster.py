"""`Cluster`: the public, typed view of the servers behind a `CacheClient`.

Modules that need more than keys and values (which node holds what, a
client of each node, the metadata shard) read it here, as `cache.cluster`,
instead of reaching into the client's routing. It is the same for every
client: a client of one server sees a cluster of that one node, whose
placement map names it alone and which has no shard.

The view holds no state of its own: it asks the client's transport, so a
routed client's answers follow its placement map as that map changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cacheclient.meta import MetaClient
    from cacheclient.node import NodeClient
    from cacheclient.wire.placement import PlacementMap

__all__ = ["Cluster", "Topology"]


class Topology(Protocol):
    """What a transport tells the `Cluster` view: its map, its per-node clients and its shard."""

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        """The placement map keys are routed by."""
        ...

    def node(self, address: str) -> NodeClient:
        """This process's shared client of node `address`."""
        ...

    @property
    def shard(self) -> MetaClient | None:
        """The metadata shard the map comes from, or None."""
        ...

    @property
    def routed(self) -> bool:
        """Whether keys are routed by the map (`meta=`, `nodes=`), not all sent to one server."""
        ...


class Cluster:
    """The nodes a `CacheClient` reaches, its placement map and its metadata shard (`CacheClient.cluster`).

    Args:
        topology: the client's transport, which knows the map and holds the per-node clients.
    """

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        """The placement map the client routes by (one server: a map of that one node, version 0).

        Args:
            refresh: ask the metadata shard for its newest map now, rather
                than the cached one (refreshed in the background).
            timeout: how long to wait for the shard when it is asked.

        Raises:
            UnavailableError: no map yet and the shard did not answer in time.
        """
        return self._topology.placement(refresh=refresh, timeout=timeout)

    def node(self, address: str) -> NodeClient:
        """The client of node `address` this process shares with the client's routing (fork-safe)."""
        return self._topology.node(address)

    def nodes(self, timeout: float | None = None) -> dict[str, NodeClient]:
        """A client of every node of the current placement map, by address (one server: just it)."""
        return {address: self.node(address) for address in self.placement(timeout=timeout).nodes}

    @property
    def shard(self) -> MetaClient | None:
        """The metadata shard, when the client routes by one (`meta=`); else None."""
        return self._topology.shard

    @property
    def routed(self) -> bool:
        """Whether the client routes each key by the map (`meta=` or `nodes=`); False for one server."""
        return self._topology.routed
