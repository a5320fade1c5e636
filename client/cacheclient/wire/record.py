"""The L2 record format: how one value is laid out in a cache server's LMDB file.

The server writes records (`cachesvc.tiers.lmdb_tier`); a client on the same
machine reads them straight from the file (`cacheclient._lmdb_reader`). Both
use the functions here, so the format exists once.

LMDB key: `storage_key(key)`, which is b"k" + key for keys up to
`INLINE_KEY_MAX` bytes and b"h" + the key's xxh3-128 digest for longer ones.

LMDB value: header, then the original key when the LMDB key is a digest (so a
digest collision is caught on read), then the value bytes.

Header, version 4 (`HEADER`, 30 bytes, little-endian): magic b"CV", version,
flags (`FLAG_DIRTY`), the value's xxh3-64 checksum, the length of the key held
in the record (0: none), the wall-clock expiry (float64 Unix seconds, 0:
never), and the value's version (uint64: the hybrid-logical-clock stamp the
node that accepted the write gave it, `cachesvc.engine.versions`; 0:
unknown). Version 2 (22 bytes, written before versions existed) is the same
without the version, version 1 (14 bytes) without the expiry either; both
still read, as records of unknown version (and version 1 as one that never
expires), so an upgraded server keeps its L2. Writers always write version 4.

Small values are packed (`cachesvc.tiers.pack` decides where). Their
records are laid end to end in one byte space, the pack, held in pack pages:
LMDB key `pack_page_key(n)` (b"p" + n, 8 bytes big-endian, so pages sort after
every value's key), LMDB value `PACK_PAGE_BYTES` bytes, which is exactly one
4 KiB LMDB page (LMDB spends a 16-byte header on it). Under the value's LMDB
key is then a locator (`LOCATOR`: magic b"CP", version, then `SPAN`s of
(start, length) in the pack; a record may cross pages and lie in several
spans), and the record in the pack has header version `PACKED_VERSION` (5; 3 is
the packed record without the version, still read),
whose checksum field is the value's checksum XOR `key_tag(key)`: a damaged
locator that points at another key's record fails verification instead of
returning that record. `open_stored` reads either kind through one function.
A 4 KiB value stored as its own record takes two LMDB pages; packed, about
4.2 KiB (bench/smallvalues.py).

Large values live in files of their own beside the LMDB environment, in
its `FILE_VALUES_DIR` directory, one file per value named by a random 64-bit
id that is never reused (`file_value_name`). Under the value's LMDB key is
then a file reference (`FILE_REF`: magic b"CF", its version, flags, the
value's checksum XOR `key_tag(key)`, the key length held, expires_at, the
value's version, the value's size and the file's id; the original key
follows when it is long). A reader looks the reference up in a snapshot,
then reads the file (`read_file_value`) and verifies the bytes it copied: a
file deleted meanwhile is a miss, one rewritten by anyone fails its checksum.

Every value carries an xxh3-64 checksum from the moment it enters the cache
to the moment the client has it (`checksum`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "FILE_REF",
    "FILE_VALUES_DIR",
    "FLAG_DIRTY",
    "HEADER",
    "INLINE_KEY_MAX",
    "IN_DOUBT_KEY",
    "LOCATOR",
    "MAX_PACKED_RECORD",
    "PACKED_VERSION",
    "PACK_PAGE_BYTES",
    "PACK_PAGE_PREFIX",
    "RECORD_VERSION",
    "SERVING_LOCK",
    "SPAN",
    "UNVOUCHED_PREFIX",
    "FileRef",
    "RecordHeader",
    "checksum",
    "checksum_of_pieces",
    "checksum_state",
    "file_ref",
    "file_value_name",
    "gather",
    "is_file_ref",
    "is_locator",
    "key_tag",
    "open_record",
    "open_stored",
    "pack_file_ref",
    "pack_locator",
    "pack_page_key",
    "pack_record",
    "read_file_value",
    "record_key",
    "record_overhead",
    "storage_key",
    "unpack_header",
    "unpack_locator",
    "unvouched_key",
]

_MAGIC = b"CV"
RECORD_VERSION = 4
"""The header version writers write."""
HEADER = struct.Struct("<2sBBQHdQ")
"""Version 4: magic, version, flags, xxh3-64 of the value, key length held in the record, expires_at, the
value's version."""
_HEADER_V2 = struct.Struct("<2sBBQHd")
_HEADER_V1 = struct.Struct("<2sBBQH")
FLAG_DIRTY = 0x01
"""The value is not yet in object storage (write-back)."""
INLINE_KEY_MAX = 500
"""Longest key used as the LMDB key itself; longer keys are stored under their digest."""
PACKED_VERSION = 5
"""Header version of a record held in the pack (its checksum field is bound to the key)."""
_PACKED_V2 = 3
"""The packed header before versions (`_HEADER_V2`'s layout), still read."""
PACK_PAGE_BYTES = 4080
"""Bytes of pack per pack page: a 4 KiB LMDB page less the 16-byte header LMDB puts on it."""
PACK_PAGE_PREFIX = b"p"
"""First byte of every pack page's LMDB key (after b"h", b"k" and b"m": pages sort last)."""
UNVOUCHED_PREFIX = b"m"
"""First byte of the LMDB key marking a value the server would check before serving it (`unvouched_key`):
between the values' keys and the pack pages, which are appended past every other key."""
IN_DOUBT_KEY = b"m~in-doubt"
"""Present while the server doubts its lease (cut off from the metadata shard): no value is read directly.
Among the markers' keys, never one of them (a storage key starts with b"h" or b"k")."""
SERVING_LOCK = "serving.lock"
"""A file in the L2 directory the server holds an exclusive `flock` on while its file may be read directly
(from when every copy read back after a start is marked until it closes): a reader that can take a shared
lock on it knows the server is gone (killed, say), and that the copies in the file may have been superseded
on other nodes since, so it reads none of them (`cacheclient._lmdb_reader`)."""
_LOCATOR_MAGIC = b"CP"
_LOCATOR_VERSION = 1
_LOCATOR_HEAD = _LOCATOR_MAGIC + bytes([_LOCATOR_VERSION])
_PACK_PAGE_KEY = struct.Struct(">1sQ")
LOCATOR = struct.Struct("<2sB")
"""A locator's head: magic b"CP" and its version; `SPAN`s follow."""
SPAN = struct.Struct("<QI")
"""One span of a packed record: start in the pack, length."""
_ONE_SPAN = LOCATOR.size + SPAN.size
MAX_PACKED_RECORD = 1 << 24
"""A locator claiming more bytes than this is damaged (writers pack values far smaller)."""
_FILE_MAGIC = b"CF"
_FILE_VERSION = 1
FILE_REF = struct.Struct("<2sBBQHdQQQ")
"""A file reference: magic b"CF", version, flags, the value's xxh3-64 XOR `key_tag(key)`, key length held,
expires_at, the value's version, the value's size, the file's id; the long key follows."""
FILE_VALUES_DIR = "values"
"""The directory (in the L2 directory) of the files that hold large values."""

