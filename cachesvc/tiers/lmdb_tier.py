"""L2: values on local disk (NVMe) in one LMDB environment under a byte budget.

Layout. Each value is one LMDB record in the wire contract's format
(`cacheclient.wire.record`), which co-located clients read directly: a header
(checksum, dirty flag, wall-clock expiry), the original key when it is too long
to be the LMDB key, then the value. Records of the older header version
(without an expiry) still read, as values that never expire; every write uses
the current version.

Directory. Created with mode 0700 when it does not exist (cached values are
nobody else's to read); an existing directory keeps its mode.

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

from cacheclient.wire.record import (
    INLINE_KEY_MAX,
    open_record,
    pack_record,
    record_key,
    record_overhead,
    storage_key,
    unpack_header,
)
from cachesvc.errors import CorruptValue, TierFull
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["LMDBTier"]

_PAGE = 4096
_PAGE_HEADER = 16
_NODE_HEADER = 8
# Largest record LMDB keeps inside a leaf page; beyond it the value takes
# overflow pages (LMDB's nodemax for 4 KiB pages).
_NODE_MAX = ((_PAGE - _PAGE_HEADER) // 2) & ~1
_FILL = 0.85
_MIN_MAP = 1 << 20


class LMDBTier:
    """A byte-budgeted LMDB store of checksummed records."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, name: str = "l2") -> None:
        if capacity_bytes < _MIN_MAP:
            raise ValueError(f"{name}: capacity_bytes must be at least {_MIN_MAP}, got {capacity_bytes}")
        self.name = name
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        stored_key = 1 + (len(key) if len(key) <= INLINE_KEY_MAX else 16)
        record = record_overhead(key) + size
        node = _NODE_HEADER + stored_key + record
        if node <= _NODE_MAX:
            # Leaf pages run between half and fully used: charge twice the
            # node (plus its slot pointer) so the estimate stays an upper bound.
            return 2 * (node + 2)
        overflow_pages = -(-(record + _PAGE_HEADER) // _PAGE)
        return overflow_pages * _PAGE + 2 * (_NODE_HEADER + stored_key + 8 + 2)

    def get(self, key: bytes) -> Entry | None:
        with self._env.begin(buffers=True) as txn:
            record = txn.get(storage_key(key))
            if record is None:
                return None
            opened = open_record(key, record)
            if opened is None:
                # Not a record we read, a digest collision, or bytes that fail their checksum.
                raise CorruptValue(self.name, key)
            header, value = opened
            return Entry(bytes(value), header.checksum, header.dirty)

    def put(self, key: bytes, value: bytes, checksum: int, *, dirty: bool = False, expires_at: float = 0.0) -> None:
        needed = self.cost(key, len(value))
        record = pack_record(key, value, checksum, dirty=dirty, expires_at=expires_at)
        with self._write_lock:
            freed = self._costs.get(key, 0)
            assert self.capacity_bytes is not None
            if self._used - freed + needed > self.capacity_bytes:
                raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(storage_key(key), record)
            except lmdb.MapFullError as exc:
                raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes)") from exc
            self._costs[key] = needed
            self._used += needed - freed

    def delete(self, key: bytes) -> bool:
        with self._write_lock:
            if key not in self._costs:
                return False
            with self._env.begin(write=True) as txn:
                txn.delete(storage_key(key))
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
                key = record_key(stored_key, record, header)
                size = len(record) - header.value_start
                found.append(ResidentKey(key, self.cost(key, size), header.dirty, header.expires_at))
        return found

    def info(self) -> dict[str, str | int]:
        """The directory and map size: what a co-located reader needs to open the file."""
        return {"kind": "lmdb", "path": str(self.path.resolve()), "map_size": self.map_size}

    def sync(self) -> None:
        """Flushes committed records to disk."""
        self._env.sync(True)

    def close(self) -> None:
        with self._write_lock:
            self._env.sync(True)
            self._env.close()
