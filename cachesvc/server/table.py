"""The namespace table and tenants a cache server follows: its config file's until the shard has a table,
then the shard's.

A lone server (no `meta.addresses`) keeps the `[[namespaces]]` of its
config file, as before the shard kept them. In a cluster the membership
loop hands every placement map to `follow`; the map names the version of
the shard's table (`PlacementMap.namespaces_version`, 0 while the shard has
none) and a table of another version is fetched and applied at once, so a
change reaches every node within one heartbeat. The first table applied is
compared with the file's, and a difference is logged (the node follows the
shard). While the shard is unreachable the node keeps the last table it
applied, tenants and quotas included.

Applying a table swaps the engine's namespaces in one step
(`Namespaces.replace`); a change of some prefix's replicas makes every
cached copy be checked before it is served again (its replicas moved), and
each `on_tenants` listener gets the tenants.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from cacheclient.errors import CacheClientError
from cacheclient.meta import MetaClient, NamespaceEntry, NamespaceTable, TenantEntry
from cachesvc.config import NamespaceConfig
from cachesvc.engine import Engine, Namespace, WriteMode

__all__ = ["FollowedTable", "entries_of"]

log = logging.getLogger(__name__)


def entries_of(namespaces: Sequence[NamespaceConfig]) -> tuple[NamespaceEntry, ...]:
    """A config file's `[[namespaces]]` as table entries, by prefix."""
    return tuple(
        sorted(
            (
                NamespaceEntry(ns.prefix, ns.write_mode, ns.lease_seconds, ns.ttl_seconds, ns.replicas)
                for ns in namespaces
            ),
            key=lambda ns: ns.prefix,
        )
    )


class FollowedTable:
    """The table a server applies; see the module docstring.

    Args:
        file_namespaces: the config file's `[[namespaces]]`.
    """

    def __init__(self, file_namespaces: Sequence[NamespaceConfig]) -> None:
        self._file = entries_of(file_namespaces)
        self._engine: Engine | None = None
        self._fetch: Callable[[float], NamespaceTable] | None = None
        self._lock = threading.Lock()
        self.table = NamespaceTable(0, self._file)
        """What is applied: version 0 is the config file's."""
        self._replicas = _by_length(self._file)
        self.on_tenants: list[Callable[[Sequence[TenantEntry]], None]] = []

    def bind(self, engine: Engine, client: MetaClient | None = None) -> None:
        """Sets `engine`'s namespaces by the table from now on; with `client`, follows the shard's table."""
        self._engine = engine
        if client is not None:
            self._fetch = lambda timeout: client.namespaces(timeout=timeout)

    @property
    def namespaces(self) -> tuple[NamespaceEntry, ...]:
        return self.table.namespaces

    @property
    def tenants(self) -> tuple[TenantEntry, ...]:
        return self.table.tenants

    def replicas(self, key: bytes) -> int:
        """How many nodes hold `key`: its namespace's replicas (the longest prefix wins), else 1."""
        for prefix, replicas in self._replicas:
            if key.startswith(prefix):
                return replicas
        return 1

    def follow(self, version: int, timeout: float = 2.0) -> bool:
        """Fetches and applies the shard's table when `version` (named by a placement map) is not the one applied.

        Returns whether a table was applied. A failed fetch is logged; the last table stays.
        """
        if self._fetch is None or version == 0 or version == self.table.version:
            return False
        try:
            table = self._fetch(timeout)
        except CacheClientError as exc:
            log.warning(
                "namespace table version %d not fetched; keeping version %d: %s", version, self.table.version, exc
            )
            return False
        return self.apply(table)

    def apply(self, table: NamespaceTable) -> bool:
        """Applies `table` unless one of its version or later is applied; returns whether it was."""
        with self._lock:
            if table.version <= self.table.version:
                return False
            first = self.table.version == 0
            before = self._replicas
            if first and tuple(sorted(table.namespaces, key=lambda ns: ns.prefix)) != self._file:
                log.warning(
                    "the config file's namespaces %s differ from the metadata shard's table (version %d) %s: "
                    "following the shard's",
                    _describe(self._file),
                    table.version,
                    _describe(table.namespaces),
                )
            self.table = table
            self._replicas = _by_length(table.namespaces)
            if self._engine is not None:
                self._engine.namespaces.replace([self._engine_namespace(ns) for ns in table.namespaces])
                if self._replicas != before:
                    # Keys gained or lost replicas: copies held here may have been written elsewhere meanwhile.
                    self._engine.unvouch_cached()
            log.info("following namespace table version %d: %s", table.version, _describe(table.namespaces))
            listeners = list(self.on_tenants)
        for listener in listeners:
            listener(table.tenants)
        return True

    def _engine_namespace(self, ns: NamespaceEntry) -> Namespace:
        mode = WriteMode(ns.write_mode)
        if mode is WriteMode.WRITE_BACK and (self._engine is None or self._engine.l3 is None):
            log.error("namespace %r is write-back but this node has no object storage: written through", ns.prefix)
            mode = WriteMode.WRITE_THROUGH
        return Namespace(ns.prefix.encode(), mode, ns.lease_seconds, ns.ttl_seconds)


def _by_length(namespaces: Sequence[NamespaceEntry]) -> tuple[tuple[bytes, int], ...]:
    return tuple(sorted(((ns.prefix.encode(), max(1, ns.replicas)) for ns in namespaces), key=lambda x: -len(x[0])))


def _describe(namespaces: Sequence[NamespaceEntry]) -> str:
    return "[" + ", ".join(f"{ns.prefix!r} {ns.write_mode} replicas={ns.replicas}" for ns in namespaces) + "]"
