"""L1: values in host memory under a byte budget.

Budget accounting: an entry costs `len(key) + len(value) + ENTRY_OVERHEAD`
bytes. ENTRY_OVERHEAD (160) approximates what CPython spends per entry beyond
the payload (the bytes objects' headers, the dict slot, the Entry object and
the policy's bookkeeping), so the budget tracks real memory use, not only
payload. A 4 KiB value with a 32-byte key costs 4,288 bytes.

Expiry: a value's `expires_at` is kept beside it (in a side table, only for
values that have one) and reported by `scan`; nothing here enforces it.
"""

from __future__ import annotations

from collections.abc import Iterator

from cachesvc.errors import TierFull
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["ENTRY_OVERHEAD", "MemoryTier"]

ENTRY_OVERHEAD = 160


class MemoryTier:
    """A dict of verified entries within `capacity_bytes`.

    Values in process memory are not re-hashed on every hit: they were
    verified when they entered the tier, and the checksum travels with them to
    the client, which verifies end to end.
    """

    def __init__(self, capacity_bytes: int, name: str = "l1") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{name}: capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self._entries: dict[bytes, Entry] = {}
        self._expires_at: dict[bytes, float] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def cost(self, key: bytes, size: int) -> int:
        return len(key) + size + ENTRY_OVERHEAD

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

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
        old = self._entries.get(key)
        freed = self.cost(key, len(old.value)) if old is not None else 0
        needed = self.cost(key, len(value))
        assert self.capacity_bytes is not None
        if self._used - freed + needed > self.capacity_bytes:
            raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
        self._entries[key] = Entry(bytes(value), checksum, dirty, version)
        if expires_at:
            self._expires_at[key] = expires_at
        else:
            self._expires_at.pop(key, None)
        self._used += needed - freed

    def delete(self, key: bytes) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self._expires_at.pop(key, None)
        self._used -= self.cost(key, len(old.value))
        return True

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def list_keys(self) -> list[bytes]:
        return list(self._entries)

    def scan(self) -> Iterator[ResidentKey]:
        for key, entry in list(self._entries.items()):
            size = len(entry.value)
            yield ResidentKey(key, self.cost(key, size), entry.dirty, self._expires_at.get(key, 0.0), size=size)

    def info(self) -> dict[str, str | int]:
        return {"kind": "memory", "capacity_bytes": self.capacity_bytes or 0}

    def close(self) -> None:
        self._entries.clear()
        self._expires_at.clear()
        self._used = 0