Getter = Callable[[bytes], "bytes | memoryview | None"]
"""Reads one LMDB key in a snapshot: `txn.get` of a py-lmdb transaction."""


def checksum(data: bytes | memoryview) -> int:
    """The xxh3-64 checksum of `data` as an unsigned int: the one checksum of the cache."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_state() -> xxhash.xxh3_64:
    """A running `checksum`: `update` it with pieces in order; its `intdigest()` is the `checksum` of their
    concatenation (for a reader that checks bytes as it copies them, a piece at a time)."""
    return xxhash.xxh3_64()


def checksum_of_pieces(pieces: Sequence[bytes | memoryview]) -> int:
    """The `checksum` of the pieces' concatenation, computed piece by piece (nothing is concatenated)."""
    if len(pieces) == 1:
        return xxhash.xxh3_64_intdigest(pieces[0])
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return state.intdigest()


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
    version: int = 0
    """The value's version (`cachesvc.engine.versions`); 0: unknown (a record written before versions)."""

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


def unvouched_key(key: bytes) -> bytes:
    """The LMDB key whose presence says the stored value of `key` is not to be read directly: the server
    would check it against its source first (after a restart, a move of its slot, a lost lease)."""
    return UNVOUCHED_PREFIX + storage_key(key)


def record_overhead(key: bytes) -> int:
    """Bytes a record of `key` holds besides the value (header, and the key when it is hashed)."""
    return HEADER.size + (len(key) if len(key) > INLINE_KEY_MAX else 0)


def key_tag(key: bytes) -> int:
    """What a packed record's checksum field is XORed with: binds the record to its key."""
    return xxhash.xxh3_64_intdigest(key)


def pack_record(
    key: bytes,
    value: bytes,
    value_checksum: int,
    *,
    dirty: bool = False,
    expires_at: float = 0.0,
    packed: bool = False,
    version: int = 0,
) -> bytes:
    """The record that stores `value` under `key`: its own LMDB value, or with `packed`, one for the pack."""
    long_key = len(key) > INLINE_KEY_MAX
    stored_checksum = value_checksum ^ key_tag(key) if packed else value_checksum
    header = HEADER.pack(
        _MAGIC,
        PACKED_VERSION if packed else RECORD_VERSION,
        FLAG_DIRTY if dirty else 0,
        stored_checksum,
        len(key) if long_key else 0,
        expires_at,
        version,
    )
    return b"".join((header, key if long_key else b"", value))


