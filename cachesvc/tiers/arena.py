"""L1 in a shared-memory arena that co-located clients read without the server (`l1.shared = true`).

The values live in one memfd (no name in any file system; the server hands a
read-only descriptor of it, and a writable one of the hit counters, to
co-located clients that present the data token: `cachesvc.server.arena_socket`),
laid out as `cacheclient.wire.arena` describes: a header, a hash table of
slots (each a seqlock) and the records. This tier is that layout's one writer;
every method is called under the engine lock, as for every L1.

What the engine decides, the arena shows: a value is published for direct
reads (its slot stamped with the current epoch) only when `publisher` says the
engine would serve it as it is, and until when (`SharedTier`); the engine
conceals keys (one, or all at once by moving the epoch) when it stops being
sure of them, and reveals them when it is again.

Space: records are allocated from the data region (`capacity * 9/8`, so
fragmentation rarely turns a budgeted put away; when it does the put raises
`TierFull` and the engine evicts one more) by a segregated free list with
coalescing, in 64-byte units. A record's bytes are freed only after its slot
stopped pointing there. Budget accounting: an entry costs its record rounded
to 64 bytes, and at least the arena's size over the slots it may use (3/4 of
them), so a full budget never overfills the table: with `capacity / 1024`
slots that is 1,366 bytes (smaller values are charged that much).

Hits of co-located readers are counted in the shared counters; `take_hits`
returns the keys read since the last call, for the engine's policy.

A server that stops marks the arena closed; one that is killed cannot, so it
holds an exclusive `flock` on the arena for as long as it lives, and a
client that is granted a shared one knows the server is gone
(`cacheclient.colocated.SharedL1`).
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import secrets
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from cacheclient.wire.arena import (
    EPOCH_OFFSET,
    HEADER,
    HEADER_BYTES,
    HIT_BYTES,
    MAGIC,
    SEGMENTS_OFFSET,
    SLOT,
    SLOT_BYTES,
    STATE_CLOSED,
    STATE_OFFSET,
    STATE_OPEN,
    VERSION,
)
from cachesvc.errors import TierFull
from cachesvc.tiers.base import Entry, ResidentKey

__all__ = ["ArenaTier", "Descriptors"]

log = logging.getLogger(__name__)

ALIGN = 64
SLOTS_PER_BYTE = 1024
"""One index slot per this many bytes of budget (the power of two at or above, at least `MIN_SLOTS`): the
index takes 1/16 of the budget, the hit counters 1/256 (a sweep reads them all)."""
MIN_SLOTS = 1024
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_PUNCH_BYTES = 64 << 10
"""A scrubbed segment gives free space back to the system once an extent has this many whole pages' bytes."""


@dataclass(frozen=True)
class Descriptors:
    """What a co-located client is handed: the arena read-only and the hit counters writable, with sizes."""

    arena: int
    arena_bytes: int
    hits: int
    hits_bytes: int
    boot: int
    prefixes: tuple[bytes, ...] = ()
    """The key prefixes a tenant's segment holds (`cachesvc.tiers.tenant_arenas`); () for the main one."""


class _Record:
    __slots__ = ("checksum", "dirty", "expires_at", "offset", "published", "size", "slot", "value_bytes", "version")

    def __init__(
        self, slot: int, offset: int, size: int, value_bytes: int, checksum: int, dirty: bool, version: int
    ) -> None:
        self.slot = slot
        self.offset = offset
        self.size = size  # the allocation
        self.value_bytes = value_bytes
        self.checksum = checksum
        self.dirty = dirty
        self.version = version
        self.expires_at = 0.0
        self.published = False


