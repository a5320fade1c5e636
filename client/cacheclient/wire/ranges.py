"""Range keys: the reserved cache keys that name a byte range of an object in object storage.

A range key is an object's cache key, then `RANGE_MARK` (a NUL and
"bytes="), then the first and last byte of the range, inclusive, as in an
HTTP Range header::

    b"models/llama.safetensors\\x00bytes=8-1031"

Reading one is an ordinary `get`: on a miss the server's S3 tier reads just
those bytes of the object (a ranged GET) and the engine caches them under
the range key like any fill, checksummed (xxh3-64) as they arrive, so a
client can read a file it did not write (a safetensors model) piece by piece
without rewriting it. The range is bounded by the server's `max_value_bytes`.

Range keys are read-only: a server refuses to store a value under one (so no
one can shadow an object's bytes with others), and deleting one drops only
the cached copy, never the object. A key that contains `RANGE_MARK` and does
not parse is invalid. A NUL cannot appear in a text object name, so no
object of a readable name is shadowed by the reserved form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["RANGE_MARK", "ByteRange", "RangeKeyError", "is_range_key", "parse_range_key", "range_key"]

RANGE_MARK = b"\x00bytes="
"""What makes a key a range key: the object's key comes before it, "START-END" after it."""
_TAIL = re.compile(rb"(0|[1-9][0-9]{0,18})-(0|[1-9][0-9]{0,18})")


class RangeKeyError(ValueError):
    """A key holds `RANGE_MARK` but names no valid range; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A byte range of an object: `key` is the object's cache key, `start` and `end` its first and last byte."""

    key: bytes
    start: int
    end: int

    @property
    def length(self) -> int:
        """Bytes in the range."""
        return self.end - self.start + 1

    def header(self) -> str:
        """The range as an HTTP Range header value: "bytes=START-END"."""
        return f"bytes={self.start}-{self.end}"


def range_key(key: bytes, start: int, end: int) -> bytes:
    """The key of bytes `start` to `end` (inclusive) of the object cached as `key`.

    Raises:
        RangeKeyError: an empty range, a negative start, or `key` itself a range key.
    """
    if RANGE_MARK in key or not key:
        raise RangeKeyError(f"a range needs an object key that is not empty and not a range key, got {key[:64]!r}")
    if start < 0 or end < start:
        raise RangeKeyError(f"bytes={start}-{end} is not a range (want 0 <= start <= end)")
    return key + RANGE_MARK + f"{start}-{end}".encode()


def is_range_key(key: bytes) -> bool:
    """Whether `key` is of the reserved form (valid or not): it holds `RANGE_MARK`."""
    return RANGE_MARK in key


def parse_range_key(key: bytes) -> ByteRange | None:
    """The range a range key names; None for any other key.

    Raises:
        RangeKeyError: `key` holds `RANGE_MARK` but what follows is not
            "START-END" in decimal with START <= END, or no object key comes before it.
    """
    at = key.rfind(RANGE_MARK)
    if at < 0:
        return None
    tail = key[at + len(RANGE_MARK) :]
    found = _TAIL.fullmatch(tail)
    if at == 0 or RANGE_MARK in key[:at]:
        raise RangeKeyError(f"range key {key[:64]!r}: want one object key before {RANGE_MARK!r}")
    if found is None:
        raise RangeKeyError(f"range key {key[:64]!r}: {tail[:40]!r} is not START-END in decimal")
    start, end = int(found.group(1)), int(found.group(2))
    if end < start:
        raise RangeKeyError(f"range key {key[:64]!r}: bytes={start}-{end} ends before it starts")
    return ByteRange(key[:at], start, end)
