"""The L2 record format: how one value is laid out in a cache server's LMDB file.

The server writes records (`cachesvc.tiers.lmdb_tier`); a client on the same
machine reads them straight from the file (`cacheclient._lmdb_reader`). Both
use the functions here, so the format exists once.

LMDB key: `storage_key(key)`, which is b"k" + key for keys up to
`INLINE_KEY_MAX` bytes and b"h" + the key's xxh3-128 digest for longer ones.

LMDB value: header, then the original key when the LMDB key is a digest (so a
digest collision is caught on read), then the value bytes.

Header, version 2 (`HEADER`, 22 bytes, little-endian): magic b"CV", version,
flags (`FLAG_DIRTY`), the value's xxh3-64 checksum, the length of the key held
in the record (0: none), and the wall-clock expiry (float64 Unix seconds, 0:
never). Version 1 (14 bytes, written before expiry existed) is the same
without the expiry; it still reads, as a record that never expires, so an
upgraded server keeps its L2. Writers always write version 2.

Every value carries an xxh3-64 checksum from the moment it enters the cache
to the moment the client has it (`checksum`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "FLAG_DIRTY",
    "HEADER",
    "INLINE_KEY_MAX",
    "RECORD_VERSION",
    "RecordHeader",
    "checksum",
    "open_record",
    "pack_record",
    "record_key",
    "record_overhead",
    "storage_key",
    "unpack_header",
]

_MAGIC = b"CV"
RECORD_VERSION = 2
"""The header version writers write."""
HEADER = struct.Struct("<2sBBQHd")
"""Version 2: magic, version, flags, xxh3-64 of the value, key length held in the record, expires_at."""
_HEADER_V1 = struct.Struct("<2sBBQH")
FLAG_DIRTY = 0x01
"""The value is not yet in object storage (write-back)."""
INLINE_KEY_MAX = 500
"""Longest key used as the LMDB key itself; longer keys are stored under their digest."""


def checksum(data: bytes | memoryview) -> int:
    """The xxh3-64 checksum of `data` as an unsigned int: the one checksum of the cache."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The decoded header of a stored record."""

    flags: int
    checksum: int
    """xxh3-64 of the value."""
    key_len: int
    """Length of the original key held in the record; 0 when the LMDB key is the key."""
    expires_at: float
    """Wall-clock Unix seconds after which the value is expired; 0: never."""
    size: int
    """Bytes of the header itself (it depends on the version)."""

    @property
    def dirty(self) -> bool:
        """Whether the value is not yet in object storage."""
        return bool(self.flags & FLAG_DIRTY)

    @property
    def value_start(self) -> int:
        """Offset of the value bytes in the record."""
        return self.size + self.key_len

    def expired(self, now: float) -> bool:
        """Whether the value has expired at wall-clock time `now` (Unix seconds)."""
        return 0 < self.expires_at <= now


def storage_key(key: bytes) -> bytes:
    """The LMDB key under which the server stores `key`."""
    if len(key) <= INLINE_KEY_MAX:
        return b"k" + key
    return b"h" + xxhash.xxh3_128_digest(key)


def record_overhead(key: bytes) -> int:
    """Bytes a record of `key` holds besides the value (header, and the key when it is hashed)."""
    return HEADER.size + (len(key) if len(key) > INLINE_KEY_MAX else 0)


def pack_record(
    key: bytes, value: bytes, value_checksum: int, *, dirty: bool = False, expires_at: float = 0.0
) -> bytes:
    """The record that stores `value` under `key`, in the current format."""
    long_key = len(key) > INLINE_KEY_MAX
    header = HEADER.pack(
        _MAGIC, RECORD_VERSION, FLAG_DIRTY if dirty else 0, value_checksum, len(key) if long_key else 0, expires_at
    )
    return b"".join((header, key if long_key else b"", value))


def unpack_header(record: bytes | memoryview) -> RecordHeader | None:
    """Decodes a record's header; None when the bytes are not a record of a version this code reads."""
    if len(record) < _HEADER_V1.size or bytes(record[:2]) != _MAGIC:
        return None
    version = record[2]
    if version == RECORD_VERSION and len(record) >= HEADER.size:
        _, _, flags, value_checksum, key_len, expires_at = HEADER.unpack_from(record)
        size = HEADER.size
    elif version == 1:
        _, _, flags, value_checksum, key_len = _HEADER_V1.unpack_from(record)
        expires_at, size = 0.0, _HEADER_V1.size
    else:
        return None
    if size + key_len > len(record):
        return None
    return RecordHeader(flags, value_checksum, key_len, expires_at, size)


def record_key(stored_key: bytes | memoryview, record: bytes | memoryview, header: RecordHeader) -> bytes:
    """The original key of a record found under LMDB key `stored_key` (for listing what L2 holds)."""
    if header.key_len:
        return bytes(record[header.size : header.value_start])
    return bytes(stored_key[1:])


def open_record(key: bytes, record: bytes | memoryview) -> tuple[RecordHeader, memoryview] | None:
    """The header and the verified value of a record stored for `key`; None when it is not a valid one.

    Invalid means: not a record of a version this code reads, a record that
    holds another key (a digest collision or corrupt key bytes), or a value
    that fails its checksum. Expiry is not checked here: see
    `RecordHeader.expired`.
    """
    view = memoryview(record)
    header = unpack_header(view)
    if header is None:
        return None
    if header.key_len and view[header.size : header.value_start] != key:
        return None
    value = view[header.value_start :]
    if checksum(value) != header.checksum:
        return None
    return header, value