class _Space:
    """Free extents of the data region (offsets in bytes, sizes multiples of `ALIGN`): a segregated free
    list by size class (floor of log2), coalesced on free."""

    def __init__(self, start: int, size: int) -> None:
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._classes: list[set[int]] = [set() for _ in range(64)]
        self.free_bytes = 0
        self._add(start, size)

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        self._classes[size.bit_length() - 1].add(start)
        self.free_bytes += size

    def _remove(self, start: int) -> int:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        self._classes[size.bit_length() - 1].discard(start)
        self.free_bytes -= size
        return size

    def take(self, size: int) -> int | None:
        """The start of `size` free bytes, now taken; None when no extent is that large."""
        low = size.bit_length() - 1
        for start in self._classes[low]:  # the same class: may be smaller
            if self._by_start[start] >= size:
                return self._split(start, size)
        for cls in range(low + 1, 64):
            extents = self._classes[cls]
            if extents:
                return self._split(next(iter(extents)), size)
        return None

    def _split(self, start: int, size: int) -> int:
        have = self._remove(start)
        if have > size:
            self._add(start + size, have - size)
        return start

    def give(self, start: int, size: int) -> tuple[int, int]:
        """Frees `size` bytes at `start`, merged with free neighbours; returns the free extent it is now in."""
        before = self._by_end.get(start)
        if before is not None:
            size += self._remove(before)
            start = before
        after = self._by_start.get(start + size)
        if after is not None:
            size += self._remove(start + size)
        self._add(start, size)
        return start, size


