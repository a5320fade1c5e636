"""Checksums and the record framing used wherever bytes cross a tier boundary.

Every value carries an xxh3-64 checksum from the moment it enters the cache
(the client computes it, or the server on receipt) to the moment it leaves
(the client verifies it). Tiers that store bytes outside process memory (LMDB,
S3) store the checksum beside the value and verify it on every read.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["FLAG_DIRTY", "HEADER", "RecordHeader", "checksum", "pack_header", "unpack_header"]


def checksum(data: bytes | memoryview) -> int:
    """The xxh3-64 checksum of `data` as an unsigned int."""
    return xxhash.xxh3_64_intdigest(data)


# magic, version, flags, checksum, original-key length (0 when the storage key
# is the key itself).
HEADER = struct.Struct("<2sBBQH")
_MAGIC = b"CV"
_VERSION = 1
FLAG_DIRTY = 0x01
"""The value is not yet in object storage (write-back)."""


class RecordHeader:
    """The decoded header of a stored record."""

    __slots__ = ("checksum", "flags", "key_len")

    def __init__(self, flags: int, checksum: int, key_len: int) -> None:
        self.flags = flags
        self.checksum = checksum
        self.key_len = key_len


def pack_header(value_checksum: int, flags: int = 0, key_len: int = 0) -> bytes:
    """The header bytes that precede a stored value."""
    return HEADER.pack(_MAGIC, _VERSION, flags, value_checksum, key_len)


def unpack_header(record: bytes | memoryview) -> RecordHeader | None:
    """Decodes a record's header; None when the bytes are not a record we wrote."""
    if len(record) < HEADER.size:
        return None
    magic, version, flags, value_checksum, key_len = HEADER.unpack_from(record)
    if magic != _MAGIC or version != _VERSION or HEADER.size + key_len > len(record):
        return None
    return RecordHeader(flags, value_checksum, key_len)
