"""Tensor records: named tensors as raw bytes behind a small header, each with its own checksum.

The one stored form of tensors in the cache: a module's parameters and
buffers (`cacheclient.models`) and a KV-cache block's keys and values
(`cacheclient.kv`). No pickle: a reader learns names, dtypes and shapes from
the header and takes the bytes as they are. This module needs no torch, so
a server or a tool can check a record; dtypes are named as torch names them
("float32", "bfloat16", ...).

Layout (little-endian)::

    36 bytes  magic "CTR1", format version, flags (0), tensor count,
              data start (the header's length, a multiple of 64),
              xxh3-64 of the table, owner digest (16 bytes)
    table     per tensor: dtype code, kind, ndim, name length, offset,
              byte length, xxh3-64 of its bytes; then ndim u64 dims and
              the UTF-8 name
    padding   to a multiple of 64 bytes
    data      each tensor's bytes (C order) at its offset, 64-byte aligned

The owner digest binds a record to what it holds (`owner_digest`: a model's
save and a module's path, say; a KV block's chain hash), so a record stored
under another key, or left from an earlier save, is refused rather than
read. `unpack` checks every length, offset, checksum and the digest before
it hands out a byte.

`pack` copies tensors in; a writer that can fill the bytes in place (a KV
block, gathered from many tensors) takes `new_record` and then `seal`, and
copies once; one that hands a record on as pieces (a KV block straight out
of an engine's pages) takes `RecordLayout.head` for the bytes before the
data, and copies nothing here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from cacheclient.wire.record import checksum

__all__ = [
    "ALIGN",
    "BUFFER",
    "DTYPE_CODES",
    "DTYPE_SIZES",
    "KV",
    "PARAMETER",
    "TENSORS_VERSION",
    "RecordLayout",
    "TensorEntry",
    "TensorRecordError",
    "new_record",
    "owner_digest",
    "pack",
    "packed_size",
    "seal",
    "unpack",
    "unpack_as",
    "unpack_table_as",
]

TENSORS_VERSION = 1
_MAGIC = b"CTR1"
_HEAD = struct.Struct("<4sBBHIQ16s")
_ENTRY = struct.Struct("<BBBxHxxQQQ")
_SUM = struct.Struct("<Q")
"""A checksum: the last field of the header's first 20 bytes and of every table entry."""
_FIXED = 12
"""The header's bytes before the table's checksum: magic, version, flags, tensor count, data start."""
_SUM_OWNER = struct.Struct("<Q16s")
"""The header's last fields: the table's checksum, the owner digest."""
ALIGN = 64
"""Alignment of the data section and of every tensor's bytes in a record."""

PARAMETER = 0
"""`TensorEntry.kind` of a module parameter."""
BUFFER = 1
"""`TensorEntry.kind` of a module buffer."""
KV = 2
"""`TensorEntry.kind` of a KV-cache block's keys and values."""
_KINDS = (PARAMETER, BUFFER, KV)

# Codes are part of the stored formats (tensor records and KV blocks): append, never renumber.
DTYPE_CODES: Mapping[str, int] = MappingProxyType(
    {
        "float32": 1,
        "float16": 2,
        "bfloat16": 3,
        "float64": 4,
        "int8": 5,
        "uint8": 6,
        "float8_e4m3fn": 7,
        "float8_e5m2": 8,
        "int16": 9,
        "int32": 10,
        "int64": 11,
        "bool": 12,
        "complex64": 13,
        "complex128": 14,
    }
)
"""Stored dtype codes by torch dtype name."""
DTYPE_SIZES: Mapping[str, int] = MappingProxyType(
    {
        "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
        "float8_e5m2": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1, "complex64": 8, "complex128": 16,
    }
)  # fmt: skip
"""Bytes per element of each dtype in `DTYPE_CODES`."""
_DTYPE_OF_CODE = {code: name for name, code in DTYPE_CODES.items()}