def unpack_header(record: bytes | memoryview, *, packed: bool = False) -> RecordHeader | None:
    """Decodes a record's header; None when the bytes are not a record of a version this code reads.

    With `packed`, only a record from the pack (`PACKED_VERSION`) reads;
    without, only one stored as its own LMDB value.
    """
    fields = _header_fields(record, packed)
    return None if fields is None else RecordHeader(*fields)


def _header_fields(record: bytes | memoryview, packed: bool) -> tuple[int, int, int, float, int, int] | None:
    """(flags, checksum field, key length, expires_at, header size, version), or None (see `unpack_header`)."""
    if len(record) < _HEADER_V1.size or record[:2] != _MAGIC:
        return None
    kind = record[2]
    version = 0
    if kind == (PACKED_VERSION if packed else RECORD_VERSION) and len(record) >= HEADER.size:
        _, _, flags, value_checksum, key_len, expires_at, version = HEADER.unpack_from(record)
        size = HEADER.size
    elif kind == (_PACKED_V2 if packed else 2) and len(record) >= _HEADER_V2.size:
        _, _, flags, value_checksum, key_len, expires_at = _HEADER_V2.unpack_from(record)
        size = _HEADER_V2.size
    elif kind == 1 and not packed:
        _, _, flags, value_checksum, key_len = _HEADER_V1.unpack_from(record)
        expires_at, size = 0.0, _HEADER_V1.size
    else:
        return None
    if size + key_len > len(record):
        return None
    return flags, value_checksum, key_len, expires_at, size, version


def record_key(stored_key: bytes | memoryview, record: bytes | memoryview, header: RecordHeader) -> bytes:
    """The original key of a record found under LMDB key `stored_key` (for listing what L2 holds)."""
    if header.key_len:
        return bytes(record[header.size : header.value_start])
    return bytes(stored_key[1:])


def open_record(
    key: bytes, record: bytes | memoryview, *, packed: bool = False
) -> tuple[RecordHeader, memoryview] | None:
    """The header and the verified value of a record stored for `key`; None when it is not a valid one.

    Invalid means: not a record of a version this code reads, a record that
    holds another key (a digest collision or corrupt key bytes), or a value
    that fails its checksum. With `packed`, `record` comes from the pack and
    its checksum is bound to `key`; the header handed back holds the value's
    own checksum either way. Expiry is not checked here: see
    `RecordHeader.expired`.
    """
    view = memoryview(record)
    fields = _header_fields(view, packed)
    if fields is None:
        return None
    flags, stored_checksum, key_len, expires_at, size, version = fields
    if key_len and view[size : size + key_len] != key:
        return None
    value = view[size + key_len :]
    value_checksum = checksum(value)
    if value_checksum != (stored_checksum ^ key_tag(key) if packed else stored_checksum):
        return None
    return RecordHeader(flags, value_checksum, key_len, expires_at, size, version), value


# -- the pack -----------------------------------------------------------------


def pack_page_key(page: int) -> bytes:
    """The LMDB key of pack page `page`."""
    return _PACK_PAGE_KEY.pack(PACK_PAGE_PREFIX, page)


def pack_locator(spans: Sequence[tuple[int, int]]) -> bytes:
    """The LMDB value that points at a packed record lying in `spans`."""
    return LOCATOR.pack(_LOCATOR_MAGIC, _LOCATOR_VERSION) + b"".join(SPAN.pack(s, n) for s, n in spans)


def is_locator(stored: bytes | memoryview) -> bool:
    """Whether an LMDB value is a locator (rather than a record of its own)."""
    return stored[:2] == _LOCATOR_MAGIC


def unpack_locator(stored: bytes | memoryview) -> list[tuple[int, int]] | None:
    """The spans of a locator; None when it is not one this code reads or claims impossible spans."""
    body = len(stored) - LOCATOR.size
    if body <= 0 or body % SPAN.size or stored[:3] != _LOCATOR_HEAD:
        return None
    spans = list(SPAN.iter_unpack(stored[LOCATOR.size :]))
    total = 0
    for _, length in spans:
        if length == 0:
            return None
        total += length
    return spans if total <= MAX_PACKED_RECORD else None


def gather(spans: Sequence[tuple[int, int]], get: Getter, limit: int | None = None) -> bytes | memoryview | None:
    """The bytes of the pack in `spans` (the first `limit` of them), read with `get`; None if a page is missing.

    A record within one page comes back as a view of that page, without a copy.
    """
    pieces: list[bytes | memoryview] = []
    left = MAX_PACKED_RECORD if limit is None else limit
    for start, length in spans:
        pos = start
        end = start + (length if length < left else left)
        left -= end - pos
        while pos < end:
            page, offset = divmod(pos, PACK_PAGE_BYTES)
            stop = offset + end - pos
            if stop > PACK_PAGE_BYTES:
                stop = PACK_PAGE_BYTES
            data = get(_PACK_PAGE_KEY.pack(PACK_PAGE_PREFIX, page))
            if data is None or len(data) < stop:
                return None
            pieces.append(memoryview(data)[offset:stop])
            pos += stop - offset
        if left == 0:
            break
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)


