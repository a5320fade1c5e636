"""Co-located writes: a client's staging memory handed to its server, and the small calls that commit it.

A client on a cache server's machine writes a value's bytes once, into a
shared-memory file of its own (its staging area: a memfd, no name), and
tells the server where they are; the server copies them into its tiers,
verifies the checksum the client named on its own copy, and answers. No value
crosses gRPC. The exchange runs over the server's arena socket
(`cachesvc.server.arena_socket`), which checks the client's user and token as
it does before it hands out the arena:

* the client connects and sends the line `STAGE1 <token>\\n` with its
  staging area's descriptor (SCM_RIGHTS); the server maps it read-only and
  answers `OK\\n`, or `ERR <why>\\n` and closes;
* then, any number of times: a request (`REQUEST`, then the metadata the
  gRPC call would carry as `name=value` lines, then per value an `ITEM` and
  its key) and its answer (`ANSWER`, then the message, then trailing
  metadata as `name=value` lines). The status is a gRPC status code's value
  (0: done); the message and trailing metadata are what the gRPC call
  would have answered, so a client raises the same errors for both.

Large values skip the staging area: the server's `OK` line names
`file_from=N`, and a value of N bytes or more is written straight into its
place in the server's L2. The client sends `PLACE` (magic `PLACE_MAGIC`, a count
of values, then each one's size as a uint64) and gets an `ANSWER` whose
message is the places' ids, space-separated, with a descriptor per place: a
new file in the L2 directory, open for writing (SCM_RIGHTS); it writes each
value there, closes the descriptors, and commits them with a request flagged
`FLAG_PLACED`, whose items name the place's id where an
offset would be. The server refuses a commit while any descriptor of the file
is still open for writing, checks the bytes against the checksum from the
page cache, and indexes the file where it lies. Places not committed when the
session ends are deleted.

Every integer is little-endian. A value's bytes must lie inside the staging
area; the client does not touch them until the answer comes.
"""

from __future__ import annotations

import socket
import struct
from typing import Final

__all__ = [
    "ANSWER",
    "FLAG_DURABLE",
    "FLAG_PLACED",
    "ITEM",
    "MAGIC",
    "MAX_ITEMS",
    "MAX_PLACES",
    "MAX_TEXT",
    "PLACE",
    "PLACE_MAGIC",
    "PLACE_SIZE",
    "REQUEST",
    "decode_pairs",
    "encode_pairs",
    "recv_exactly",
]

MAGIC: Final = b"PUT1"
REQUEST = struct.Struct("<4sIIIdd")
"""magic, flags, value count, metadata bytes, lease seconds (0: the namespace's), TTL seconds (0: likewise)."""
ITEM = struct.Struct("<IQQQ")
"""key length, offset in the staging area, value length, the value's xxh3_64; the key's bytes follow."""
ANSWER = struct.Struct("<III")
"""status (a gRPC status code's value; 0: done), message bytes, trailing metadata bytes."""
FLAG_DURABLE: Final = 1
"""Every value must be durable (on the server's disk or in object storage) when the answer says done."""
FLAG_PLACED: Final = 2
"""Every item names a place (its id where the offset would be) the client wrote the value into."""
PLACE_MAGIC: Final = b"PLC1"
PLACE = struct.Struct("<4sI")
"""magic, a count of places (at most `MAX_PLACES`); then each value's size (`PLACE_SIZE`)."""
PLACE_SIZE = struct.Struct("<Q")
MAX_PLACES: Final = 16
"""Places one session holds uncommitted at once."""
MAX_ITEMS: Final = 4096
"""Values in one request (as many as a PutMany batch takes)."""
MAX_TEXT: Final = 64 * 1024
"""The most bytes of metadata, or of a key list's keys, one request carries per part."""


def encode_pairs(pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> bytes:
    """`name=value` lines (names and values without newlines, as gRPC metadata is)."""
    return "".join(f"{name}={value}\n" for name, value in pairs).encode()


def decode_pairs(data: bytes) -> list[tuple[str, str]]:
    pairs = []
    for line in data.decode(errors="replace").splitlines():
        name, _, value = line.partition("=")
        pairs.append((name, value))
    return pairs


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from `sock` (either end of a session); ConnectionError when the peer closes first."""
    parts = []
    while size:
        part = sock.recv(min(size, 1 << 20))
        if not part:
            raise ConnectionError("the peer closed the staging session mid-message")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)
