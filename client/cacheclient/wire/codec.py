"""How values travel in cache-service messages: hand encoding, chunking, and stream assembly.

Both ends use these functions, so each rule exists once:

- `get_response_bytes`: a serialized GetResponse with its value copied once
  (protobuf would copy it into the message and again into the bytes);
- `value_chunks`: one value as stream chunks of `CHUNK_BYTES`, the first one
  carrying the header (key, found, size, checksum, ...);
- `stream_values`: the values of a chunk stream (GetStream, GetManyStream),
  each reassembled and checked against the size its first chunk announced;
- `read_put_stream`: the one value of a PutStream, with the key and size
  checks of the receiver applied before any byte is buffered.

A stream that does not add up raises `StreamError`; each end maps it to its
own typed error (the server: DATA_LOSS; the client: `CorruptValueError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cacheclient._proto import cache_pb2 as pb
from cacheclient.wire.limits import CHUNK_BYTES

__all__ = [
    "StreamError",
    "StreamedPut",
    "get_response_bytes",
    "read_put_stream",
    "stream_values",
    "value_chunks",
]


class StreamError(ValueError):
    """A chunk stream that does not add up: it ends inside a value, or carries more than it announced."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_LENGTH_DELIMITED = 2
_GET_VALUE_TAG = _varint(pb.GetResponse.DESCRIPTOR.fields_by_name["value"].number << 3 | _LENGTH_DELIMITED)


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


def _value_after(head: pb.Chunk, chunks: Iterator[pb.Chunk], check_size: Callable[[int], None] | None = None) -> bytes:
    """The value whose first chunk is `head`, read from `chunks` up to the size `head` announced."""
    size = head.size
    parts = [head.data]
    received = len(head.data)
    while received < size:
        chunk = next(chunks, None)
        if chunk is None:
            raise StreamError(f"stream ended after {received} of the announced {size} bytes of key {head.key[:64]!r}")
        received += len(chunk.data)
        parts.append(chunk.data)
    if received > size:
        # Stop as soon as a stream passes what it announced, so a lying
        # sender cannot make the receiver buffer without bound.
        if check_size is not None:
            check_size(received)
        raise StreamError(f"stream carries more than the announced {size} bytes of key {head.key[:64]!r}")
    return parts[0] if len(parts) == 1 else b"".join(parts)


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
    return StreamedPut(head.key, value, head.checksum, head.lease_seconds or None, head.ttl_seconds or None)
