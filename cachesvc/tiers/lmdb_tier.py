"""L2: values on local disk (NVMe) in one LMDB environment under a byte budget.

Layout. Each value is one LMDB record: a header (`cachesvc.integrity`), the
original key when it is too long to be the LMDB key, then the value. Keys up to
`_INLINE_KEY_MAX` bytes are stored as b"k" + key; longer ones as b"h" + their
xxh3-128 digest, with the full key inside the record and checked on read.

Budget. LMDB's map size is the budget, so the file can never grow past it.
Entries are charged by the pages LMDB spends on them (a value over about 2 KiB
takes whole overflow pages; a 4 KiB value takes two), and the engine keeps the
charged total under `budget * _FILL`, leaving the rest for B-tree and free-list
pages. If LMDB still reports the map full (free pages pinned by a long reader),
`put` raises `TierFull` and the engine evicts more and retries.

Durability. Commits are not fsync'd one by one (`sync=False`): a committed
record survives the process being killed, which is the failure a cache server
meets; `close()` syncs. One writer at a time (a lock); readers are lock-free
LMDB snapshots, safe from any thread and from other processes opening the
same directory read-only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import xxhash

from cachesvc.errors import CorruptValue, TierFull
from cachesvc.integrity import FLAG_DIRTY, HEADER, checksum, pack_header, unpack_header
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["LMDBTier"]

_PAGE = 4096
_PAGE_HEADER = 16
_NODE_HEADER = 8
_INLINE_KEY_MAX = 500
# Largest record LMDB keeps inside a leaf page; beyond it the value takes
# overflow pages (LMDB's nodemax for 4 KiB pages).
_NODE_MAX = ((_PAGE - _PAGE_HEADER) // 2) & ~1
_FILL = 0.85
_MIN_MAP = 1 << 20


def _storage_key(key: bytes) -> bytes:
    if len(key) <= _INLINE_KEY_MAX:
        return b"k" + key
    return b"h" + xxhash.xxh3_128_digest(key)


class LMDBTier:
    """A byte-budgeted LMDB store of checksummed records."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, name: str = "l2") -> None:
        if capacity_bytes < _MIN_MAP:
            raise ValueError(f"{name}: capacity_bytes must be at least {_MIN_MAP}, got {capacity_bytes}")
        self.name = name
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.map_size = capacity_bytes
        self.capacity_bytes: int | None = int(capacity_bytes * _FILL) - 16 * _PAGE
        self._env = lmdb.open(
            str(self.path),
            map_size=self.map_size,
            sync=False,
            metasync=False,
            readahead=False,
            max_readers=256,
            max_dbs=0,
        )
        self._write_lock = threading.Lock()
        self._costs: dict[bytes, int] = {}
        self._used = 0
        for resident in self._scan_records():
            self._costs[resident.key] = resident.cost
            self._used += resident.cost

    @property
    def used_bytes(self) -> int:
        return self._used

    def cost(self, key: bytes, size: int) -> int:
        stored_key = 1 + (len(key) if len(key) <= _INLINE_KEY_MAX else 16)
        record = HEADER.size + (len(key) if len(key) > _INLINE_KEY_MAX else 0) + size
        node = _NODE_HEADER + stored_key + record
        if node <= _NODE_MAX:
            # Leaf pages run between half and fully used: charge twice the
            # node (plus its slot pointer) so the estimate stays an upper bound.
            return 2 * (node + 2)
        overflow_pages = -(-(record + _PAGE_HEADER) // _PAGE)
        return overflow_pages * _PAGE + 2 * (_NODE_HEADER + stored_key + 8 + 2)

    def get(self, key: bytes) -> Entry | None:
        with self._env.begin(buffers=True) as txn:
            record = txn.get(_storage_key(key))
            if record is None:
                return None
            header = unpack_header(record)
            if header is None:
                raise CorruptValue(self.name, key)
            start = HEADER.size + header.key_len
            if header.key_len and bytes(record[HEADER.size : start]) != key:
                # A digest collision or corrupt key bytes: not this key's value.
                raise CorruptValue(self.name, key)
            value = record[start:]
            if checksum(value) != header.checksum:
                raise CorruptValue(self.name, key)
            return Entry(bytes(value), header.checksum, bool(header.flags & FLAG_DIRTY))

    def put(self, key: bytes, value: bytes, checksum: int, *, dirty: bool = False) -> None:
        needed = self.cost(key, len(value))
        long_key = len(key) > _INLINE_KEY_MAX
        header = pack_header(checksum, FLAG_DIRTY if dirty else 0, len(key) if long_key else 0)
        with self._write_lock:
            freed = self._costs.get(key, 0)
            assert self.capacity_bytes is not None
            if self._used - freed + needed > self.capacity_bytes:
                raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(_storage_key(key), b"".join((header, key if long_key else b"", value)))
            except lmdb.MapFullError as exc:
                raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes)") from exc
            self._costs[key] = needed
            self._used += needed - freed

    def delete(self, key: bytes) -> bool:
        with self._write_lock:
            if key not in self._costs:
                return False
            with self._env.begin(write=True) as txn:
                txn.delete(_storage_key(key))
            self._used -= self._costs.pop(key)
            return True

    def contains(self, key: bytes) -> bool:
        return key in self._costs

    def scan(self) -> Iterator[ResidentKey]:
        return iter(self._scan_records())

    def _scan_records(self) -> list[ResidentKey]:
        found = []
        with self._env.begin(buffers=True) as txn:
            for stored_key, record in txn.cursor():
                header = unpack_header(record)
                if header is None:
                    # Unreadable header: the record will read as corrupt; charge
                    # it so the budget stays honest until the engine drops it.
                    key = bytes(stored_key[1:])
                    found.append(ResidentKey(key, self.cost(key, len(record)), False))
                    continue
                if header.key_len:
                    key = bytes(record[HEADER.size : HEADER.size + header.key_len])
                else:
                    key = bytes(stored_key[1:])
                size = len(record) - HEADER.size - header.key_len
                found.append(ResidentKey(key, self.cost(key, size), bool(header.flags & FLAG_DIRTY)))
        return found

    def sync(self) -> None:
        """Flushes committed records to disk."""
        self._env.sync(True)

    def close(self) -> None:
        with self._write_lock:
            self._env.sync(True)
            self._env.close()
