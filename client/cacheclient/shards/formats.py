"""Shard formats, parsed from a stream of a shard's bytes and checked: WebDataset tar and MosaicML MDS.

Each parser reads the shard front to back (`ShardStream`, which pulls the
shard's parts as it needs them) and yields its samples as the format's own
reader does, so a shard of any size is read with one part in memory:

- WebDataset (`tar_samples`): a sample is the regular files of the tar that
  share a key (the name up to the first dot of its last path component), as
  a dict of their bytes by extension (lower-cased), with `__key__` and
  `__url__`: what `webdataset.WebDataset` yields with no decoder.
- MDS (`mds_records`, then `MDSColumns.decode`): a sample is the dict of its
  columns, decoded as `streaming.StreamingDataset` decodes them.

Nothing is guessed: a header whose checksum fails, a file that runs past the
end of the shard, a missing end-of-archive marker, an MDS offset table that
disagrees with the shard or its index, a sample whose columns do not add up:
each is a `CorruptShardError` naming the shard and the byte offset, never a
wrong or missing sample.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = [
    "MDS_SAFE",
    "CorruptShardError",
    "MDSColumns",
    "ShardError",
    "ShardStream",
    "mds_records",
    "tar_samples",
    "wds_key",
]


class ShardError(RuntimeError):
    """A shard cannot be read or used; the message names the shard."""


class CorruptShardError(ShardError):
    """A shard's bytes are not the format they should be: `shard` names it, `offset` is where it goes wrong."""

    def __init__(self, shard: str, offset: int, problem: str) -> None:
        super().__init__(f"shard {shard}: corrupt at byte {offset}: {problem}")
        self.shard = shard
        self.offset = offset


class ShardStream:
    """A shard's bytes front to back, pulled one part at a time.

    Args:
        name: the shard, for errors.
        size: the shard's length in bytes.
        parts: (start, end) of each part, inclusive, covering [0, size) in order.
        read_part: the bytes of the part at an index of `parts`; it may reuse one buffer for every
            part (what this stream hands out is copied, or used, before it reads the next part).
    """

    def __init__(
        self,
        name: str,
        size: int,
        parts: Sequence[tuple[int, int]],
        read_part: Callable[[int], bytes | memoryview],
    ) -> None:
        self.name = name
        self.size = size
        self._parts = parts
        self._read_part = read_part
        self._next = 0
        self._buffer = memoryview(b"")
        self._at = 0  # in _buffer
        self.position = 0
        """Bytes of the shard read so far."""

    def _fill(self) -> bool:
        if self._next >= len(self._parts):
            return False
        start, end = self._parts[self._next]
        data = self._read_part(self._next)
        if len(data) != end - start + 1:
            raise CorruptShardError(
                self.name, start, f"part bytes={start}-{end} read {len(data)} bytes, want {end - start + 1}"
            )
        self._next += 1
        self._buffer = memoryview(data)
        self._at = 0
        return True

    def read(self, n: int, what: str) -> bytes:
        """The next `n` bytes; CorruptShardError naming `what` when the shard ends first."""
        if self._at + n <= len(self._buffer):  # the common case: within the part in hand
            out = self._buffer[self._at : self._at + n].tobytes()
            self._at += n
            self.position += n
            return out
        pieces = []
        want = n
        while want:
            if self._at >= len(self._buffer) and not self._fill():
                raise CorruptShardError(
                    self.name, self.position, f"{what} needs {want} more bytes, the shard ends at byte {self.size}"
                )
            take = min(want, len(self._buffer) - self._at)
            # A copy: the next part may be read into the same buffer.
            pieces.append(self._buffer[self._at : self._at + take].tobytes())
            self._at += take
            self.position += take
            want -= take
        return b"".join(pieces)

    def view(self, n: int, what: str) -> bytes | memoryview:
        """The next `n` bytes, as a view of the part in hand when they lie in it (else as `read`).

        Valid until the stream reads on (its part's buffer may be reused): use it at once, and keep a
        copy, never the view.
        """
        if self._at + n <= len(self._buffer):
            out = self._buffer[self._at : self._at + n]
            self._at += n
            self.position += n
            return out
        return self.read(n, what)

    def skip(self, n: int, what: str) -> None:
        """Passes over the next `n` bytes (parts wholly skipped are still read: they hold what follows)."""
        while n:
            if self._at >= len(self._buffer) and not self._fill():
                raise CorruptShardError(self.name, self.position, f"{what}: the shard ends at byte {self.size}")
            take = min(n, len(self._buffer) - self._at)
            self._at += take
            self.position += take
            n -= take

    def rest(self) -> Iterator[memoryview]:
        """What is left of the shard, in pieces (each valid until the next is asked for)."""
        while True:
            if self._at < len(self._buffer):
                piece = self._buffer[self._at :]
                self.position += len(piece)
                self._at = len(self._buffer)
                yield piece
            if not self._fill():
                return


# -- WebDataset tar ----------------------------------------------------------

_BLOCK = 512
_SIGNED_HEADER = struct.Struct("148b8x356b")
_REGULAR = (b"0", b"\x00", b"7")
_WDS_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WDS_META = re.compile(r"__[^/]*__($|/)")


def wds_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a file of a WebDataset tar, as `webdataset` splits it; None for a name it skips."""
    found = _WDS_KEY.match(name)
    return None if found is None else (found.group(1), found.group(2))


def _number(field: bytes, shard: str, offset: int, what: str) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # base-256 (GNU): big sizes
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0x80 else value - (1 << (8 * (len(field) - 1)))
    text = field.split(b"\x00", 1)[0].strip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise CorruptShardError(shard, offset, f"tar header {what} {field!r} is not an octal number") from None


def _pax(data: bytes, shard: str, offset: int) -> dict[str, str]:
    """The records of a pax extended header ("LEN key=value\\n" each)."""
    out: dict[str, str] = {}
    at = 0
    while at < len(data) and data[at] != 0:
        space = data.find(b" ", at)
        try:
            length = int(data[at:space])
        except ValueError:
            raise CorruptShardError(shard, offset, "a pax header record has no length") from None
        record = data[space + 1 : at + length]
        if length <= 0 or at + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise CorruptShardError(shard, offset, f"a pax header record is malformed: {data[at : at + 40]!r}")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return out


def _tar_files(stream: ShardStream) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file of an uncompressed tar, as `tarfile` reads them, checked."""
    shard = stream.name
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        at = stream.position
        if stream.size - at < _BLOCK:
            raise CorruptShardError(shard, at, "the tar ends without its end-of-archive marker (truncated?)")
        header = stream.read(_BLOCK, "a tar header")
        if header == bytes(_BLOCK):
            _check_tar_end(stream, at)
            return
        stored = _number(header[148:156], shard, at, "checksum")
        unsigned = sum(header[:148]) + 256 + sum(header[156:])
        # The signed sum (old tars; bytes as signed chars, as `tarfile` sums them) only when the unsigned one
        # fails: summing it for every header was a tenth of a warm epoch's tar parsing.
        if stored != unsigned and stored != 256 + sum(_SIGNED_HEADER.unpack_from(header)):
            raise CorruptShardError(shard, at, "a tar header fails its checksum" + (": not a tar" if at == 0 else ""))
        size = _number(header[124:136], shard, at, "size")
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            data = stream.read(size, "a tar extended header")
            stream.skip(-size % _BLOCK, "tar padding")
            if kind == b"x":
                pax = _pax(data, shard, at)
            elif kind == b"L":
                long_name = data.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if "size" in pax:
            size = int(pax["size"])
        name = header[0:100].split(b"\x00", 1)[0]
        if header[257:265] == b"ustar\x0000" and header[345:500].strip(b"\x00"):
            name = header[345:500].split(b"\x00", 1)[0] + b"/" + name
        text = pax.get("path") or long_name or name.decode("utf-8", "surrogateescape")
        long_name, pax = None, {}
        if size < 0 or at + _BLOCK + size > stream.size:
            raise CorruptShardError(
                shard, at, f"tar member {text!r} of {size} bytes runs past the end of the shard ({stream.size} bytes)"
            )
        if kind in _REGULAR:
            data = stream.read(size, f"tar member {text!r}")
            stream.skip(-size % _BLOCK, "tar padding")
            yield text, data
        elif kind == b"S":
            raise CorruptShardError(shard, at, f"tar member {text!r} is a GNU sparse file, which this reader refuses")
        else:  # directories, links, devices: no data, or data nobody reads
            stream.skip(size + (-size % _BLOCK), f"tar member {text!r}")


