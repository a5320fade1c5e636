"""The shared-memory arena of a cache server's L1: its layout, and reading a value from it without the server.

A server whose L1 is shared (`cachesvc.tiers.arena.ArenaTier`) keeps its
values in one shared-memory file (a memfd: no name, mode 0600, handed to
co-located clients over a Unix socket after their token is checked) laid out
as follows; every integer is little-endian:

* a header of `HEADER_BYTES`: the magic, the layout version, the state (open;
  closed once the server stops), the server's boot token (random per start),
  the epoch, the index's slot count and where the index and the data start;
  then, at `SEGMENTS_OFFSET`, the segment generation (below);
* the index: a hash table of `SLOT_BYTES` slots, open addressing with linear
  probing from `xxh3_64(key) & (slots - 1)`; a slot with a key length of 0 is
  empty and ends a probe;
* the data: each value's record is its key's bytes then its value's bytes,
  at the offset its slot names.

One writer (the server, under its engine lock) and any number of readers, with
no lock between them. A slot is a seqlock: its sequence number is odd while the
server rewrites it and grows by 2 with every change. A reader reads the
sequence, then the slot and the record's bytes, then the sequence again, and
keeps what it read only when the two are equal and even. The server never
frees or reuses a record's bytes before it has changed the slot that points
there, so an unchanged sequence means untouched bytes; and a reader verifies
the value's checksum as every read does. A reader that loses a race (the
sequence moved, a probe too long, a slot being written) does not retry for
long: it answers "ask the server" (`ASK`), which reads through its engine.

What a reader may take: a slot is published for direct reads only while its
epoch equals the header's. The server publishes a value (stamps the slot with
the current epoch) when it knows it may serve it as it is; it conceals one key
by clearing its slot's epoch, and every key at once by moving the header's
epoch (after a restart of the placement, a shard rebuilt, a suspicion of every
cached copy). A slot also carries the wall-clock time after which its value may
not be served without the server (its TTL, or when it is next to be checked
against object storage); past it, a reader asks the server.

Clients map the arena read-only (the descriptor they get is opened read-only).
They count their hits in a second, writable shared array, one 32-bit counter
per slot (a plain add that may lose counts in a race); the server's eviction
policy learns of them from a sweep, so a key read only by co-located clients
is not taken for a cold one.

Segments: a cluster node whose tenants read co-located keeps one arena per
tenant (`cachesvc.tiers.tenant_arenas`), each of this layout, beside the
main one (keys under no tenant). A tenant's token is handed its own
segment only; the data and admin tokens every segment, each with the key
prefixes it holds. The main segment's header counts the changes of that set
(`SEGMENTS_OFFSET`): a client that sees it move maps again, to learn them.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Final

import xxhash

__all__ = [
    "ASK",
    "HEADER",
    "HEADER_BYTES",
    "HIT_BYTES",
    "MAGIC",
    "MAX_TENANT_SEGMENTS",
    "SEGMENTS_OFFSET",
    "SLOT",
    "SLOT_BYTES",
    "STATE_CLOSED",
    "STATE_OPEN",
    "VERSION",
    "ArenaView",
    "Header",
]

MAGIC: Final = b"CSVCARN1"
VERSION: Final = 1
STATE_OPEN: Final = 1
STATE_CLOSED: Final = 2
HEADER_BYTES: Final = 4096
HEADER = struct.Struct("<8sIIQQQQQQ")
"""magic, version, state, boot, epoch, slots, index offset, data offset, data bytes."""
EPOCH_OFFSET: Final = 24
"""Where the header's epoch is (the one field the server changes after start)."""
STATE_OFFSET: Final = 12
SEGMENTS_OFFSET: Final = 64
"""Where the main segment's segment generation is (a u64 after `HEADER`'s fields): it moves whenever the server's
set of tenant segments (or their prefixes) changes."""
MAX_TENANT_SEGMENTS: Final = 100
"""Tenants with an arena of their own on one server (two descriptors each in one handshake; Linux passes at most
253 in a message). Tenants past it get none: their keys stay in the main segment, read over gRPC."""
SLOT_BYTES: Final = 64
SLOT = struct.Struct("<QQIIQQQdQ")
"""seq, key hash, key length, (unused), record offset, value length, checksum, serve-until (Unix seconds; 0:
no limit), epoch (0: concealed)."""
HIT_BYTES: Final = 4
"""One counter per slot in the hits array."""
MAX_PROBE: Final = 64
"""Slots a reader looks at before it asks the server (the server keeps the table at most 3/4 full)."""

ASK: Final = object()
"""A read that must go to the server: the key is not published (a miss here may be a hit there) or a race."""

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class Header:
    """The fixed fields of an arena's header, as read once when it is mapped."""

    __slots__ = ("boot", "data_bytes", "data_offset", "index_offset", "slots")

    def __init__(self, buffer: memoryview) -> None:
        magic, version, _state, boot, _epoch, slots, index_offset, data_offset, data_bytes = HEADER.unpack_from(
            buffer, 0
        )
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a cachesvc L1 arena of layout {VERSION} (magic {magic!r}, layout {version})")
        if slots & (slots - 1) or index_offset + slots * SLOT_BYTES > data_offset:
            raise ValueError("a corrupt arena header")
        if data_offset + data_bytes > len(buffer):
            raise ValueError(f"the arena is {len(buffer)} bytes, its header says {data_offset + data_bytes}")
        self.boot = boot
        self.slots = slots
        self.index_offset = index_offset
        self.data_offset = data_offset
        self.data_bytes = data_bytes


