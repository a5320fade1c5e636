"""Key digests: the 8-byte names a client's local index knows the server's keys by.

A cache server remembers which keys under its `kv_index_prefixes` it holds
and answers them (`KeyDigest` RPC) as digests: xxh3-64 of the key, packed as
little-endian 8-byte integers. Two keys with one digest make the index claim
a key that is not held: a lookup then finds a block gone, which is a miss,
never a wrong value (every value is checked when it is read).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import xxhash

__all__ = ["DIGEST_BYTES", "KEY_DIGEST_ENTRIES", "key_digest", "pack_digests", "unpack_digests"]

DIGEST_BYTES = 8

KEY_DIGEST_ENTRIES = 1 << 17
"""Most digests one KeyDigest answer carries (1 MiB); a larger snapshot comes in pages."""

key_digest = xxhash.xxh3_64_intdigest
"""The digest of a key (bytes): xxh3-64, seed 0."""


def pack_digests(digests: Iterable[int]) -> bytes:
    """Digests as little-endian 8-byte integers, in order."""
    packed = array("Q", digests)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_digests(data: bytes) -> array[int]:
    """The digests `pack_digests` packed.

    Raises:
        ValueError: `data` is not a whole number of digests.
    """
    if len(data) % DIGEST_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {DIGEST_BYTES}-byte digests")
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed
