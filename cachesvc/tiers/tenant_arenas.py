"""A shared L1 in segments, one arena per tenant: a tenant's co-located client maps its own tenant's values only.

A process that maps an arena can read every byte of it, whatever a client
library checks; so a cluster node whose L1 is shared (`l1.shared`) keeps the
values of each tenant's keys in an arena of their own (`ArenaTier`, a memfd
no other process can open) and those of keys under no tenant in the main
one. The arena socket (`cachesvc.server.arena_socket`) hands a tenant's
token its own segment only, and the data and admin tokens every segment,
each with the prefixes it holds (`grant`).

To the engine this is one tier: one byte budget (`capacity_bytes`, L1's, is
what every segment holds together; the eviction policy, with tenants'
quotas, picks victims across them), one set of keys, one `SharedTier`
(published, concealed, revealed key by key in the key's segment; every
segment at once; the hits of every segment swept together). Each segment
is as large as the whole budget (a tenant without a quota may fill L1), its
memory reserved, not used: freed values are scrubbed and their pages given
back (`ArenaTier(scrub=True)`).

The tenants follow the shard's table (`retable`): a new tenant gets a
segment; a tenant removed, or whose token was rotated, loses it (its keys
move out, its memory is wiped and its arena closed, so a client that kept
the old mapping reads nothing more); a key whose tenant changed with the
table moves to its new segment, concealed until the engine serves it again.
A move that finds no room (a fragmented segment) leaves the key concealed
where it was, logged; a retired segment that still holds such keys is kept
(handed to no one, marked closed) until they leave it. Every change moves the main segment's segment
generation, so data-token clients map again and learn the new set.

Every method takes the tier's own lock: the engine calls under its lock,
the arena socket and the table's listener from their own threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cacheclient.meta import TenantEntry
from cacheclient.wire.arena import MAX_TENANT_SEGMENTS
from cacheclient.wire.scopes import token_sha256
from cachesvc.errors import TierFull
from cachesvc.tiers.arena import ArenaTier, Descriptors
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["TenantArenas"]

log = logging.getLogger(__name__)


@dataclass
class _Segment:
    tenant: str
    token_sha256: bytes
    prefixes: tuple[bytes, ...]
    arena: ArenaTier


class TenantArenas:
    """L1 in one shared arena per tenant (see the module docstring); the `Tier` contract plus `SharedTier`.

    Args:
        capacity_bytes: the byte budget of every segment together.
        name: the tier's name in stats and errors.
    """

    def __init__(self, capacity_bytes: int, name: str = "l1") -> None:
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self._lock = threading.RLock()
        self._main = ArenaTier(capacity_bytes, name)
        self._main.publisher = self._ask_publisher
        self._segments: dict[str, _Segment] = {}
        self._routes: tuple[tuple[bytes, _Segment], ...] = ()
        """(prefix, segment), longest prefix first."""
        self._where: dict[bytes, ArenaTier] = {}
        self._retired: list[ArenaTier] = []
        """Retired segments that still hold keys a move found no room for (`retable`)."""
        self._moving = False
        self.boot = self._main.boot
        self.misplaced = 0
        """Keys a table change could not move to their tenant's segment (left concealed where they were)."""
        self.publisher = lambda key: 0.0
        """`SharedTier.publisher`: asked by every segment."""

    def _ask_publisher(self, key: bytes) -> float | None:
        return None if self._moving else self.publisher(key)

    def _arenas(self) -> list[ArenaTier]:
        return [self._main, *(s.arena for s in self._segments.values()), *self._retired]

    def _route(self, key: bytes) -> ArenaTier:
        for prefix, segment in self._routes:
            if key.startswith(prefix):
                return segment.arena
        return self._main

    # -- the Tier contract ---------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(arena.used_bytes for arena in self._arenas())

    def cost(self, key: bytes, size: int) -> int:
        return self._main.cost(key, size)  # every segment has the same size, so the same charge

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            arena = self._where.get(key)
            return arena.get(key) if arena is not None else None

    def put(
        self,
        key: bytes,
        value: bytes,
        checksum: int,
        *,
        dirty: bool = False,
        expires_at: float = 0.0,
        version: int = 0,
    ) -> None:
        with self._lock:
            if self.used_bytes - self._cost_of(key) + self.cost(key, len(value)) > (self.capacity_bytes or 0):
                raise TierFull(f"{self.name}: {len(value)} bytes do not fit ({self.used_bytes}/{self.capacity_bytes})")
            arena = self._route(key)
            old = self._where.get(key)
            arena.put(key, value, checksum, dirty=dirty, expires_at=expires_at, version=version)
            self._where[key] = arena
            if old is not None and old is not arena:
                self._delete_from(old, key)  # it moved with the table: its old segment no longer holds it

    def _cost_of(self, key: bytes) -> int:
        arena = self._where.get(key)
        size = arena.size_of(key) if arena is not None else None
        return self.cost(key, size) if size is not None else 0

    def delete(self, key: bytes) -> bool:
        with self._lock:
            arena = self._where.pop(key, None)
            return arena is not None and self._delete_from(arena, key)

    def _delete_from(self, arena: ArenaTier, key: bytes) -> bool:
        deleted = arena.delete(key)
        if arena in self._retired and not arena.used_bytes:
            self._retired.remove(arena)
            arena.close(wipe=True)
        return deleted

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._where

    def list_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._where)

    def scan(self) -> Iterator[ResidentKey]:
        with self._lock:
            found = [resident for arena in self._arenas() for resident in arena.scan()]
        yield from found

    def info(self) -> dict[str, str | int]:
        with self._lock:
            return {**self._main.info(), "segments": 1 + len(self._segments)}

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas()[1:]:
                arena.close(wipe=True)
            self._segments.clear()
            self._retired.clear()
            self._routes = ()
            self._where.clear()
            self._main.close()

    # -- SharedTier ------------------------------------------------------------

    def conceal(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                arena = self._where.get(key)
                if arena is not None:
                    arena.conceal([key])

    def conceal_all(self) -> None:
        with self._lock:
            for arena in self._arenas():
                arena.conceal_all()

    def reveal(self, key: bytes) -> None:
        with self._lock:
            arena = self._where.get(key)
            if arena is not None:
                arena.reveal(key)

    def published(self, key: bytes) -> bool:
        with self._lock:
            arena = self._where.get(key)
            return arena is not None and arena.published(key)

    def take_hits(self) -> list[bytes]:
        with self._lock:
            return [key for arena in self._arenas() for key in arena.take_hits()]

    # -- segments ----------------------------------------------------------------

    def grant(self, token: str | None) -> list[Descriptors]:
        """The segments a co-located client may map: with None (the data or admin token, or a server without
        tokens), the main one first, then every tenant's with its prefixes; with a tenant's token, that
        tenant's only; [] for any other token."""
        with self._lock:
            if token is None:
                return [
                    self._main.descriptors(),
                    *(s.arena.descriptors(s.prefixes) for s in self._segments.values()),
                ]
            hashed = token_sha256(token)
            for segment in self._segments.values():
                if segment.token_sha256 == hashed:
                    return [segment.arena.descriptors(segment.prefixes)]
            return []

    def segment_of(self, key: bytes) -> str:
        """The tenant whose segment holds `key` ("" for the main one, or not held)."""
        with self._lock:
            arena = self._where.get(key)
            for segment in self._segments.values():
                if segment.arena is arena:
                    return segment.tenant
            return ""

    def retable(self, tenants: Sequence[TenantEntry]) -> None:
        """Follows the tenants of a new table (see the module docstring)."""
        wanted = {t.name: t for t in tenants if t.prefixes and t.token_sha256}
        with self._lock:
            retired: list[_Segment] = []
            changed = False
            for name, segment in list(self._segments.items()):
                tenant = wanted.get(name)
                if tenant is None or tenant.token_sha256 != segment.token_sha256:
                    retired.append(self._segments.pop(name))
                    changed = True
                elif _prefixes(tenant) != segment.prefixes:
                    segment.prefixes = _prefixes(tenant)
                    changed = True
            for name, tenant in wanted.items():
                if name in self._segments:
                    continue
                if len(self._segments) >= MAX_TENANT_SEGMENTS:
                    log.warning(
                        "%s: tenant %r gets no arena of its own (at most %d)", self.name, name, MAX_TENANT_SEGMENTS
                    )
                    continue
                try:
                    arena = ArenaTier(self.capacity_bytes or 0, f"{self.name}-{name}", scrub=True)
                except OSError as exc:  # no memory for it: this tenant reads over gRPC, its keys in the main one
                    log.error("%s: tenant %r gets no arena of its own: %s", self.name, name, exc)
                    continue
                arena.publisher = self._ask_publisher
                self._segments[name] = _Segment(name, tenant.token_sha256, _prefixes(tenant), arena)
                changed = True
            if not changed:
                return
            routes = [(prefix, s) for s in self._segments.values() for prefix in s.prefixes]
            self._routes = tuple(sorted(routes, key=lambda r: -len(r[0])))
            self._move_misplaced()
            for segment in retired:
                if segment.arena.used_bytes:  # keys a move found no room for: kept, handed to no one
                    log.error("%s: tenant %r's old arena keeps keys it could not move", self.name, segment.tenant)
                    segment.arena.conceal_all()
                    segment.arena.mark_closed()
                    self._retired.append(segment.arena)
                else:
                    segment.arena.close(wipe=True)
            self._main.new_segments()
            log.info("%s: %d tenant arenas (%s)", self.name, len(self._segments), ", ".join(self._segments) or "none")

    def _move_misplaced(self) -> None:
        """Moves each key whose segment is not its route's any more, concealed (lock held)."""
        self._moving = True
        try:
            for key, arena in list(self._where.items()):
                target = self._route(key)
                if target is arena:
                    continue
                entry = arena.get(key)
                if entry is None:
                    continue
                try:
                    target.put(
                        key,
                        entry.value,
                        entry.checksum,
                        dirty=entry.dirty,
                        expires_at=arena.expires_at(key),
                        version=entry.version,
                    )
                except TierFull as exc:
                    self.misplaced += 1
                    arena.conceal([key])
                    log.error("%s: %r stays concealed in its old arena: %s", self.name, key[:200], exc)
                    continue
                arena.delete(key)  # a retired one is closed by `retable` once this is done
                self._where[key] = target
        finally:
            self._moving = False


def _prefixes(tenant: TenantEntry) -> tuple[bytes, ...]:
    return tuple(sorted(prefix.encode() for prefix in tenant.prefixes))