def _check_tar_end(stream: ShardStream, at: int) -> None:
    """After the first zero block: a second one, and nothing but zeros to the end."""
    if stream.size - stream.position < _BLOCK:
        raise CorruptShardError(stream.name, at, "the tar's end-of-archive marker is one block, not two (truncated?)")
    for piece in stream.rest():
        if piece.tobytes().strip(b"\x00"):
            raise CorruptShardError(stream.name, at, "bytes that are not zeros follow the tar's end-of-archive marker")


def tar_samples(stream: ShardStream, url: str) -> Iterator[dict[str, Any]]:
    """The samples of a WebDataset tar shard, as `webdataset.WebDataset(url)` yields them (no decoder)."""
    current: dict[str, Any] | None = None
    for name, data in _tar_files(stream):
        if "/" not in name and name.startswith("__") and name.endswith("__"):
            continue
        if _WDS_META.match(name):
            continue
        split = wds_key(name)
        if split is None:
            continue
        key, extension = split[0], split[1].lower()
        if current is None or key != current["__key__"]:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": url}
        if extension in current:
            raise CorruptShardError(
                stream.name, stream.position, f"{name}: sample {key!r} holds two files with extension {extension!r}"
            )
        current[extension] = data
    if current is not None:
        yield current


# -- MosaicML MDS ---------------------------------------------------------------

_MDS_FIXED = {"int": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4,
              "int64": 8, "float16": 2, "float32": 4, "float64": 8}  # fmt: skip
MDS_SAFE = frozenset(("bytes", "str", "int", "json", "str_int", "str_float", "str_decimal", *_MDS_FIXED))
"""The MDS encodings decoded here without `streaming` installed (others go to `streaming`'s own decoders)."""


def _numpy_scalar(dtype: str) -> Callable[[bytes], Any]:
    import numpy as np

    kind = np.dtype(dtype)
    return lambda data: np.frombuffer(data, kind)[0]


def _decoder(encoding: str, allow_unsafe: bool, where: str) -> Callable[[bytes], Any]:
    if encoding == "pkl" and not allow_unsafe:
        raise ShardError(f"{where} is pickled (encoding 'pkl'); pass allow_unsafe_types=True to unpickle it")
    simple: dict[str, Callable[[bytes], Any]] = {
        "str": lambda data: data.decode("utf-8"),
        "int": lambda data: int.from_bytes(data, "little", signed=True),
        "json": lambda data: json.loads(data.decode("utf-8")),
        "str_int": lambda data: int(data.decode("utf-8")),
        "str_float": lambda data: float(data.decode("utf-8")),
        "str_decimal": lambda data: Decimal(data.decode("utf-8")),
        "pkl": pickle.loads,
    }
    if encoding == "bytes":
        return bytes  # the one copy of a column read as a view of its part
    if encoding in simple:
        return _from_bytes(simple[encoding])
    if encoding in _MDS_FIXED:
        return _from_bytes(_numpy_scalar(encoding))
    try:
        from streaming.base.format.mds.encodings import is_mds_encoding, mds_decode
    except ImportError:
        raise ShardError(f"{where}: encoding {encoding!r} needs mosaicml-streaming's decoders; install it") from None
    if not is_mds_encoding(encoding):
        raise ShardError(f"{where}: unknown MDS encoding {encoding!r}")
    return lambda data: mds_decode(encoding, bytes(data))