class TensorRecordError(ValueError):
    """A value is not a well-formed tensor record of the expected owner; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a record: what it is, and (once packed) where its bytes lie and their checksum."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: int = PARAMETER
    offset: int = 0
    nbytes: int = 0
    checksum: int = 0

    @property
    def size(self) -> int:
        """Bytes of the tensor's data: elements times the dtype's size."""
        n = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


def owner_digest(*parts: str) -> bytes:
    """The 16-byte digest that binds a record to its owner, named by `parts`."""
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).digest()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(entries: Sequence[TensorEntry]) -> tuple[int, list[int], int]:
    """(data start, each tensor's offset, total bytes) of a record holding `entries`."""
    table = sum(_ENTRY.size + 8 * len(e.shape) + len(e.name.encode()) for e in entries)
    offset = start = _align(_HEAD.size + table)
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset = _align(offset + e.size)
    end = offsets[-1] + entries[-1].size if entries else start
    return start, offsets, end


def packed_size(entries: Sequence[TensorEntry]) -> int:
    """Bytes of the record that `pack` makes of `entries`."""
    return _layout(entries)[2]


def new_record(entries: Sequence[TensorEntry]) -> tuple[bytearray, list[int]]:
    """A record of `entries` to fill in place: its zeroed bytes, and where each tensor's bytes go in them.

    Write each tensor's `entry.size` bytes at its offset, then `seal` the record.

    Raises:
        ValueError: an unknown dtype, a name too long, or a shape out of range.
    """
    if len(entries) > 0xFFFF:
        raise ValueError(f"a record holds at most 65535 tensors, got {len(entries)}")
    for e in entries:
        if e.dtype not in DTYPE_CODES:
            raise ValueError(f"tensor {e.name!r}: dtype {e.dtype!r} is not storable")
        if len(e.name.encode()) > 0xFFFF or len(e.shape) > 0xFF or min(e.shape, default=0) < 0:
            raise ValueError(f"tensor {e.name!r}: name or shape out of range")
        if e.kind not in _KINDS:
            raise ValueError(f"tensor {e.name!r}: unknown kind {e.kind}")
    _, offsets, end = _layout(entries)
    return bytearray(end), offsets


def _table(entries: Sequence[TensorEntry], offsets: Sequence[int], sums: Sequence[int]) -> tuple[bytearray, list[int]]:
    """A record's table, and where each tensor's checksum lies in it."""
    table = bytearray()
    at = []
    for entry, offset, data_sum in zip(entries, offsets, sums, strict=True):
        name = entry.name.encode()
        table += _ENTRY.pack(
            DTYPE_CODES[entry.dtype], entry.kind, len(entry.shape), len(name), offset, entry.size, data_sum
        )
        at.append(len(table) - _SUM.size)
        table += struct.pack(f"<{len(entry.shape)}Q", *entry.shape) + name
    return table, at


def seal(record: bytearray, owner: bytes, entries: Sequence[TensorEntry]) -> bytearray:
    """Finishes a record from `new_record(entries)` whose tensors' bytes are in place: writes its table
    (with each tensor's checksum) and header. Returns `record`.

    Raises:
        ValueError: a bad owner digest, or `record` is not the size `entries` make.
    """
    if len(owner) != 16:
        raise ValueError(f"owner digest must be 16 bytes, got {len(owner)}")
    start, offsets, end = _layout(entries)
    if len(record) != end:
        raise ValueError(f"a record of these tensors is {end} bytes, not {len(record)}")
    view = memoryview(record)
    table, _ = _table(entries, offsets, [checksum(view[o : o + e.size]) for e, o in zip(entries, offsets, strict=True)])
    view[_HEAD.size : _HEAD.size + len(table)] = table
    view[: _HEAD.size] = _HEAD.pack(
        _MAGIC, TENSORS_VERSION, 0, len(entries), start, checksum(view[_HEAD.size : start]), owner
    )
    return record


def pack(owner: bytes, tensors: Sequence[tuple[TensorEntry, Any]]) -> bytearray:
    """One record of `tensors`: (entry, its data as any buffer of `entry.size` bytes), in order.

    Raises:
        ValueError: an unknown dtype, a data length that does not match the
            entry's dtype and shape, a name too long, or a bad owner digest.
    """
    if len(owner) != 16:
        raise ValueError(f"owner digest must be 16 bytes, got {len(owner)}")
    entries = [entry for entry, _ in tensors]
    record, offsets = new_record(entries)
    view = memoryview(record)
    for (entry, data), offset in zip(tensors, offsets, strict=True):
        source = memoryview(data).cast("B")
        if source.nbytes != entry.size:
            raise ValueError(f"tensor {entry.name!r}: {source.nbytes} bytes of data for {entry.size} bytes of tensor")
        view[offset : offset + entry.size] = source
    return seal(record, owner, entries)


def unpack(value: bytes | bytearray | memoryview, owner: bytes) -> list[tuple[TensorEntry, memoryview]]:
    """The tensors of a record (entry, a read-only view of its bytes), in stored order.

    Args:
        value: the record.
        owner: the digest it must carry (`owner_digest`).

    Raises:
        TensorRecordError: not a record of this format and version, another
            owner's, truncated or padded, or a checksum (of the table or of any
            tensor's bytes) that does not match.
    """
    view = memoryview(value).cast("B").toreadonly()
    if len(view) < _HEAD.size:
        raise TensorRecordError(f"{len(view)} bytes: shorter than a tensor record's header")
    magic, version, flags, count, start, table_sum, digest = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise TensorRecordError(f"not a tensor record (magic {bytes(magic)!r})")
    if version != TENSORS_VERSION or flags:
        raise TensorRecordError(f"tensor record version {version} flags {flags}; this reader knows version 1")
    if digest != owner:
        raise TensorRecordError("the record belongs to another owner (another save, or stored under another key)")
    if not _HEAD.size <= start <= len(view) or start % ALIGN or checksum(view[_HEAD.size : start]) != table_sum:
        raise TensorRecordError("the record's table is damaged (its checksum or length does not match)")
    tensors: list[tuple[TensorEntry, memoryview]] = []
    pos = _HEAD.size
    end = start
    try:
        for _ in range(count):
            code, kind, ndim, name_len, offset, nbytes, data_sum = _ENTRY.unpack_from(view, pos)
            pos += _ENTRY.size
            shape = struct.unpack_from(f"<{ndim}Q", view, pos)
            pos += 8 * ndim
            name = bytes(view[pos : pos + name_len]).decode()
            pos += name_len
            dtype = _DTYPE_OF_CODE.get(code)
            if dtype is None or kind not in _KINDS:
                raise TensorRecordError(f"tensor {name!r}: unknown dtype code {code} or kind {kind}")
            entry = TensorEntry(name, dtype, tuple(shape), kind, offset, nbytes, data_sum)
            if nbytes != entry.size or offset != _align(end) or offset + nbytes > len(view):
                raise TensorRecordError(f"tensor {name!r}: its bytes lie outside the record")
            data = view[offset : offset + nbytes]
            if checksum(data) != data_sum:
                raise TensorRecordError(f"tensor {name!r} failed its checksum")
            tensors.append((entry, data))
            end = offset + nbytes
    except (struct.error, UnicodeDecodeError) as exc:
        raise TensorRecordError(f"the record's table is malformed: {exc}") from None
    if pos > start or end != len(view):
        raise TensorRecordError(f"the record is {len(view)} bytes; its table accounts for {end}")
    return tensors


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """Every record of one list of tensors, but for its owner digest and checksums (`RecordLayout.of`).

    What `unpack_as` holds a record to: a reader that knows which tensors
    it expects (a KV block) checks a record with a few comparisons instead
    of parsing its table.
    """

    size: int
    """The record's bytes."""
    start: int
    """Where the data begins (the end of the table and its padding)."""
    fixed: bytes
    """The header's first `_FIXED` bytes: magic, version, flags, tensor count, data start."""
    table: bytes
    """The table and its padding (zeros, as `new_record` leaves it), each tensor's checksum zeroed."""
    sums: tuple[int, ...]
    """Where each tensor's checksum lies in `table`."""
    spans: tuple[tuple[int, int], ...]
    """Each tensor's (offset, bytes) in the record."""

    @classmethod
    def of(cls, entries: Sequence[TensorEntry]) -> RecordLayout:
        """The layout of records holding `entries` (names, dtypes, shapes and kinds), as `pack` writes them.

        Raises:
            ValueError: as `new_record`.
        """
        record, offsets = new_record(entries)
        start = _layout(entries)[0]
        table, sums = _table(entries, offsets, [0] * len(entries))
        padded = bytes(table) + bytes(start - _HEAD.size - len(table))
        fixed = _HEAD.pack(_MAGIC, TENSORS_VERSION, 0, len(entries), start, 0, bytes(16))[:_FIXED]
        spans = tuple((o, e.size) for e, o in zip(entries, offsets, strict=True))
        return cls(len(record), start, fixed, padded, tuple(sums), spans)

    def head(self, owner: bytes, sums: Sequence[int]) -> bytearray:
        """The bytes of a record of this layout before its data (`start` of them: header, table, padding),
        for tensors whose checksums are `sums` and owner digest is `owner`: what `seal` writes there.

        Raises:
            ValueError: a bad owner digest, or not a checksum per tensor.
        """
        if len(owner) != 16:
            raise ValueError(f"owner digest must be 16 bytes, got {len(owner)}")
        if len(sums) != len(self.sums):
            raise ValueError(f"a record of {len(self.sums)} tensors, {len(sums)} checksums")
        table = bytearray(self.table)
        for at, data_sum in zip(self.sums, sums, strict=True):
            _SUM.pack_into(table, at, data_sum)
        return bytearray(self.fixed + _SUM_OWNER.pack(checksum(memoryview(table)), owner)) + table


def unpack_table_as(
    value: bytes | bytearray | memoryview, owner: bytes, layout: RecordLayout
) -> list[tuple[memoryview, int]]:
    """Each tensor of a record of `layout`: (a read-only view of its bytes, their checksum), in stored
    order, its bytes not yet checked: for a reader that checks them as it copies them (`checksum_state`),
    and takes nothing it did not check. Else as `unpack_as`.

    Raises:
        TensorRecordError: not a record of `layout` (its size, header or
            table differs), another owner's, or a damaged table.
    """
    view = memoryview(value).cast("B").toreadonly()
    if len(view) != layout.size:
        raise TensorRecordError(f"{len(view)} bytes: not a record of these tensors ({layout.size} bytes)")
    if view[:_FIXED] != layout.fixed:
        raise TensorRecordError("not a tensor record of these tensors (its header differs)")
    table_sum, digest = _SUM_OWNER.unpack_from(view, _FIXED)
    if digest != owner:
        raise TensorRecordError("the record belongs to another owner (another save, or stored under another key)")
    table = view[_HEAD.size : layout.start]
    if checksum(table) != table_sum:
        raise TensorRecordError("the record's table is damaged (its checksum does not match)")
    got = bytearray(table)
    sums = []
    for at in layout.sums:
        sums.append(_SUM.unpack_from(got, at)[0])
        _SUM.pack_into(got, at, 0)
    if got != layout.table:
        raise TensorRecordError("the record holds other tensors (its table differs)")
    spans = layout.spans
    return [(view[offset : offset + nbytes], data_sum) for (offset, nbytes), data_sum in zip(spans, sums, strict=True)]


def unpack_as(value: bytes | bytearray | memoryview, owner: bytes, layout: RecordLayout) -> list[memoryview]:
    """The bytes of each tensor of a record of `layout` (read-only views), in stored order: `unpack` for a
    reader that knows the tensors it expects, and as strict, in fewer steps.

    Only records whose header and table (padding included) are what `pack`
    writes for the layout's tensors are taken; their checksums (the table's
    and every tensor's) are checked as `unpack` checks them.

    Raises:
        TensorRecordError: not a record of `layout` (its size, header or
            table differs), another owner's, or a checksum that does not match.
    """
    tensors = unpack_table_as(value, owner, layout)
    for data, data_sum in tensors:
        if checksum(data) != data_sum:
            raise TensorRecordError(f"the tensor of {len(data)} bytes failed its checksum")
    return [data for data, _ in tensors]
