"""How values travel in cache-service messages: hand encoding, chunking, and stream assembly.

Both ends use these functions, so each rule exists once:

- `get_response_bytes`: a serialized GetResponse with its value copied once
  (protobuf would copy it into the message and again into the bytes);
- `value_chunks`: one value as stream chunks of `CHUNK_BYTES`, the first one
  carrying the header (key, found, size, checksum, ...);
- `encoded_value_chunks`: the same chunks already serialized, each value byte
  copied once (what the server sends on GetStream and GetManyStream);
- `stream_values`: the values of a chunk stream (GetStream, GetManyStream),
  each reassembled and checked against the size its first chunk announced;
- `stream_value_views`: the same from the serialized chunks, each value's
  bytes left where they arrived (views of the messages, no protobuf parse of
  the data: the client's read path);
- `read_put_stream`: the one value of a PutStream, with the key and size
  checks of the receiver applied before any byte is buffered;
- `put_request_bytes`, `put_many_request_bytes`: a serialized Put or
  PutMany request whose values are given as pieces, each value byte
  copied once, into the message (a KV block straight out of an engine's
  pages is never joined first).

A stream that does not add up raises `StreamError`; each end maps it to its
own typed error (the server: DATA_LOSS; the client: `CorruptValueError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError

from cacheclient._proto import cache_pb2 as pb
from cacheclient.wire.limits import CHUNK_BYTES

__all__ = [
    "StreamError",
    "StreamedPut",
    "encoded_value_chunks",
    "get_response_bytes",
    "parse_chunk",
    "put_many_request_bytes",
    "put_request_bytes",
    "read_put_stream",
    "stream_value_views",
    "stream_values",
    "value_chunks",
]

_Data = TypeVar("_Data", bytes, memoryview)
"""A chunk's data: bytes from a parsed message, or a view of a serialized one."""