def _from_bytes(decode: Callable[[bytes], Any]) -> Callable[[bytes | memoryview], Any]:
    """`decode` fed bytes: a column may come as a view of its shard's part, which no decoded value may keep."""
    return lambda data: decode(bytes(data))


@dataclass(frozen=True)
class MDSColumns:
    """An MDS shard's columns (from its index.json): names, encodings, fixed sizes (None: variable)."""

    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]

    @classmethod
    def from_index(cls, entry: Mapping[str, Any], where: str) -> MDSColumns:
        try:
            names = tuple(str(n) for n in entry["column_names"])
            encodings = tuple(str(e) for e in entry["column_encodings"])
            sizes = tuple(None if s is None else int(s) for s in entry["column_sizes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{where}: the index's columns are malformed: {exc!r}") from None
        if not len(names) == len(encodings) == len(sizes):
            raise ShardError(f"{where}: the index lists {len(names)} columns, {len(encodings)} encodings")
        return cls(names, encodings, sizes)

    def decoders(self, allow_unsafe: bool, where: str) -> list[Callable[[bytes], Any]]:
        """Each column's decoder, checked now so a bad encoding fails before any sample is read."""
        return [
            _decoder(e, allow_unsafe, f"{where} column {n!r}") for n, e in zip(self.names, self.encodings, strict=True)
        ]

    def decode(
        self, data: bytes | memoryview, decoders: Sequence[Callable[[Any], Any]], shard: str, offset: int
    ) -> dict[str, Any]:
        """A sample's dict from its bytes (variable columns' sizes first, then each column's bytes).

        `data` may be a view: each decoder is handed a view of its column and copies it (`decoders`).
        """
        sizes = []
        at = 0
        for size in self.sizes:
            if size is None:
                if at + 4 > len(data):
                    raise CorruptShardError(shard, offset, "a sample's column sizes run past the sample")
                size = struct.unpack_from("<I", data, at)[0]
                at += 4
            sizes.append(size)
        if at + sum(sizes) != len(data):
            raise CorruptShardError(
                shard, offset, f"a sample of {len(data)} bytes holds columns of {at + sum(sizes)} bytes"
            )
        sample = {}
        for name, size, decode in zip(self.names, sizes, decoders, strict=True):
            sample[name] = decode(data[at : at + size])
            at += size
        return sample


def mds_records(stream: ShardStream, samples: int, *, views: bool = False) -> Iterator[tuple[int, bytes | memoryview]]:
    """(offset, bytes) of each sample of an MDS shard, in order, checked against the index's sample count.

    `views`: a sample that lies in one part comes as a view of it (no copy), valid while the part is;
    decode it before the next one and keep no view (`MDSColumns.decode` copies each column out).
    """
    shard = stream.name
    count = struct.unpack("<I", stream.read(4, "the MDS sample count"))[0]
    if count != samples:
        raise CorruptShardError(shard, 0, f"the shard holds {count} samples, its index.json says {samples}")
    table = stream.read(4 * (count + 1), "the MDS offset table")
    offsets = struct.unpack(f"<{count + 1}I", table)
    if offsets[0] < stream.position or offsets[-1] != stream.size:
        raise CorruptShardError(
            shard, 4, f"the offset table spans bytes {offsets[0]}-{offsets[-1]} of a {stream.size}-byte shard"
        )
    stream.skip(offsets[0] - stream.position, "the MDS shard's config")
    for i in range(count):
        begin, end = offsets[i], offsets[i + 1]
        if end < begin:
            raise CorruptShardError(shard, 4 + 4 * (i + 1), f"sample {i} ends (byte {end}) before it begins ({begin})")
        yield begin, (stream.view if views else stream.read)(end - begin, f"MDS sample {i}")