class ArenaView:
    """Reads values from a mapped arena (see the module docstring); never blocks the server.

    Args:
        buffer: the arena's bytes (a read-only mapping in a client; the
            server's own mapping in tests).
        hits: the hit counters (a writable mapping; None: reads are not counted).
        clock: Unix seconds (a slot's serve-until is wall-clock time).
    """

    def __init__(
        self, buffer: memoryview, hits: memoryview | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.buffer = buffer
        self.hits = hits
        self.header = Header(buffer)
        self._mask = self.header.slots - 1
        self._index = self.header.index_offset
        self._clock = clock

    @property
    def open(self) -> bool:
        """False once the server that made it stopped (every read must then go elsewhere)."""
        return _U32.unpack_from(self.buffer, STATE_OFFSET)[0] == STATE_OPEN

    @property
    def segments(self) -> int:
        """The segment generation (`SEGMENTS_OFFSET`; read from the main segment)."""
        return int(_U64.unpack_from(self.buffer, SEGMENTS_OFFSET)[0])

    def get(self, key: bytes, verify: bool = True) -> bytes | object:
        """`key`'s value, or `ASK`: not published here, or a race lost.

        Args:
            verify: check the value against its checksum. Only for a caller
                that checks every byte it uses itself (KV blocks: each tensor's).
        """
        found = self._find(key)
        if found is None:
            return ASK
        value = self._copy(found, verify)
        if value is not ASK:
            self._count(found[2])
        return value

    def get_answered(self, key: bytes, checksum: int) -> bytes | object:
        """`key`'s value when the arena holds the one whose checksum is `checksum`, else `ASK`: for a read
        the server has just answered (and counted) with that checksum, not counted again. A later value
        published meanwhile is not it (another checksum): the caller takes the answer's own bytes then."""
        found = self._find(key)
        if found is None or found[5] != checksum:
            return ASK
        return self._copy(found, True)

    def _copy(self, found: tuple[int, int, int, int, int, int], verify: bool) -> bytes | object:
        """The value `_find` found, copied out; `ASK` when it changed while it was copied (its sequence
        moved) or, with `verify`, when the copy fails its checksum."""
        at, seq, _, start, value_bytes, checksum = found
        buffer = self.buffer
        value = bytes(buffer[start : start + value_bytes])
        if _U64.unpack_from(buffer, at)[0] != seq:
            return ASK  # changed while it was copied
        if verify and xxhash.xxh3_64_intdigest(value) != checksum:
            return ASK
        return value

    def lend(self, key: bytes) -> tuple[memoryview, Callable[[], bool]] | object:
        """A view of `key`'s value where it lies in the arena, and a check that it was not changed since, or
        `ASK`. The caller copies what it needs out of the view, then calls the check: only when it answers
        True are the copied bytes the value (the server had not reused them). Nothing is verified: the
        caller checks what it copied, as KV blocks check each tensor."""
        found = self._find(key)
        if found is None:
            return ASK
        at, seq, slot, start, value_bytes, _ = found
        buffer = self.buffer
        self._count(slot)
        return buffer[start : start + value_bytes], lambda: _U64.unpack_from(buffer, at)[0] == seq

    def _find(self, key: bytes) -> tuple[int, int, int, int, int, int] | None:
        """(slot offset, its sequence, slot, value offset, value bytes, checksum) of a published `key`; None:
        ask the server."""
        buffer = self.buffer
        if _U32.unpack_from(buffer, STATE_OFFSET)[0] != STATE_OPEN:
            return None
        epoch = _U64.unpack_from(buffer, EPOCH_OFFSET)[0]
        wanted = xxhash.xxh3_64_intdigest(key)
        size = len(key)
        slot = wanted & self._mask
        unpack = SLOT.unpack_from
        for _ in range(MAX_PROBE):
            at = self._index + slot * SLOT_BYTES
            seq, hashed, length, _, offset, value_bytes, checksum, until, stamped = unpack(buffer, at)
            if seq & 1:
                return None  # being written
            if length == 0:
                return None  # the end of the probe: not here (the server may have it below L1)
            if hashed == wanted and length == size:
                if stamped != epoch or stamped == 0 or (until and until <= self._clock()):
                    return None
                start = offset + size
                if buffer[offset:start] != key:
                    return None
                return at, seq, slot, start, value_bytes, checksum
            slot = (slot + 1) & self._mask
        return None

    def _count(self, slot: int) -> None:
        hits = self.hits
        if hits is not None:
            where = slot * HIT_BYTES
            _U32.pack_into(hits, where, (_U32.unpack_from(hits, where)[0] + 1) & 0xFFFFFFFF)
