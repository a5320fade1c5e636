"""How a call's keys and values are cut to the wire's size limits, shared by the node client and the routing.

Keys arrive as bytes or str (`as_key`); batches are the longest runs that fit
one message (`batch`); a value read from a stream arrives as the data of its
chunks and leaves as bytes (`joined`) or a view (`view`); a value put may
come as pieces (`Gathered`), written where it goes without being joined
first. The limits
themselves are the wire's (`cacheclient.wire.limits`); the tuned thresholds
below are the client's own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from cacheclient.errors import InvalidRequestError
from cacheclient.wire import MAX_MESSAGE_BYTES

__all__ = [
    "KEY_BYTES_PER_MESSAGE",
    "PLAN_MESSAGE_BYTES",
    "STREAM_FROM_BYTES",
    "Gathered",
    "PutValue",
    "as_key",
    "joined",
    "next_batch",
    "view",
]

PLAN_MESSAGE_BYTES = 1 << 20
"""Bytes of keys one message of a prefetch plan carries at most (well under the message limit)."""
STREAM_FROM_BYTES = 256 << 10
"""Values a GetMany left waiting this large follow in a stream; smaller ones in further GetMany answers.

Measured here (L1 hits, 2 cores): from 256 KiB a stream message beats a
share of a unary answer; below it the per-message cost of a stream loses.
"""
KEY_BYTES_PER_MESSAGE = MAX_MESSAGE_BYTES // 2
"""Bytes of keys one batched request carries at most (the rest of a message is headroom)."""


def as_key(key: bytes | str) -> bytes:
    """A key as the wire carries it: str as UTF-8, any bytes-like object as bytes.

    Raises:
        InvalidRequestError: neither bytes nor str.
    """
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    raise InvalidRequestError(f"key must be bytes or str, got {type(key).__name__}")


def next_batch(indexes: Sequence[int], size_of: Callable[[int], int], max_bytes: int, max_keys: int) -> list[int]:
    """The longest prefix of `indexes`, at most `max_keys` long, whose sizes add up to at most `max_bytes` (min 1)."""
    total = 0
    for n, i in enumerate(indexes):
        total += size_of(i)
        if n > 0 and (n >= max_keys or total > max_bytes):
            return list(indexes[:n])
    return list(indexes)


def view(pieces: list[memoryview]) -> memoryview:
    """A value from its chunks' data: the one chunk's view as it is, or the chunks joined once."""
    return pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))


def joined(pieces: list[memoryview]) -> bytes:
    """A value's bytes from its chunks' data: one copy."""
    return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)


class Gathered:
    """A value to put, held as pieces (byte views, in order) that are not joined first: a co-located put copies
    each piece straight into the server's staging area, or writes it into its L2 place, hashing the bytes as
    they are written (`cacheclient.staged`), so the value is copied once; a put over gRPC copies them once,
    into the serialized message (`cacheclient.wire.codec.put_request_bytes`; a value streamed in chunks, over
    `INLINE_BYTES`, is joined first). A KV block is one, straight out of an engine's pages (`cacheclient._paged`).

    The pieces are read when the put runs: they must not change until it returns.
    """

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self.pieces = tuple(pieces)
        """Flat byte views (format "B"), in the value's order."""
        self.nbytes = sum(len(piece) for piece in self.pieces)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


PutValue = bytes | bytearray | Gathered
"""A value as a put carries it to its transport: bytes (or a contiguous byte view), or pieces (`Gathered`)."""


def writable_bytes(buffer: Any) -> memoryview:
    """`buffer` as a writable, flat memoryview of bytes: a bytearray, memoryview, numpy array or CPU torch tensor.

    Raises:
        InvalidRequestError: the buffer is read-only, not contiguous, or not a buffer at all.
    """
    target = buffer
    if hasattr(buffer, "numpy") and hasattr(buffer, "is_contiguous"):  # a torch tensor, without importing torch
        if getattr(buffer.device, "type", "cpu") != "cpu":
            raise InvalidRequestError(
                f"get_into takes a CPU tensor (copy to the device after), got one on {buffer.device}"
            )
        if not buffer.is_contiguous():
            raise InvalidRequestError("get_into takes a contiguous tensor")
        target = buffer.detach().view(-1).view(torch_uint8(buffer)).numpy()
    try:
        view = memoryview(target)
    except TypeError:
        raise InvalidRequestError(f"get_into takes a writable buffer, not a {type(buffer).__name__}") from None
    if view.readonly:
        raise InvalidRequestError(f"get_into takes a writable buffer; this {type(buffer).__name__} is read-only")
    if not view.c_contiguous:
        raise InvalidRequestError(f"get_into takes a contiguous buffer; this {type(buffer).__name__} is not")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def torch_uint8(tensor: Any) -> Any:
    """torch.uint8, from the module of `tensor` (the client does not import torch for this)."""
    return sys.modules["torch"].uint8
