"""Key namespaces: how the keys under a prefix are written (write mode, default lease and TTL), and what a
read hands back (`Hit`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_NAMESPACE", "Hit", "Namespace", "Namespaces", "WriteMode"]


class WriteMode(enum.StrEnum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"
    CACHE_ONLY = "cache-only"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Keys starting with `prefix` are written with `write_mode`.

    `lease_seconds` and `ttl_seconds` are the defaults of puts in the
    namespace that do not set their own (0: no lease, no TTL).
    `immutable`: see the field.
    """

    prefix: bytes
    write_mode: WriteMode
    lease_seconds: float = 0.0
    ttl_seconds: float = 0.0
    immutable: bool = False
    """A key's value never changes once written (a dataset): a put over a key that exists is refused
    (`Overwrite`), and a copy needs no check against object storage after a restart or a move."""


DEFAULT_NAMESPACE = Namespace(b"", WriteMode.WRITE_THROUGH)
"""Where a key under no configured prefix belongs."""


class Namespaces:
    """The configured namespaces; a key belongs to the one with the longest prefix it starts with.

    `replace` swaps the whole table at once (a cluster node follows the metadata shard's): a reader sees
    the old table or the new one, never a mix.
    """

    def __init__(self, namespaces: Sequence[Namespace]) -> None:
        self._by_length = sorted(namespaces, key=lambda ns: len(ns.prefix), reverse=True)

    def replace(self, namespaces: Sequence[Namespace]) -> None:
        self._by_length = sorted(namespaces, key=lambda ns: len(ns.prefix), reverse=True)

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self._by_length)

    def of(self, key: bytes) -> Namespace:
        for ns in self._by_length:
            if key.startswith(ns.prefix):
                return ns
        return DEFAULT_NAMESPACE

    def any_write_back(self) -> bool:
        return any(ns.write_mode is WriteMode.WRITE_BACK for ns in self._by_length)


@dataclass(frozen=True, slots=True)
class Hit:
    """A value found by the engine and the tier that answered."""

    value: bytes
    checksum: int
    tier: str