class ArenaTier:
    """L1 in a shared-memory arena (see the module docstring); the `Tier` contract plus `SharedTier`.

    Args:
        capacity_bytes: the byte budget.
        name: the tier's name in stats and errors.
        scrub: zero a value's bytes once freed, and give the free space's whole pages back to the system (a
            tenant's segment: what left it, moved to another tenant's, is not left behind where its old
            holder's mapping shows it, and a segment's memory follows what it holds).
    """

    def __init__(self, capacity_bytes: int, name: str = "l1", *, scrub: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{name}: capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self._scrub = scrub
        # The power of two at or above one slot per SLOTS_PER_BYTE, at least MIN_SLOTS.
        slots = max(MIN_SLOTS, 1 << (max(1, capacity_bytes // SLOTS_PER_BYTE) - 1).bit_length())
        self._slots = slots
        self._mask = slots - 1
        self._max_entries = slots * 3 // 4
        self._min_charge = _align(math.ceil(capacity_bytes / self._max_entries))
        self._index = HEADER_BYTES
        data_offset = _align(HEADER_BYTES + slots * SLOT_BYTES, 4096)
        data_bytes = _align(capacity_bytes + capacity_bytes // 8 + ALIGN, 4096)
        self._size = data_offset + data_bytes
        self._fd = os.memfd_create(f"cachesvc-{name}", os.MFD_CLOEXEC)
        self._hits_fd = os.memfd_create(f"cachesvc-{name}-hits", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self._size)
            os.ftruncate(self._hits_fd, slots * HIT_BYTES)
            self._map = mmap.mmap(self._fd, self._size)
            self._hits_map = mmap.mmap(self._hits_fd, slots * HIT_BYTES)
            # Clients get a descriptor that can map the arena for reading only.
            self._read_only_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
            # Held while this process lives: a client whose shared lock is granted knows the server died
            # (killed: it could not mark the arena closed), and stops reading the arena.
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            os.close(self._hits_fd)
            raise
        self._buf = memoryview(self._map)
        self._hits = np.frombuffer(self._hits_map, dtype=np.uint32)
        self.boot = secrets.randbits(63) + 1
        self._epoch = 1
        HEADER.pack_into(
            self._buf,
            0,
            MAGIC,
            VERSION,
            STATE_OPEN,
            self.boot,
            self._epoch,
            slots,
            self._index,
            data_offset,
            data_bytes,
        )
        self._space = _Space(data_offset, data_bytes)
        self._entries: dict[bytes, _Record] = {}
        self._slot_keys: list[bytes | None] = [None] * slots
        self._used = 0
        self.publisher: Callable[[bytes], float | None] = lambda key: 0.0
        """Whether the engine would serve `key` as it is: None when not; else the Unix time until when (0: no
        limit). Asked when a value is put; set by the engine."""

    # -- the Tier contract ---------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def cost(self, key: bytes, size: int) -> int:
        return max(_align(len(key) + size), self._min_charge)

    def get(self, key: bytes) -> Entry | None:
        record = self._entries.get(key)
        if record is None:
            return None
        start = record.offset + len(key)
        return Entry(
            bytes(self._buf[start : start + record.value_bytes]), record.checksum, record.dirty, record.version
        )

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
        freed = self.cost(key, old.value_bytes) if old is not None else 0
        needed = self.cost(key, len(value))
        assert self.capacity_bytes is not None
        if self._used - freed + needed > self.capacity_bytes:
            raise TierFull(f"{self.name}: {needed} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
        if old is None and len(self._entries) >= self._max_entries:
            raise TierFull(f"{self.name}: the arena's index is full ({len(self._entries)} values)")
        size = _align(len(key) + len(value))
        offset = self._space.take(size)
        if offset is None:
            raise TierFull(f"{self.name}: no {size}-byte extent free in the arena (fragmented)")
        self._buf[offset : offset + len(key)] = key
        self._buf[offset + len(key) : offset + len(key) + len(value)] = value
        slot = old.slot if old is not None else self._free_slot(key)
        record = _Record(slot, offset, size, len(value), checksum, dirty, version)
        record.expires_at = expires_at
        self._entries[key] = record
        self._slot_keys[slot] = key
        self._publish(key, record)
        if old is not None:
            self._free(old.offset, old.size)
        self._used += needed - freed

    def delete(self, key: bytes) -> bool:
        record = self._entries.pop(key, None)
        if record is None:
            return False
        self._remove_slot(record.slot)
        self._free(record.offset, record.size)
        self._used -= self.cost(key, record.value_bytes)
        return True

    def size_of(self, key: bytes) -> int | None:
        """The size of `key`'s value; None when not here."""
        record = self._entries.get(key)
        return record.value_bytes if record is not None else None

    def expires_at(self, key: bytes) -> float:
        """`key`'s expiry as put (0: none, or not here)."""
        record = self._entries.get(key)
        return record.expires_at if record is not None else 0.0

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def list_keys(self) -> list[bytes]:
        return list(self._entries)

    def scan(self) -> Iterator[ResidentKey]:
        for key, record in list(self._entries.items()):
            size = record.value_bytes
            yield ResidentKey(key, self.cost(key, size), record.dirty, record.expires_at, record.version, size)

    def info(self) -> dict[str, str | int]:
        return {"kind": "shared-memory", "capacity_bytes": self.capacity_bytes or 0, "arena_bytes": self._size}

    def close(self, *, wipe: bool = False) -> None:
        """Marks the arena closed (mapped readers stop reading it) and lets it go; with `wipe`, every byte after
        the header is given back first (a mapping a client keeps reads zeros: a tenant's old segment)."""
        if self._fd < 0:
            return
        _U32.pack_into(self._buf, STATE_OFFSET, STATE_CLOSED)
        if wipe:
            self._map.madvise(mmap.MADV_REMOVE, HEADER_BYTES, self._size - HEADER_BYTES)
        self._entries.clear()
        del self._hits
        self._buf.release()
        for closing in (self._map.close, self._hits_map.close):
            try:
                closing()
            except BufferError:  # a view still out (a value being sent): the mapping goes with the process
                log.debug("%s: the arena mapping is still in use at close", self.name)
        for fd in (self._fd, self._hits_fd, self._read_only_fd):
            os.close(fd)
        self._fd = -1
        self._used = 0

    # -- SharedTier: what co-located readers may take --------------------------

    def descriptors(self, prefixes: tuple[bytes, ...] = ()) -> Descriptors:
        """The descriptors a co-located client maps (the caller sends them; they stay open here)."""
        return Descriptors(self._read_only_fd, self._size, self._hits_fd, self._slots * HIT_BYTES, self.boot, prefixes)

    def mark_closed(self) -> None:
        """Marks the arena closed for mapped readers; it goes on holding values for the engine."""
        _U32.pack_into(self._buf, STATE_OFFSET, STATE_CLOSED)

    def new_segments(self) -> None:
        """Moves the segment generation (`cacheclient.wire.arena.SEGMENTS_OFFSET`): clients map again."""
        _U64.pack_into(self._buf, SEGMENTS_OFFSET, _U64.unpack_from(self._buf, SEGMENTS_OFFSET)[0] + 1)

    def conceal(self, keys: Sequence[bytes]) -> None:
        """Takes `keys` out of direct reads (they read through the engine) until revealed."""
        for key in keys:
            record = self._entries.get(key)
            if record is not None and record.published:
                record.published = False
                self._write_slot(record.slot, key, record, 0.0, 0)

    def conceal_all(self) -> None:
        """Takes every key out of direct reads at once (the header's epoch moves)."""
        self._epoch += 1
        _U64.pack_into(self._buf, EPOCH_OFFSET, self._epoch)
        for record in self._entries.values():
            record.published = False

    def reveal(self, key: bytes) -> None:
        """Publishes `key` for direct reads again when `publisher` allows it (a hit the engine served)."""
        record = self._entries.get(key)
        if record is not None and not record.published:
            self._publish(key, record)

    def published(self, key: bytes) -> bool:
        record = self._entries.get(key)
        return record is not None and record.published

    def take_hits(self) -> list[bytes]:
        """The keys co-located clients read since the last call (their counters are reset)."""
        counts = self._hits
        hit = np.flatnonzero(counts != 0)  # on a snapshot: clients bump the counters while this runs
        if not len(hit):
            return []
        counts[hit] = 0
        keys = self._slot_keys
        return [key for slot in hit.tolist() if (key := keys[slot]) is not None]

    def _free(self, offset: int, size: int) -> None:
        """Frees a record's bytes (its slot no longer points there); scrubbed in a tenant's segment."""
        start, extent = self._space.give(offset, size)
        if not self._scrub:
            return
        self._buf[offset : offset + size] = bytes(size)
        first, last = _align(start, mmap.PAGESIZE), (start + extent) // mmap.PAGESIZE * mmap.PAGESIZE
        if last - first >= _PUNCH_BYTES:
            self._map.madvise(mmap.MADV_REMOVE, first, last - first)

    # -- the index --------------------------------------------------------------

    def _publish(self, key: bytes, record: _Record) -> None:
        until = self.publisher(key)
        record.published = until is not None
        self._write_slot(record.slot, key, record, until or 0.0, self._epoch if until is not None else 0)

    def _write_slot(self, slot: int, key: bytes, record: _Record, until: float, epoch: int) -> None:
        at = self._index + slot * SLOT_BYTES
        buf = self._buf
        seq = _U64.unpack_from(buf, at)[0] + 1
        _U64.pack_into(buf, at, seq)  # odd: being written
        SLOT.pack_into(
            buf,
            at,
            seq,
            xxhash.xxh3_64_intdigest(key),
            len(key),
            0,
            record.offset,
            record.value_bytes,
            record.checksum,
            until,
            epoch,
        )
        _U64.pack_into(buf, at, seq + 1)

    def _free_slot(self, key: bytes) -> int:
        slot = xxhash.xxh3_64_intdigest(key) & self._mask
        keys = self._slot_keys
        while keys[slot] is not None:
            slot = (slot + 1) & self._mask
        return slot

    def _remove_slot(self, slot: int) -> None:
        """Empties `slot` and shifts the entries after it back (linear probing without tombstones): a reader
        probing meanwhile may miss a key, and asks the server."""
        keys, mask = self._slot_keys, self._mask
        hole = slot
        probe = slot
        while True:
            probe = (probe + 1) & mask
            key = keys[probe]
            if key is None:
                break
            home = xxhash.xxh3_64_intdigest(key) & mask
            # Stays when its home lies cyclically in (hole, probe].
            if (hole < probe and hole < home <= probe) or (hole > probe and (home > hole or home <= probe)):
                continue
            record = self._entries[key]
            at = self._index + probe * SLOT_BYTES
            fields = SLOT.unpack_from(self._buf, at)
            record.slot = hole
            keys[hole] = key
            self._copy_slot(hole, fields)
            hole = probe
        keys[hole] = None
        self._clear_slot(hole)

    def _copy_slot(self, slot: int, fields: tuple[object, ...]) -> None:
        at = self._index + slot * SLOT_BYTES
        seq = _U64.unpack_from(self._buf, at)[0] + 1
        _U64.pack_into(self._buf, at, seq)
        SLOT.pack_into(self._buf, at, seq, *fields[1:])
        _U64.pack_into(self._buf, at, seq + 1)
        self._hits[slot] = 0

    def _clear_slot(self, slot: int) -> None:
        at = self._index + slot * SLOT_BYTES
        seq = _U64.unpack_from(self._buf, at)[0] + 1
        _U64.pack_into(self._buf, at, seq)
        SLOT.pack_into(self._buf, at, seq, 0, 0, 0, 0, 0, 0, 0.0, 0)
        _U64.pack_into(self._buf, at, seq + 1)
        self._hits[slot] = 0


def _align(size: int, unit: int = ALIGN) -> int:
    return (size + unit - 1) // unit * unit