def open_stored(key: bytes, stored: bytes | memoryview, get: Getter) -> tuple[RecordHeader, memoryview] | None:
    """The header and verified value of what LMDB holds under `storage_key(key)`; None when it is not valid.

    `stored` is a record of its own or a locator; `get` reads the pack pages
    a locator points at, in the same snapshot.
    """
    if not is_locator(stored):
        return open_record(key, stored)
    if len(stored) == _ONE_SPAN and stored[:3] == _LOCATOR_HEAD:
        # Most records lie in one span (fresh pages, or a hole that fitted): no list to build.
        start, length = SPAN.unpack_from(stored, LOCATOR.size)
        page, offset = divmod(start, PACK_PAGE_BYTES)
        if length > 0 and offset + length <= PACK_PAGE_BYTES:
            data = get(_PACK_PAGE_KEY.pack(PACK_PAGE_PREFIX, page))
            if data is None or len(data) < offset + length:
                return None
            return open_record(key, memoryview(data)[offset : offset + length], packed=True)
    spans = unpack_locator(stored)
    if spans is None:
        return None
    record = gather(spans, get)
    return None if record is None else open_record(key, record, packed=True)


# -- values in files of their own ----------------------------------------------


def file_value_name(file_id: int) -> str:
    """The name of the file, in `FILE_VALUES_DIR`, that holds the value of reference `file_id`."""
    return f"{file_id:016x}"


def pack_file_ref(
    key: bytes,
    value_checksum: int,
    size: int,
    file_id: int,
    *,
    dirty: bool = False,
    expires_at: float = 0.0,
    version: int = 0,
) -> bytes:
    """The LMDB value that points at the file `file_id` holding the `size`-byte value of `key`."""
    long_key = len(key) > INLINE_KEY_MAX
    head = FILE_REF.pack(
        _FILE_MAGIC,
        _FILE_VERSION,
        FLAG_DIRTY if dirty else 0,
        value_checksum ^ key_tag(key),
        len(key) if long_key else 0,
        expires_at,
        version,
        size,
        file_id,
    )
    return head + key if long_key else head


def is_file_ref(stored: bytes | memoryview) -> bool:
    """Whether an LMDB value is a file reference (rather than a record or a locator)."""
    return stored[:2] == _FILE_MAGIC


@dataclass(frozen=True, slots=True)
class FileRef:
    """A decoded file reference: the value's header (its own checksum), size and file id."""

    header: RecordHeader
    size: int
    file_id: int


def file_ref(key: bytes | None, stored: bytes | memoryview) -> FileRef | None:
    """The reference `stored` holds; None when it is not one this code reads, or (with `key`) holds another
    key. The header's checksum is the value's own once `key` is given; without it, the stored field."""
    if len(stored) < FILE_REF.size or stored[:3] != _FILE_MAGIC + bytes([_FILE_VERSION]):
        return None
    _, _, flags, stored_checksum, key_len, expires_at, version, size, file_id = FILE_REF.unpack_from(stored)
    if len(stored) != FILE_REF.size + key_len:
        return None
    if key is not None and key_len and bytes(stored[FILE_REF.size :]) != key:
        return None
    value_checksum = stored_checksum ^ key_tag(key) if key is not None else stored_checksum
    return FileRef(RecordHeader(flags, value_checksum, key_len, expires_at, FILE_REF.size, version), size, file_id)


def read_file_value(
    directory: str | os.PathLike[str], ref: FileRef, into: memoryview | None = None
) -> bytes | memoryview | None:
    """The value `ref` points at, read from its file in `directory` into `into` (its first `ref.size` bytes;
    a new buffer when None) and verified where it landed; None when the file is gone, short, or the bytes
    fail their checksum (a copy a reader holds is then not the value).

    Raises:
        ValueError: `into` is shorter than the value.
    """
    if into is not None and len(into) < ref.size:
        raise ValueError(f"a buffer of {len(into)} bytes cannot take a value of {ref.size}")
    try:
        fd = os.open(os.path.join(directory, FILE_VALUES_DIR, file_value_name(ref.file_id)), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if into is None:
            out: bytes | memoryview = os.pread(fd, ref.size, 0)  # straight into the bytes handed back
            if len(out) != ref.size:
                return None
        else:
            out = into[: ref.size]
            done = 0
            while done < ref.size:
                got = os.preadv(fd, [out[done:]], done)
                if got <= 0:
                    return None
                done += got
    finally:
        os.close(fd)
    return out if checksum(out) == ref.header.checksum else None