class StreamError(ValueError):
    """A chunk stream that does not add up: it ends inside a value, or carries more than it announced."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(message: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` of `message` and the position after it."""
    result = shift = 0
    while pos < len(message) and shift < 64:
        byte = message[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise StreamError("a chunk ends inside a varint")


_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_GET_VALUE_TAG = _varint(pb.GetResponse.DESCRIPTOR.fields_by_name["value"].number << 3 | _LENGTH_DELIMITED)
_CHUNK_DATA_FIELD = pb.Chunk.DESCRIPTOR.fields_by_name["data"].number
_CHUNK_DATA_TAG = _varint(_CHUNK_DATA_FIELD << 3 | _LENGTH_DELIMITED)
_PUT_VALUE_TAG = _varint(pb.PutRequest.DESCRIPTOR.fields_by_name["value"].number << 3 | _LENGTH_DELIMITED)
_PUT_ITEMS_TAG = _varint(pb.PutManyRequest.DESCRIPTOR.fields_by_name["items"].number << 3 | _LENGTH_DELIMITED)


def get_response_bytes(header: pb.GetResponse, value: bytes) -> bytes:
    """The wire bytes of `header` with its `value` field set to `value`, the value copied once.

    The header's fields are serialized by protobuf and the value field is
    appended by hand; field order does not matter to a protobuf parser, so
    this is the message `header` with `value` set would serialize to.

    Args:
        header: a GetResponse without a value.
        value: the value's bytes.
    """
    head = header.SerializeToString()
    if not value:
        return head
    return b"".join((head, _GET_VALUE_TAG, _varint(len(value)), value))


def encoded_value_chunks(head: pb.Chunk, value: bytes) -> Iterator[bytes]:
    """`value_chunks`, serialized: `head` and the first `CHUNK_BYTES`, then the rest, each value byte copied once.

    The data field is appended by hand, as in `get_response_bytes`; a chunk
    after the first is its data field alone (every other field unset).

    Args:
        head: the first chunk's fields (key, found, size, checksum, ...), without data.
        value: the bytes to send.
    """
    view = memoryview(value)
    first = view[:CHUNK_BYTES]
    head_bytes = head.SerializeToString()
    yield b"".join((head_bytes, _CHUNK_DATA_TAG, _varint(len(first)), first)) if first else head_bytes
    for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        piece = view[start : start + CHUNK_BYTES]
        yield b"".join((_CHUNK_DATA_TAG, _varint(len(piece)), piece))


def _put_request_parts(head: pb.PutRequest, pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """A serialized PutRequest as parts to join: `head` (every field but the value), then the value's field by
    hand (protobuf takes fields in any order), its bytes the pieces as they are."""
    return [head.SerializeToString(), _PUT_VALUE_TAG, _varint(sum(len(p) for p in pieces)), *pieces]


def put_request_bytes(head: pb.PutRequest, pieces: Sequence[bytes | memoryview]) -> bytes:
    """A serialized PutRequest: `head`'s fields (no value set) and the value, the concatenation of `pieces`,
    each byte copied once (protobuf would copy a value into the message and again into the bytes)."""
    return b"".join(_put_request_parts(head, pieces))


def put_many_request_bytes(items: Iterable[tuple[pb.PutRequest, Sequence[bytes | memoryview]]]) -> bytes:
    """A serialized PutManyRequest of (`head`, value pieces) items, as `put_request_bytes`: one copy of each
    value byte."""
    parts: list[bytes | memoryview] = []
    for head, pieces in items:
        item = _put_request_parts(head, pieces)
        parts += [_PUT_ITEMS_TAG, _varint(sum(len(p) for p in item)), *item]
    return b"".join(parts)


def parse_chunk(message: bytes) -> tuple[pb.Chunk, memoryview]:
    """A serialized Chunk's fields other than data, and its data as a view of `message` (not copied).

    Protobuf parses the small fields; the data field is found by walking the
    wire format and left in place, so a 1 MiB chunk costs no copy here.
    As protobuf does, the last data field wins if a message repeats it.

    Raises:
        StreamError: the message is not a well-formed Chunk.
    """
    view = memoryview(message)
    data = view[:0]
    kept: list[memoryview] = []  # the bytes of every other field, for protobuf
    kept_from = pos = 0
    end = len(message)
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(message, pos)
        wire_type = tag & 7
        if wire_type == _VARINT:
            _, pos = _read_varint(message, pos)
        elif wire_type == _FIXED64:
            pos += 8
        elif wire_type == _FIXED32:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(message, pos)
            if tag >> 3 == _CHUNK_DATA_FIELD:
                data = view[pos : pos + length]
                kept.append(view[kept_from:field_start])
                kept_from = pos + length
            pos += length
        else:
            raise StreamError(f"a chunk carries a field of wire type {wire_type}")
    if pos > end:
        raise StreamError("a chunk ends inside a field")
    if kept_from != 0:
        kept.append(view[kept_from:])
    try:
        # Protobuf refuses what this walk lets through (field number 0, say).
        return pb.Chunk.FromString(message if kept_from == 0 else b"".join(kept)), data
    except DecodeError as exc:
        raise StreamError(f"a chunk does not parse: {exc}") from None


def value_chunks(head: pb.Chunk, value: bytes) -> Iterator[pb.Chunk]:
    """`value` as stream chunks: `head` (its header fields) with the first `CHUNK_BYTES`, then the rest.

    Args:
        head: the first chunk's fields (key, found, size, checksum, ...); its
            data is set here.
        value: the bytes to send.
    """
    view = memoryview(value)
    head.data = view[:CHUNK_BYTES].tobytes()
    yield head
    for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        yield pb.Chunk(data=view[start : start + CHUNK_BYTES].tobytes())


def _pieces_after(
    head: pb.Chunk, first: _Data, rest: Iterator[_Data], check_size: Callable[[int], None] | None = None
) -> list[_Data]:
    """The data pieces of the value whose first chunk is `head` (data `first`), read from `rest` up to its size."""
    size = head.size
    parts = [first]
    received = len(first)
    while received < size:
        data = next(rest, None)
        if data is None:
            raise StreamError(f"stream ended after {received} of the announced {size} bytes of key {head.key[:64]!r}")
        received += len(data)
        parts.append(data)
    if received > size:
        # Stop as soon as a stream passes what it announced, so a lying
        # sender cannot make the receiver buffer without bound.
        if check_size is not None:
            check_size(received)
        raise StreamError(f"stream carries more than the announced {size} bytes of key {head.key[:64]!r}")
    return parts


def _value_after(head: pb.Chunk, chunks: Iterator[pb.Chunk], check_size: Callable[[int], None] | None = None) -> bytes:
    """The value whose first chunk is `head`, read from `chunks` up to the size `head` announced."""
    parts = _pieces_after(head, head.data, (chunk.data for chunk in chunks), check_size)
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def stream_values(chunks: Iterable[pb.Chunk]) -> Iterator[tuple[pb.Chunk, bytes | None]]:
    """(first chunk, value) for each value of a GetStream or GetManyStream, in order; None for a miss.

    The first chunk of a value carries its key, size, checksum and tier. Sizes
    are checked here; checksums are the caller's to check.

    Raises:
        StreamError: the stream ends inside a value or a value is longer than announced.
    """
    it = iter(chunks)
    for head in it:
        yield head, (_value_after(head, it) if head.found else None)


def stream_value_views(messages: Iterable[bytes]) -> Iterator[tuple[pb.Chunk, list[memoryview] | None]]:
    """`stream_values` over serialized chunks: (first chunk's fields, the value's pieces) for each value, in order.

    Each piece is one chunk's data, a view of the message it came in (no
    copy); the pieces of a value add up to the size its first chunk
    announced. None for a miss.

    Raises:
        StreamError: a chunk is malformed, or the stream ends inside a value or a value is longer than announced.
    """
    it = iter(messages)
    for message in it:
        head, data = parse_chunk(message)
        if not head.found:
            yield head, None
            continue
        yield head, _pieces_after(head, data, (parse_chunk(m)[1] for m in it))


@dataclass(frozen=True, slots=True)
class StreamedPut:
    """The value a PutStream carried, with what its first chunk said about it."""

    key: bytes
    value: bytes
    checksum: int
    lease: float | None
    """Seconds to pin the value; None: the namespace's default (0 on the wire)."""
    ttl: float | None
    """Seconds to keep the value; None: the namespace's default (0 on the wire)."""
    durable: bool = False
    """Durable once the put returns (`PutRequest.durable`)."""


def read_put_stream(
    chunks: Iterable[pb.Chunk],
    *,
    check_key: Callable[[bytes], None],
    check_size: Callable[[int], None],
) -> StreamedPut:
    """The one value of a PutStream, reassembled; the key and size are checked before any byte is kept.

    Args:
        chunks: the stream; the first chunk carries key, size, checksum, lease and TTL.
        check_key: raises for a key the receiver refuses (an empty stream has the empty key).
        check_size: raises for a size the receiver refuses; called with the
            announced size, and with the size received when a stream passes it.

    Raises:
        StreamError: the stream is shorter or longer than it announced.
    """
    it = iter(chunks)
    head = next(it, None) or pb.Chunk()
    check_key(head.key)
    check_size(head.size)
    value = _value_after(head, it, check_size)
    received = len(value)
    for extra in it:
        received += len(extra.data)
        if received > head.size:
            check_size(received)
            raise StreamError(f"stream carries more than the announced {head.size} bytes of key {head.key[:64]!r}")
    return StreamedPut(
        head.key, value, head.checksum, head.lease_seconds or None, head.ttl_seconds or None, head.durable
    )
