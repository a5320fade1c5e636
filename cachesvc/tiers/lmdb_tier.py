"""L2: values on local disk (NVMe) in one LMDB environment under a byte budget.

Layout. Values of `pack_below` bytes or more are one LMDB record each, in the
wire contract's format (`cacheclient.wire.record`): a header (checksum, dirty
flag, wall-clock expiry), the original key when it is too long to be the
LMDB key, then the value. Records of the older header version (without an
expiry) still read, as values that never expire.

Smaller values are packed: LMDB spends whole 4 KiB pages on a value stored
as its own record (a 4 KiB value takes two, 1 KiB values leave leaf pages
half empty), so their records are laid end to end in the pack, a byte space
held in one-page LMDB records, and the value's key holds a locator of where
its record lies (`cachesvc.tiers.pack` keeps the free space; the format is in
the wire contract, which co-located clients read with). A put writes the
pack pages its record touches, the locator and the removal of pages it
emptied in one LMDB transaction. Holes that evictions leave are filled by
the next small puts; when a large value finds the map full because pages are
held by a few small records, `compact` moves those records and frees the
pages.

Large values. A value of `file_from` bytes or more (1 MiB by default) is a
file of its own in the directory's `values/` (`cacheclient.wire.record`'s
file reference under its LMDB key): written once, by `pwrite` from the
caller's buffer (or by a co-located client into a file the server handed it,
`put` of a `PlacedFile`), into `incoming/` first, then renamed into place
and indexed in one LMDB transaction. Nothing is visible before the index
commits: a kill before leaves a file in `incoming/` (or an unindexed one in
`values/`), and both are deleted at the next open. A value replaced or
deleted loses its index entry first and its file after; a reader that
opened the file before reads the old bytes and checks them against the
reference it found in its snapshot. Each such value is charged its size in
whole pages plus its index entry; `used_bytes` counts both kinds.

Directory. Created with mode 0700 when it does not exist (cached values are
nobody else's to read); an existing directory keeps its mode.

Budget. LMDB's map size is the budget, so the file can never grow past it.
Entries are charged what they take on disk: a plain record its pages, a
packed one its share of pack pages plus its locator in a B-tree leaf (whose
pages run about 60% full under churn); the engine keeps the charged total
under `budget * _FILL`, leaving the rest for B-tree branches, the free list
and holes. A write (a delete too: LMDB copies the pages it changes) that
finds the map full is tried again a few times over 30 ms, as readers holding
old pages let go of them; then a `put` compacts the pack and tries again,
a packed one for up to `patience` (0.5 s), as a delete does from the start (it is how the
engine makes room, and it needs only a few pages), and raises `TierFull`
(the engine evicts more).

Headroom. LMDB reuses a freed page only once no read transaction still
sees it, so the free pages a write needs are what the budget leaves free
less what readers pin: a reader that is slow to finish (a busy machine
descheduled its thread) pins every page freed since it began. A map found
full is the sign the headroom is too small for this machine's load: each
time, the budget (`capacity_bytes`) drops by 1/32 of the map, down to half
of it, and the engine evicts to the new budget; after `_HEADROOM_RECOVERY`
writes in a row that found room, it rises a step again, up to where it
started (`info()` shows both).

Direct readers. Co-located clients read this directory themselves
(`cacheclient._lmdb_reader`), so what the engine would check before serving
is marked on disk for them: `mark_unvouched` writes a marker key beside
each value the engine must check against its source first (after a restart,
a move of its slot, a lost lease), a put of a marked key writes its marker
in the same transaction as its record, `unmark` removes it once the engine
vouched for the value, and a delete removes both; `in_doubt` writes one key
that turns every direct read off while the server doubts its lease. Markers
are small and not counted in the budget. And `serve_direct_reads` takes an
exclusive `flock` on `SERVING_LOCK` in the directory, held until `close`
(or the process dies): a reader reads nothing while no server holds it, so
the file of a killed node, whose copies other nodes may have superseded
while it was down, is not read (the engine takes it once the copies read
back at its start are marked).

Durability. Commits are not fsync'd one by one (`sync=False`): a committed
transaction survives the process being killed, which is the failure a cache
server meets, and a put or delete is one transaction, so a kill at any point
leaves the old state or the new one; `close()` syncs. `sync_keys` makes the
values of a batch (a durable put's) survive the machine losing power too:
their files `fdatasync`ed, the directory naming them, and LMDB synced. One writer at a time (a
lock); readers are lock-free LMDB snapshots, safe from any thread and from
other processes opening the same directory read-only.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lmdb

from cacheclient.wire.record import (
    FILE_REF,
    FILE_VALUES_DIR,
    HEADER,
    IN_DOUBT_KEY,
    INLINE_KEY_MAX,
    LOCATOR,
    MAX_PACKED_RECORD,
    PACK_PAGE_BYTES,
    PACK_PAGE_PREFIX,
    SERVING_LOCK,
    SPAN,
    UNVOUCHED_PREFIX,
    file_ref,
    file_value_name,
    gather,
    is_file_ref,
    is_locator,
    open_record,
    open_stored,
    pack_file_ref,
    pack_locator,
    pack_page_key,
    pack_record,
    read_file_value,
    record_key,
    record_overhead,
    storage_key,
    unpack_header,
    unpack_locator,
)
from cacheclient.wire.record import checksum as xxh3
from cachesvc.errors import CorruptValue, TierFull
from cachesvc.tiers.base import Entry, PlacedFile, ResidentKey
from cachesvc.tiers.pack import PackSpace, Span

__all__ = ["FILE_FROM", "INCOMING_DIR", "PACK_BELOW", "LMDBTier"]

log = logging.getLogger(__name__)

_PAGE = 4096
_KEY_LEN_END = 14
"""Where a record header's key-length field ends (magic 2, version 1, flags 1, checksum 8, key length 2)."""
_PAGE_HEADER = 16
_NODE_HEADER = 8
_SLOT = 2
# Largest record LMDB keeps inside a leaf page; beyond it the value takes
# overflow pages (LMDB's nodemax for 4 KiB pages).
_NODE_MAX = ((_PAGE - _PAGE_HEADER) // 2) & ~1
_FILL = 0.85
_MIN_MAP = 1 << 20
# A pack page's leaf node: header, key, the number of its overflow page.
_PACK_PAGE_NODE = _NODE_HEADER + len(pack_page_key(0)) + 8 + _SLOT
# Leaf pages of locators (random keys, inserted and deleted) run about 60%
# full; pack pages are appended, their leaves fuller.
_LOCATOR_LEAF_FILL = 0.6
_PACK_LEAF_FILL = 0.8
_COMPACT_PAGES = 64
_FULL_MAP_TRIES = 5
_FULL_MAP_PAUSE = 0.002
"""Seconds before the first retry of a write that found the map full (doubling: 30 ms in all)."""
_HEADROOM_STEP = 1 / 32
"""Of the map: how far the budget drops each time the map is found full (and rises again)."""
_MIN_BUDGET = 0.5
"""Of the map: the lowest the budget drops to."""
_HEADROOM_RECOVERY = 10_000
"""Writes in a row that found room before the budget rises a step again."""

PACK_BELOW = 64 << 10
"""Values shorter than this are packed. From 64 KiB up a record of its own wastes under 6%."""
FILE_FROM = 1 << 20
"""Values of this many bytes or more are files of their own (see the module docstring)."""
INCOMING_DIR = "incoming"
"""Where a large value's file is written before it is renamed into `FILE_VALUES_DIR` and indexed."""


@dataclass(frozen=True, slots=True)
class _Found:
    """A value found on open: as the engine sees it, and its locator when it is packed."""

    resident: ResidentKey
    locator: bytes | None
    readable: bool = True
    """Whether its header could be read."""
    file_id: int | None = None
    """The file of a large value."""


class LMDBTier:
    """A byte-budgeted LMDB store of checksummed records, small ones packed.

    Args:
        path: the LMDB directory.
        capacity_bytes: the map size: the file never grows past it.
        name: the tier's name in stats and errors.
        pack_below: values shorter than this are packed; 0 stores every
            value as a record of its own (the layout before packing).
        file_from: values of this many bytes or more are files of their own; 0: none is.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        name: str = "l2",
        *,
        pack_below: int = PACK_BELOW,
        file_from: int = FILE_FROM,
    ) -> None:
        if capacity_bytes < _MIN_MAP:
            raise ValueError(f"{name}: capacity_bytes must be at least {_MIN_MAP}, got {capacity_bytes}")
        if not 0 <= pack_below <= MAX_PACKED_RECORD // 2:
            raise ValueError(f"{name}: pack_below must be between 0 and {MAX_PACKED_RECORD // 2}, got {pack_below}")
        self.name = name
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.map_size = capacity_bytes
        self.pack_below = pack_below
        if file_from and file_from <= pack_below:
            raise ValueError(f"{name}: file_from ({file_from}) must be over pack_below ({pack_below}), or 0")
        self.file_from = file_from
        self.incoming = self.path / INCOMING_DIR
        self._files = self.path / FILE_VALUES_DIR
        for directory in (self.incoming, self._files):
            directory.mkdir(mode=0o700, exist_ok=True)
        self._file_ids: dict[bytes, int] = {}
        """Each large value's file id (`FILE_VALUES_DIR`)."""
        self.capacity_bytes: int | None = int(capacity_bytes * _FILL) - 16 * _PAGE
        self._full_budget = self.capacity_bytes
        self.patience = 0.5
        """Seconds a delete, or a put the pack's compaction did not help, waits for readers to let go of pages
        when the map is full, before `TierFull`."""
        self.map_full = 0
        """Writes that found the map full (each lowered the budget a step, down to its floor)."""
        self._clean_writes = 0
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
        self._locators: dict[bytes, bytes] = {}
        """Each packed value's locator as written (so a locator damaged on disk never frees others' bytes)."""
        self._space = PackSpace(PACK_PAGE_BYTES)
        self._used = 0
        self._marked: set[bytes] = set()
        """Keys whose stored value carries an unvouched marker (whenever it is stored)."""
        self._markers: set[bytes] = set()
        """Storage keys whose marker is on disk."""
        self._serving_fd = -1
        """The lock direct readers look for, while held (`serve_direct_reads`); -1 otherwise."""
        self.readable: Callable[[bytes], bool] | None = None
        """Whether a value of a key may be read directly at all (a cluster node's: a key it owns and does not
        withhold); a value stored of any other key is marked. None: any."""
        self._open_existing()

    @property
    def used_bytes(self) -> int:
        return self._used

    def cost(self, key: bytes, size: int) -> int:
        stored_key = 1 + (len(key) if len(key) <= INLINE_KEY_MAX else 16)
        if self.file_from and size >= self.file_from:
            reference = FILE_REF.size + (len(key) if len(key) > INLINE_KEY_MAX else 0)
            return -(-size // _PAGE) * _PAGE + 2 * (_NODE_HEADER + stored_key + reference + _SLOT)
        record = record_overhead(key) + size
        if size < self.pack_below:
            pack = record / PACK_PAGE_BYTES * (_PAGE + _PACK_PAGE_NODE / _PACK_LEAF_FILL)
            locator = _NODE_HEADER + stored_key + LOCATOR.size + SPAN.size + _SLOT
            return math.ceil(pack + locator / _LOCATOR_LEAF_FILL)
        node = _NODE_HEADER + stored_key + record
        if node <= _NODE_MAX:
            # Leaf pages run between half and fully used: charge twice the
            # node (plus its slot pointer) so the estimate stays an upper bound.
            return 2 * (node + _SLOT)
        overflow_pages = -(-(record + _PAGE_HEADER) // _PAGE)
        return overflow_pages * _PAGE + 2 * (_NODE_HEADER + stored_key + 8 + _SLOT)

    def get(self, key: bytes) -> Entry | None:
        with self._env.begin(buffers=True) as txn:
            stored = txn.get(storage_key(key))
            if stored is None:
                return None
            if is_file_ref(stored):
                ref = file_ref(key, stored)
                found = None if ref is None else read_file_value(self.path, ref)
                if ref is None or found is None:
                    raise CorruptValue(self.name, key)
                return Entry(bytes(found), ref.header.checksum, ref.header.dirty, ref.header.version)
            opened = open_stored(key, stored, txn.get)
            if opened is None:
                # Not a record we read, a digest collision, a damaged locator, or bytes that fail their checksum.
                raise CorruptValue(self.name, key)
            header, value = opened
            return Entry(bytes(value), header.checksum, header.dirty, header.version)

    def mark_clean(self, key: bytes, *, version: int, expires_at: float) -> int | None:
        """Rewrites a large value's index entry without its dirty flag (`MarkableTier`): its file is left as it
        is; its size, or 0 when nothing is stored. None for a value in LMDB (its record must be rewritten)."""
        with self._write_lock:
            file_id = self._file_ids.get(key)
            if file_id is None:
                return None if key in self._costs else 0
            with self._env.begin(buffers=True) as txn:
                stored = txn.get(storage_key(key))
                ref = file_ref(key, stored) if stored is not None and is_file_ref(stored) else None
            if ref is None or ref.file_id != file_id:
                return None
            version = version or ref.header.version  # 0: the stored one stays
            if not ref.header.dirty and ref.header.version == version and ref.header.expires_at == expires_at:
                return ref.size
            reference = pack_file_ref(
                key, ref.header.checksum, ref.size, file_id, dirty=False, expires_at=expires_at, version=version
            )
            self._file_ids.pop(key)  # kept by `_write`: the file stays
            try:
                self._full_map_waits(lambda: self._write(key, reference, packed=False), patience=self.patience)
            except lmdb.MapFullError as exc:
                raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes) for a file's index") from exc
            finally:
                self._file_ids[key] = file_id
            return ref.size

    def get_mapped(self, key: bytes) -> Entry | None:
        """`get`, a large value as a read-only map of its file (`MappedTier`): an upload streams it from the
        page cache, with no copy of the whole value in this process."""
        with self._env.begin(buffers=True) as txn:
            stored = txn.get(storage_key(key))
            ref = file_ref(key, stored) if stored is not None and is_file_ref(stored) else None
        if stored is None or ref is None:
            return self.get(key)
        try:
            fd = os.open(self._files / file_value_name(ref.file_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self.get(key)  # replaced or deleted since the lookup
        try:
            if os.fstat(fd).st_size != ref.size:
                raise CorruptValue(self.name, key)
            mapped = mmap.mmap(fd, ref.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if xxh3(cast(bytes, mapped)) != ref.header.checksum:
            mapped.close()
            raise CorruptValue(self.name, key)
        return Entry(cast(bytes, mapped), ref.header.checksum, ref.header.dirty, ref.header.version)

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
        needed = self.cost(key, len(value))
        if self.file_from and len(value) >= self.file_from:
            self._put_file(key, value, checksum, needed, dirty=dirty, expires_at=expires_at, version=version)
            return
        packed = len(value) < self.pack_below
        record = pack_record(key, value, checksum, dirty=dirty, expires_at=expires_at, packed=packed, version=version)
        with self._write_lock:
            freed = self._costs.get(key, 0)
            assert self.capacity_bytes is not None
            if self._used - freed + needed > self.capacity_bytes:
                raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            try:
                # A large value's MapFull may be the lack of a long enough run of free pages, not of pages.
                self._full_map_waits(lambda: self._write(key, record, packed), widen=packed)
            except lmdb.MapFullError as exc:
                # Pages held by a few packed records may be what is missing.
                if not self._compact(_COMPACT_PAGES):
                    raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes)") from exc
                try:
                    # Waiting finds a large value no run of pages: only a packed one waits for readers.
                    self._full_map_waits(
                        lambda: self._write(key, record, packed),
                        patience=self.patience if packed else 0.0,
                        widen=packed,
                    )
                except lmdb.MapFullError as again:
                    raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes)") from again
            self._costs[key] = needed
            self._used += needed - freed

    def _put_file(
        self,
        key: bytes,
        value: bytes,
        checksum: int,
        needed: int,
        *,
        dirty: bool,
        expires_at: float,
        version: int,
    ) -> None:
        """Stores a large value as a file of its own (see the module docstring)."""
        file_id = int.from_bytes(os.urandom(8), "little") | 1
        placed = value.path if isinstance(value, PlacedFile) and value.path.parent == self.incoming else None
        incoming: Path | None = placed if placed is not None else self.incoming / file_value_name(file_id)
        if placed is None:
            assert incoming is not None
            _write_file(incoming, value)
        reference = pack_file_ref(
            key, checksum, len(value), file_id, dirty=dirty, expires_at=expires_at, version=version
        )
        try:
            with self._write_lock:
                freed = self._costs.get(key, 0)
                assert self.capacity_bytes is not None
                if self._used - freed + needed > self.capacity_bytes:
                    raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
                assert incoming is not None
                os.rename(incoming, self._files / file_value_name(file_id))
                incoming = None
                try:
                    self._full_map_waits(lambda: self._write(key, reference, packed=False), patience=self.patience)
                except lmdb.MapFullError as exc:
                    _unlink(self._files / file_value_name(file_id))
                    raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes) for a file's index") from exc
                self._file_ids[key] = file_id
                self._costs[key] = needed
                self._used += needed - freed
        finally:
            if incoming is not None and placed is None:
                _unlink(incoming)

    def _write(self, key: bytes, record: bytes, packed: bool) -> None:
        """Stores `record` for `key` and drops its old one, in one transaction. Caller holds the write lock."""
        old = self._spans(key)
        old_file = self._file_ids.get(key)
        spans = self._space.plan(len(record)) if packed else []
        emptied = self._space.emptied(old, spans)
        locator = pack_locator(spans) if packed else b""
        stored_key = storage_key(key)
        marked = key in self._marked or (self.readable is not None and not self.readable(key))
        had_marker = stored_key in self._markers
        with self._env.begin(write=True, buffers=True) as txn:
            if packed:
                self._write_pack(txn, spans, record)
                txn.put(stored_key, locator)
            else:
                txn.put(stored_key, record)
            for page in emptied:
                txn.delete(pack_page_key(page))
            if marked and not had_marker:
                txn.put(UNVOUCHED_PREFIX + stored_key, b"")
            elif had_marker and not marked:
                txn.delete(UNVOUCHED_PREFIX + stored_key)
        if marked:
            self._markers.add(stored_key)
        else:
            self._markers.discard(stored_key)
        self._space.apply(spans, old)
        if packed:
            self._locators[key] = locator
        else:
            self._locators.pop(key, None)
        if old_file is not None:
            del self._file_ids[key]
            _unlink(self._files / file_value_name(old_file))

    def _spans(self, key: bytes) -> list[Span]:
        """Where the packed record of `key` lies ([] when it is not packed)."""
        locator = self._locators.get(key)
        return [] if locator is None else unpack_locator(locator) or []

    def _write_pack(self, txn: Any, spans: Sequence[Span], record: bytes) -> None:
        """Writes `record` into the pack pages `spans` cover (read, patched, put back)."""
        patches: dict[int, list[tuple[int, memoryview]]] = {}
        source = memoryview(record)
        pos = 0
        for start, length in spans:
            end = start + length
            while start < end:
                page, offset = divmod(start, PACK_PAGE_BYTES)
                piece = min(end - start, PACK_PAGE_BYTES - offset)
                patches.setdefault(page, []).append((offset, source[pos : pos + piece]))
                start += piece
                pos += piece
        for page in sorted(patches):
            page_key = pack_page_key(page)
            fresh = page >= self._space.end_page
            current = None if fresh else txn.get(page_key)
            content = bytearray(PACK_PAGE_BYTES) if current is None else bytearray(current)
            for offset, data in patches[page]:
                content[offset : offset + len(data)] = data
            # Fresh pages come past every key there is: appended, their leaves fill up.
            written = txn.put(page_key, content, append=fresh)
            assert written, f"pack page {page} could not be written"

    def delete(self, key: bytes) -> bool:
        with self._write_lock:
            if key not in self._costs:
                return False
            spans = self._spans(key)
            emptied = self._space.emptied(spans)

            stored_key = storage_key(key)

            def remove() -> None:
                with self._env.begin(write=True) as txn:
                    txn.delete(stored_key)
                    txn.delete(UNVOUCHED_PREFIX + stored_key)
                    for page in emptied:
                        txn.delete(pack_page_key(page))

            try:
                self._full_map_waits(remove, patience=self.patience)
            except lmdb.MapFullError as exc:
                # A delete copies the pages it changes too: none free for as long as readers held them.
                raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes) for a delete") from exc
            self._space.apply(released=spans)
            self._locators.pop(key, None)
            self._markers.discard(stored_key)
            self._used -= self._costs.pop(key)
            file_id = self._file_ids.pop(key, None)
            if file_id is not None:
                _unlink(self._files / file_value_name(file_id))
            return True

    # -- what direct readers may read --------------------------------------

    def mark_unvouched(self, keys: Sequence[bytes]) -> None:
        """Direct readers skip the values of `keys` (now, and whenever one is stored) until `unmark`."""
        with self._write_lock:
            self._marked.update(keys)
            due = [sk for sk in {storage_key(k) for k in keys if k in self._costs} if sk not in self._markers]
            if due:
                self._write_markers(due, put=True)

    def unmark(self, key: bytes, *, now: bool = True) -> None:
        """Direct readers may read the value of `key` again: its marker goes now, or (`now` False: a put
        is about to replace the value, or it is gone) with the next write of `key`."""
        with self._write_lock:
            self._marked.discard(key)
            stored_key = storage_key(key)
            if now and stored_key in self._markers and (self.readable is None or self.readable(key)):
                self._write_markers([stored_key], put=False)

    def unmark_many(self, keys: Sequence[bytes]) -> None:
        """`unmark` of each of `keys` now, in one write (a listing page's worth of vouched copies)."""
        with self._write_lock:
            self._marked.difference_update(keys)
            due = [
                stored_key
                for key in keys
                if (stored_key := storage_key(key)) in self._markers and (self.readable is None or self.readable(key))
            ]
            if due:
                self._write_markers(due, put=False)

    def hide(self, key: bytes) -> None:
        """Marks the stored value of `key` (if any) until its next write or delete: a put is replacing it."""
        if key not in self._costs:
            return  # nothing stored (the caller holds the key's stripe: no write of it runs now)
        with self._write_lock:
            stored_key = storage_key(key)
            if key in self._costs and stored_key not in self._markers:
                self._write_markers([stored_key], put=True)

    def mark_unreadable(self) -> int:
        """Marks every stored value `readable` now refuses (after a new placement map); returns how many."""
        readable = self.readable
        if readable is None:
            return 0
        with self._write_lock:
            keys = [key for key in self._costs if storage_key(key) not in self._markers and not readable(key)]
            if keys:
                self._write_markers([storage_key(key) for key in keys], put=True)
        return len(keys)

    def serve_direct_reads(self) -> None:
        """Direct readers may read the file from now until `close` (see the module docstring): takes the lock
        they look for. A lock another process holds (two servers on one directory) is logged and left."""
        if self._serving_fd >= 0:
            return
        fd = os.open(self.path / SERVING_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            log.warning(
                "%s: another process holds %s; it serves this directory's direct reads", self.name, SERVING_LOCK
            )
            return
        self._serving_fd = fd

    def in_doubt(self, doubt: bool) -> None:
        """Turns every direct read off (`doubt`) or back on (the markers still apply)."""
        with self._write_lock:
            self._put_or_delete([IN_DOUBT_KEY], put=doubt)

    def _write_markers(self, stored_keys: Sequence[bytes], *, put: bool) -> None:
        """Writes (or deletes) the markers of `stored_keys` in one transaction. Caller holds the write lock."""
        self._put_or_delete([UNVOUCHED_PREFIX + stored_key for stored_key in stored_keys], put=put)
        if put:
            self._markers.update(stored_keys)
        else:
            self._markers.difference_update(stored_keys)

    def _put_or_delete(self, lmdb_keys: Sequence[bytes], *, put: bool) -> None:
        """Puts (empty) or deletes `lmdb_keys` in one transaction, waiting for readers as any write does.
        Caller holds the write lock.

        Raises:
            TierFull: the map stayed full.
        """

        def write() -> None:
            with self._env.begin(write=True) as txn:
                for lmdb_key in lmdb_keys:
                    if put:
                        txn.put(lmdb_key, b"")
                    else:
                        txn.delete(lmdb_key)

        try:
            self._full_map_waits(write, patience=self.patience)
        except lmdb.MapFullError as exc:
            raise TierFull(f"{self.name}: LMDB map full ({self.map_size} bytes) for direct readers' markers") from exc

    def contains(self, key: bytes) -> bool:
        return key in self._costs

    def _full_map_waits(self, write: Any, *, patience: float = 0.0, widen: bool = True) -> None:
        """Runs the write transaction `write`; while LMDB finds its map full, waits a little and runs it again,
        `_FULL_MAP_TRIES` times (30 ms in all) or for `patience` seconds, whichever is longer, then raises
        `lmdb.MapFullError`.

        Every transaction copies the pages it changes, deletes included, and
        LMDB reuses a freed page only once no read transaction still sees
        it: under load, readers (this server's, and co-located clients')
        hold what a write needs, and the map looks full when it is not. The
        first time a write that needs no run of pages (`widen`) finds it
        full, the budget drops a step (the module's "Headroom"). Caller
        holds the write lock.
        """
        pause = _FULL_MAP_PAUSE
        waited = 0.0
        for attempt in itertools.count():
            try:
                write()
            except lmdb.MapFullError:
                if attempt == 0 and widen:
                    self._widen_headroom()
                if attempt >= _FULL_MAP_TRIES - 1 and waited >= patience:
                    raise
                self._env.reader_check()  # slots of reader processes that died hold pages too
                time.sleep(pause)
                waited += pause
                pause = min(pause * 2, 0.1)
            else:
                if attempt == 0 and widen:
                    self._note_room()
                return

    def _widen_headroom(self) -> None:
        """The map was found full: the budget drops a step (not below its floor). Caller holds the write lock."""
        assert self.capacity_bytes is not None
        self.map_full += 1
        self._clean_writes = 0
        lowered = max(int(self.map_size * _MIN_BUDGET), self.capacity_bytes - int(self.map_size * _HEADROOM_STEP))
        if lowered < self.capacity_bytes:
            self.capacity_bytes = lowered
            log.warning(
                "%s: LMDB map (%d bytes) found full while readers held freed pages: budget lowered to %d bytes",
                self.name, self.map_size, lowered,
            )  # fmt: skip

    def _note_room(self) -> None:
        """A write found room at once; after enough in a row, a lowered budget rises a step."""
        assert self.capacity_bytes is not None
        if self.capacity_bytes >= self._full_budget:
            return
        self._clean_writes += 1
        if self._clean_writes >= _HEADROOM_RECOVERY:
            self._clean_writes = 0
            self.capacity_bytes = min(self._full_budget, self.capacity_bytes + int(self.map_size * _HEADROOM_STEP))

    def compact(self, max_pages: int = _COMPACT_PAGES) -> int:
        """Moves the records out of up to `max_pages` of the emptiest pack pages; returns how many pages it freed.

        Each record moves in a transaction of its own. The records fill holes
        in other pages (or fresh ones), so the emptied pages' LMDB pages can
        hold anything, a large value included.
        """
        with self._write_lock:
            return self._compact(max_pages)

    def _compact(self, max_pages: int) -> int:
        victims = set(self._space.sparse_pages(max_pages))
        if not victims:
            return 0
        before = self._space.pages
        movers = [key for key in self._locators if not victims.isdisjoint(self._space.pages_of(self._spans(key)))]
        for key in movers:
            old = self._spans(key)
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    found = gather(old, txn.get)
                    if found is None:
                        continue  # a page is missing: nothing to move (the value reads as corrupt)
                    record = bytes(found)
                    spans = self._space.plan(len(record), avoid=victims)
                    emptied = self._space.emptied(old, spans)
                    locator = pack_locator(spans)
                    self._write_pack(txn, spans, record)
                    txn.put(storage_key(key), locator)
                    for page in emptied:
                        txn.delete(pack_page_key(page))
            except lmdb.MapFullError:
                break
            self._space.apply(spans, old)
            self._locators[key] = locator
        return before - self._space.pages

    def scan(self) -> Iterator[ResidentKey]:
        with self._env.begin(buffers=True) as txn:
            return iter([found.resident for found in self._read_residents(txn)])

    def list_keys(self) -> list[bytes]:
        # From the tier's index, not the file (`scan` reads every record's header). `list` of a dict runs
        # under the GIL: a write meanwhile is either in the snapshot or not.
        return list(self._costs)

    def _open_existing(self) -> None:
        """Indexes what the directory holds: costs, and which pack bytes each packed record takes."""
        with self._env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            pages = []
            if cursor.set_range(PACK_PAGE_PREFIX):
                pages = [
                    int.from_bytes(page_key[1:], "big")
                    for page_key in cursor.iternext(values=False)
                    if bytes(page_key[:1]) == PACK_PAGE_PREFIX
                ]
            residents = self._read_residents(txn)
            for found in residents:
                self._costs[found.resident.key] = found.resident.cost
                self._used += found.resident.cost
                if found.file_id is not None:
                    self._file_ids[found.resident.key] = found.file_id
            markers = set()
            if cursor.set_range(UNVOUCHED_PREFIX):
                for marker in cursor.iternext(values=False):
                    if bytes(marker[:1]) != UNVOUCHED_PREFIX:
                        break
                    if bytes(marker) != IN_DOUBT_KEY:
                        markers.add(bytes(marker[1:]))
            if not self._claim_all(pages, residents, txn=None):
                # A damaged locator claims bytes that are not free, or points at no page.
                # Only records that verify keep their bytes, whatever order they come in,
                # so deleting a damaged entry never frees bytes an intact value holds.
                log.warning("%s: a damaged pack locator found; verifying every packed value", self.name)
                self._claim_all(pages, residents, txn=txn)
        self._drop_unindexed_files()
        orphans = self._space.drop_empty()
        if orphans:
            with self._env.begin(write=True) as txn:
                for page in orphans:
                    txn.delete(pack_page_key(page))
        if markers:
            # A marked value stays marked until the engine vouches for it; a marker of no value goes.
            by_stored_key = {storage_key(key): key for key in self._costs}
            self._marked = {by_stored_key[sk] for sk in markers if sk in by_stored_key}
            self._markers = markers & by_stored_key.keys()
            stray = markers - self._markers
            if stray:
                with self._env.begin(write=True) as txn:
                    for stored_key in stray:
                        txn.delete(UNVOUCHED_PREFIX + stored_key)

    def _drop_unindexed_files(self) -> None:
        """Deletes what a kill left: every file in `incoming/`, and files in `values/` no index entry names."""
        indexed = {file_value_name(file_id) for file_id in self._file_ids.values()}
        dropped = 0
        for directory, keep in ((self.incoming, set()), (self._files, indexed)):
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name not in keep:
                        _unlink(Path(entry.path))
                        dropped += 1
        if dropped:
            log.info("%s: deleted %d files of values never committed or already replaced", self.name, dropped)

    def _claim_all(self, pages: list[int], residents: list[_Found], txn: Any) -> bool:
        """Rebuilds the pack's state from the locators found; with `txn`, only records that verify count.

        Returns whether every locator's spans were free bytes of existing pages.
        """
        self._space = PackSpace(PACK_PAGE_BYTES)
        self._space.add_pages(pages)
        self._locators.clear()
        clean = True
        for found in residents:
            if found.locator is None:
                continue
            spans = unpack_locator(found.locator)
            if txn is not None:
                record = None if spans is None else gather(spans, txn.get)
                if record is None or open_record(found.resident.key, record, packed=True) is None:
                    continue
            if spans is not None and found.readable and self._space.claim(spans):
                self._locators[found.resident.key] = bytes(found.locator)
            else:
                clean = False
        return clean

    def _read_residents(self, txn: Any) -> list[_Found]:
        """Every stored value's key, cost, flags and expiry, with the locators of the packed ones."""
        found = []
        for stored_key, stored in txn.cursor():
            first = bytes(stored_key[:1])
            if first == PACK_PAGE_PREFIX:
                break  # pack pages sort after every value's key
            if first == UNVOUCHED_PREFIX:
                continue  # a marker (or the doubt key), not a value
            if is_file_ref(stored):
                ref = file_ref(None, stored)
                if ref is None:
                    key = bytes(stored_key[1:])
                    found.append(_Found(ResidentKey(key, self.cost(key, 0), False), None, readable=False))
                    continue
                key = bytes(stored[FILE_REF.size :]) if ref.header.key_len else bytes(stored_key[1:])
                resident = ResidentKey(
                    key,
                    self.cost(key, ref.size),
                    ref.header.dirty,
                    ref.header.expires_at,
                    version=ref.header.version,
                    size=ref.size,
                )
                found.append(_Found(resident, None, file_id=ref.file_id))
                continue
            locator = bytes(stored) if is_locator(stored) else None
            spans = None if locator is None else unpack_locator(locator)
            if spans is not None:
                # The header and the key it may hold, not the value.
                record = gather(spans, txn.get, limit=HEADER.size)
                if record is not None and len(record) >= _KEY_LEN_END:
                    # The key length sits at the same offset in every header version.
                    key_len = int.from_bytes(record[_KEY_LEN_END - 2 : _KEY_LEN_END], "little")
                    record = gather(spans, txn.get, limit=HEADER.size + key_len)
                header = None if record is None else unpack_header(record, packed=True)
                size = sum(n for _, n in spans) - (header.value_start if header is not None else 0)
            else:
                record = stored
                header = None if locator is not None else unpack_header(stored)
                size = len(stored) - (header.value_start if header is not None else 0)
            if header is None or record is None or len(record) < header.value_start:
                # Unreadable: the value will read as corrupt; charge what its
                # own bytes take so the budget stays honest until the engine drops it.
                key = bytes(stored_key[1:])
                cost = self.cost(key, 0 if locator is not None else len(stored))
                found.append(_Found(ResidentKey(key, cost, False), locator, readable=False))
                continue
            key = record_key(stored_key, record, header)
            resident = ResidentKey(
                key, self.cost(key, size), header.dirty, header.expires_at, version=header.version, size=size
            )
            found.append(_Found(resident, locator))
        return found

    def info(self) -> dict[str, str | int]:
        """The directory and map size (what a co-located reader needs to open the file), and the pack's state."""
        return {
            "kind": "lmdb",
            "path": str(self.path.resolve()),
            "map_size": self.map_size,
            "pack_below": self.pack_below,
            "file_from": self.file_from,
            "file_values": len(self._file_ids),
            "pack_pages": self._space.pages,
            "pack_free_bytes": self._space.free_bytes,
            "budget_bytes": self.capacity_bytes or 0,
            "full_budget_bytes": self._full_budget or 0,
            "map_full": self.map_full,
        }

    def disk_bytes(self) -> int:
        """Bytes on disk in use: the LMDB file's B-tree, overflow and pack pages (not its free list), and the
        large values' files."""
        stat = self._env.stat()
        files = 0
        with os.scandir(self._files) as entries:
            for entry in entries:
                files += entry.stat().st_blocks * 512
        return int(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * int(stat["psize"]) + files

    def sync(self) -> None:
        """Flushes committed records to disk."""
        self._env.sync(True)

    def sync_keys(self, keys: Sequence[bytes]) -> None:
        """Makes the values of `keys` as committed, and every record committed so far, survive the machine
        losing power: each key's file (a large value) is `fdatasync`ed, then `values/` (the renames that named
        them), then LMDB is synced (its commits are not, one by one). A key replaced or deleted meanwhile is
        skipped: what replaced it is synced by its own durable put, or is not durable."""
        with self._write_lock:
            file_ids = [self._file_ids[key] for key in keys if key in self._file_ids]
        for file_id in file_ids:
            try:
                fd = os.open(self._files / file_value_name(file_id), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        if file_ids:
            directory = os.open(self._files, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self._env.sync(True)

    def close(self) -> None:
        with self._write_lock:
            if self._serving_fd >= 0:
                os.close(self._serving_fd)  # direct readers stop here: the server is going
                self._serving_fd = -1
            self._env.sync(True)
            self._env.close()


def _write_file(path: Path, value: bytes) -> None:
    """Writes `value` into a new file at `path` (one copy, from the caller's buffer into the page cache)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(value)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done : done + (1 << 30)], done)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
