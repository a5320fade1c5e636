"""How a `CacheClient`'s calls reach the servers: the `Transport` protocol and its one-server implementation.

`CacheClient` is the front (argument checks, key conversion, the public
names); a transport carries each call to the servers that hold its keys.
Three implement it: `OneNode`, one server over one `NodeClient`;
`cacheclient.colocated.Colocated`, a `OneNode` whose reads come straight from
the server's shared L1 when it runs on this machine; and
`cacheclient.routing.Router`, a cluster routed by its placement map over a
`NodeClient` per node (reading co-located nodes' shared L1 the same way).

A transport takes keys as bytes (the front has converted them) and has the
meaning of the `CacheClient` method of the same name. It also tells the
`Cluster` view about itself (`cacheclient.cluster.Topology`: `placement`,
`node`, `shard`, `routed`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from cacheclient._batches import PutValue
from cacheclient.cluster import Topology
from cacheclient.meta import MetaClient
from cacheclient.node import Location, NodeClient
from cacheclient.node_plan import PrefetchPlan
from cacheclient.wire.placement import PlacementMap

__all__ = ["OneNode", "Transport"]


class Transport(Topology, Protocol):
    """What a `CacheClient` needs from the way to its servers; see the module docstring."""

    def get(self, key: bytes, *, release: bool, timeout: float | None) -> bytes | None: ...

    def get_many(self, keys: Sequence[bytes], *, release: bool, timeout: float | None) -> list[bytes | None]: ...

    def iter_pieces(
        self, keys: Sequence[bytes], *, release: bool, timeout: float | None, verify: bool
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """(key, the value's chunk data or None), in order, as the values arrive."""
        ...

    def get_with_tier(self, key: bytes, *, timeout: float | None) -> tuple[bytes, str] | None: ...

    def put_many(
        self,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        timeout: float | None,
        durable: bool,
    ) -> None: ...

    def delete(self, key: bytes, *, timeout: float | None) -> bool: ...

    def contains(self, key: bytes, *, cached_only: bool, timeout: float | None) -> bool: ...

    def contains_many(self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None) -> list[bool]: ...

    def locate_many(
        self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None
    ) -> list[Location | None]: ...

    def evict(self, key: bytes, *, timeout: float | None) -> bool: ...

    def with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> Transport:
        """This transport, over the same connections, with `metadata` added to every call."""
        ...

    def info(self, *, probe_object_storage: bool, timeout: float | None) -> dict[str, Any]: ...

    def prefetch(
        self, keys: list[bytes], *, window_bytes: int, sizes: Sequence[int] | None, priority: str
    ) -> PrefetchPlan: ...

    def stats(self, *, timeout: float | None) -> dict[str, Any]: ...

    def wait_ready(self, timeout: float) -> None: ...

    def close(self) -> None:
        """Closes every connection; the transport reconnects if used again."""
        ...

    def list(
        self, prefix: bytes, *, bucket: str, start_after: bytes, page_size: int, cached: bool, timeout: float | None
    ) -> Iterator[tuple[bytes, int]]: ...


class OneNode:
    """The transport of a client of one server: every call to its `NodeClient`.

    Its cluster is that one node: a static map of it, no shard. A node
    client asked for another address is made with the same settings (the
    caller named a server this client does not route to).
    """

    def __init__(self, node: NodeClient) -> None:
        self._node = node
        self.address = node.address
        self._placement: PlacementMap | None = None

    def with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> OneNode:
        return OneNode(self._node.with_metadata(metadata))

    def get(self, key: bytes, *, release: bool, timeout: float | None) -> bytes | None:
        return self._node.get(key, release=release, timeout=timeout)

    def get_many(self, keys: Sequence[bytes], *, release: bool, timeout: float | None) -> list[bytes | None]:
        return self._node.get_many(keys, release=release, timeout=timeout)

    def iter_pieces(
        self, keys: Sequence[bytes], *, release: bool, timeout: float | None, verify: bool
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        return self._node.iter_pieces(keys, release=release, timeout=timeout, verify=verify)

    def get_with_tier(self, key: bytes, *, timeout: float | None) -> tuple[bytes, str] | None:
        return self._node.get_with_tier(key, timeout=timeout)

    def put_many(
        self,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        timeout: float | None,
        durable: bool,
    ) -> None:
        self._node.put_many(pairs, lease=lease, ttl=ttl, timeout=timeout, durable=durable)

    def delete(self, key: bytes, *, timeout: float | None) -> bool:
        return self._node.delete(key, timeout=timeout)

    def contains(self, key: bytes, *, cached_only: bool, timeout: float | None) -> bool:
        return self._node.contains(key, cached_only=cached_only, timeout=timeout)

    def contains_many(self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None) -> list[bool]:
        return self._node.contains_many(keys, cached_only=cached_only, timeout=timeout)

    def locate_many(self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None) -> list[Location | None]:
        return self._node.locate_many(keys, cached_only=cached_only, timeout=timeout)

    def evict(self, key: bytes, *, timeout: float | None) -> bool:
        return self._node.evict(key, timeout=timeout)

    def info(self, *, probe_object_storage: bool, timeout: float | None) -> dict[str, Any]:
        return self._node.info(probe_object_storage=probe_object_storage, timeout=timeout)

    def prefetch(
        self, keys: list[bytes], *, window_bytes: int, sizes: Sequence[int] | None, priority: str
    ) -> PrefetchPlan:
        return self._node.prefetch(keys, window_bytes=window_bytes, sizes=sizes, priority=priority)

    def stats(self, *, timeout: float | None) -> dict[str, Any]:
        return self._node.stats(timeout=timeout)

    def wait_ready(self, timeout: float) -> None:
        self._node.wait_ready(timeout)

    def close(self) -> None:
        self._node.close()

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        """A static map of this one node (made once)."""
        if self._placement is None:
            self._placement = PlacementMap.static([self.address])
        return self._placement

    def node(self, address: str) -> NodeClient:
        """The node client itself for its address; a client of the same settings for another."""
        if address == self.address:
            return self._node
        return NodeClient(address, timeout=self._node.timeout, token=self._node.token, tls_ca=self._node.tls_ca)

    @property
    def shard(self) -> MetaClient | None:
        return None

    @property
    def routed(self) -> bool:
        return False

    def list(
        self, prefix: bytes, *, bucket: str, start_after: bytes, page_size: int, cached: bool, timeout: float | None
    ) -> Iterator[tuple[bytes, int]]:
        return self._node.list(
            prefix, bucket=bucket, start_after=start_after, page_size=page_size, cached=cached, timeout=timeout
        )
