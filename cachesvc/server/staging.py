"""The server's end of co-located writes (`cacheclient.wire.staging`): a client's staging area, mapped
read-only, and the requests that commit values from it.

A session starts on the arena socket (`cachesvc.server.arena_socket`), which
has checked the client's user and token; it gets a thread of its own, at most
`MAX_SESSIONS` at once. The staging area must be a memfd sealed against
shrinking (`F_SEAL_SHRINK`): a client that truncated a mapped file would
otherwise kill the server reading it (SIGBUS). Each request's values are
copied out of the staging area before they are checked (their checksums, the
key and size limits, the routing) and written as a PutMany's are, through
`Writer`; the client cannot change them after. A request that breaks the
framing (a count, a key or metadata over its limit) is answered and ends the
session; one the engine refuses is answered with the gRPC status the same
write would have got, and the session goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import grpc

from cacheclient.wire.limits import MAX_BATCH_KEYS, MAX_KEY_BYTES
from cacheclient.wire.staging import (
    ANSWER,
    FLAG_DURABLE,
    ITEM,
    MAGIC,
    MAX_TEXT,
    REQUEST,
    decode_pairs,
    encode_pairs,
    recv_exactly,
)
from cachesvc.errors import CacheError, LimitReached, NotOwner
from cachesvc.server.status import status_of

__all__ = ["MAX_SESSIONS", "StagingSessions", "Writer"]

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
"""Staging sessions open at once (each holds a thread and a mapping); more are refused."""
MAX_REQUEST_BYTES = 1 << 30
"""The most value bytes one request copies out of a staging area (the client's areas are smaller)."""
TIMEOUT = 5.0
"""Seconds the rest of a request may take to arrive once its first bytes have."""

Writer = Callable[[dict[str, str], list[tuple[bytes, bytes, int]], float | None, float | None, bool], None]
"""Writes (key, value, checksum) items as a PutMany with this metadata, lease, TTL and durability would;
raises `CacheError` as that call would fail."""


class _Refused(Exception):
    """A request that breaks the framing: answered, and the session ends."""


class StagingSessions:
    """The open staging sessions of one server (see the module docstring).

    Args:
        writer: what commits a request's values (the servicer's `put_staged`).
        check_size: raises `CacheError` for a value size the server refuses (asked before any copy).
    """

    def __init__(self, writer: Writer, check_size: Callable[[int], None]) -> None:
        self._writer = writer
        self._check_size = check_size
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.counters: Counter[str] = Counter()
        """staging_sessions (opened), staging_puts, staging_put_bytes, staging_refused."""

    def stats(self) -> dict[str, int]:
        """The counters, and the sessions open now (`staging_sessions_open`)."""
        with self._lock:
            return {**self.counters, "staging_sessions_open": len(self._open)}

    def start(self, conn: socket.socket, fd: int) -> str:
        """Takes over `conn` with the staging area `fd` (closed here either way); "" when the session
        started, else why not (the caller answers and closes)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            os.close(fd)
            return "the staging area must be a memfd (sealed against shrinking)"
        try:
            if not seals & fcntl.F_SEAL_SHRINK:
                return "the staging area must be sealed against shrinking (F_SEAL_SHRINK)"
            size = os.fstat(fd).st_size
            if size <= 0:
                return "the staging area is empty"
            area = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            if len(self._open) >= MAX_SESSIONS:
                area.close()
                return f"{MAX_SESSIONS} staging sessions are open already"
            self._open.add(conn)
            self.counters["staging_sessions"] += 1
        conn.sendall(b"OK\n")
        threading.Thread(target=self._serve, args=(conn, area), name="staging", daemon=True).start()
        return ""

    def close(self) -> None:
        """Ends every session (their threads see the connection shut)."""
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _serve(self, conn: socket.socket, area: mmap.mmap) -> None:
        try:
            with conn:
                while self._one(conn, area):
                    pass
        except OSError as exc:
            log.debug("a staging session ended: %s", exc)
        finally:
            with self._lock:
                self._open.discard(conn)
            area.close()

    def _one(self, conn: socket.socket, area: mmap.mmap) -> bool:
        """Answers one request; False when the session is over."""
        conn.settimeout(None)  # a session may sit idle between writes
        first = conn.recv(REQUEST.size)
        if not first:
            return False
        conn.settimeout(TIMEOUT)
        try:
            metadata, wanted, lease, ttl, durable = self._read(conn, first, len(area))
        except _Refused as exc:
            self.counters["staging_refused"] += 1
            _answer(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return False
        try:
            total = 0
            for _, _, length, _ in wanted:
                self._check_size(length)  # before a byte is copied
                total += length
            if total > MAX_REQUEST_BYTES:
                raise LimitReached(
                    f"a staged put of {total} bytes is over the limit of {MAX_REQUEST_BYTES}; split the batch"
                )
            # Copied before anything checks them: the client can write its area at any time.
            items = [(key, area[offset : offset + length], checksum) for key, offset, length, checksum in wanted]
            self._writer(metadata, items, lease, ttl, durable)
        except CacheError as exc:
            trailing = exc.trailing_metadata() if isinstance(exc, NotOwner) else ()
            _answer(conn, status_of(exc), str(exc), trailing)
            return True
        except Exception as exc:
            log.exception("internal error in a staged put")
            _answer(conn, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            return True
        self.counters["staging_puts"] += len(items)
        self.counters["staging_put_bytes"] += total
        _answer(conn, grpc.StatusCode.OK, "")
        return True

    def _read(
        self, conn: socket.socket, first: bytes, size: int
    ) -> tuple[dict[str, str], list[tuple[bytes, int, int, int]], float | None, float | None, bool]:
        """A request's metadata, (key, offset, length, checksum) per value, lease, TTL and durability."""
        head = first + recv_exactly(conn, REQUEST.size - len(first))
        magic, flags, count, metadata_bytes, lease, ttl = REQUEST.unpack(head)
        if magic != MAGIC:
            raise _Refused(f"not a staged put (magic {magic!r})")
        if not 0 < count <= MAX_BATCH_KEYS:
            raise _Refused(f"a staged put of {count} values: from 1 to MAX_BATCH_KEYS={MAX_BATCH_KEYS}")
        if metadata_bytes > MAX_TEXT:
            raise _Refused(f"{metadata_bytes} bytes of metadata is over the limit of {MAX_TEXT}")
        metadata = dict(decode_pairs(recv_exactly(conn, metadata_bytes)))
        wanted = []
        for _ in range(count):
            key_bytes, offset, length, checksum = ITEM.unpack(recv_exactly(conn, ITEM.size))
            if key_bytes > MAX_KEY_BYTES:
                raise _Refused(f"a key of {key_bytes} bytes is over the limit of MAX_KEY_BYTES={MAX_KEY_BYTES}")
            key = recv_exactly(conn, key_bytes)
            if offset + length > size:
                raise _Refused(f"value of key {key[:64]!r} at {offset}+{length} lies outside the {size}-byte area")
            wanted.append((key, offset, length, checksum))
        return metadata, wanted, lease or None, ttl or None, bool(flags & FLAG_DURABLE)


def _answer(conn: socket.socket, code: grpc.StatusCode, message: str, trailing: Sequence[tuple[str, str]] = ()) -> None:
    text = message.encode()
    pairs = encode_pairs(list(trailing))
    conn.sendall(ANSWER.pack(code.value[0], len(text), len(pairs)) + text + pairs)
