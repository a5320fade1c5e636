"""Co-located writes: a value is written once, into this process's staging area, and committed with a small
call on the server's arena socket (`cacheclient.wire.staging`); no value crosses gRPC.

`StagedWriter` is one process's writer to one co-located server. It keeps
up to `MAX_SESSIONS` sessions (a put waits for a free one), each with its own
staging area: a memfd sealed against shrinking and growing, so the server can
map it safely, `STAGING_BYTES` at first and larger (to the next power of two)
for a larger value, up to `MAX_VALUE_BYTES`; a larger value goes over gRPC.
The sessions of one writer hold at most `MAX_STAGING_BYTES` together. A
forked child opens sessions of its own.

A value of the server's `file_from` bytes or more skips the staging area: it
is written once, straight into a file in the server's L2 that the session
hands out (a place), its checksum computed piece by piece as the pieces are
written, and committed where it lies (`cacheclient.wire.staging`).

A value given as pieces (`cacheclient._batches.Gathered`: a KV block, its
header and then its runs straight out of an engine's pages) is written
piece by piece, never joined: into the staging area, each piece copied
once and hashed where it landed; into a place, each piece written and
hashed as it is.

The server answers as the PutMany would have (a wrong key, a full tier, a
key it does not own), and `put_many` raises the same error the gRPC path
would. A session that breaks (the server stopped) is dropped, and the values
not yet acknowledged are left to the caller to send over gRPC: a put of the
same value again is harmless.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import threading
from collections.abc import Callable, Sequence

import grpc
import xxhash

from cacheclient._batches import Gathered, PutValue
from cacheclient.errors import CacheClientError, DeadlineError, from_status
from cacheclient.wire.limits import MAX_BATCH_KEYS
from cacheclient.wire.names import AUTH_METADATA
from cacheclient.wire.staging import (
    ANSWER,
    FLAG_DURABLE,
    FLAG_PLACED,
    ITEM,
    MAGIC,
    MAX_PLACES,
    MAX_TEXT,
    PLACE,
    PLACE_MAGIC,
    PLACE_SIZE,
    REQUEST,
    decode_pairs,
    encode_pairs,
    recv_exactly,
)

__all__ = ["MAX_SESSIONS", "MAX_STAGING_BYTES", "MAX_VALUE_BYTES", "STAGING_BYTES", "StagedWriter"]

log = logging.getLogger(__name__)

STAGING_BYTES = 32 << 20
"""A session's staging area at first."""
MAX_VALUE_BYTES = 256 << 20
"""The largest value written through a staging area (larger ones go over gRPC)."""
MAX_STAGING_BYTES = 512 << 20
"""The staging areas of one writer's sessions together."""
MAX_SESSIONS = 4
"""Sessions one writer keeps (so as many puts of one process run at once)."""
_ALIGN = 64
_PIECE = 4 << 20
"""Bytes written (then hashed, while in cache) at a time into a place."""
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Session:
    """One staging area and the connection it was handed over."""

    def __init__(self, path: str, token: str | None, size: int, timeout: float) -> None:
        fd = os.memfd_create("cacheclient-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.area = mmap.mmap(fd, size)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(path)
                socket.send_fds(sock, [b"STAGE1 " + (token or "").encode() + b"\n"], [fd])
                line = _line(sock)
            except BaseException:
                sock.close()
                self.area.close()
                raise
        finally:
            os.close(fd)
        if not line.startswith(b"OK"):
            sock.close()
            self.area.close()
            raise CacheClientError(f"the co-located server at {path} refused writes: {line.decode().strip()}")
        self.sock = sock
        self.size = size
        fields = dict(field.partition("=")[::2] for field in line.decode().split()[1:])
        self.file_from = int(fields.get("file_from", "0") or 0)
        """Values of this many bytes or more are written in place in the server's L2 (0: none)."""

    def close(self) -> None:
        self.sock.close()
        self.area.close()

    def place(self, values: Sequence[memoryview | Gathered], timeout: float, address: str) -> list[tuple[int, int]]:
        """Writes `values` into places the server hands out (one round trip for all); (place id, checksum) each.

        Raises:
            CacheClientError: the server refused the places.
        """
        sock = self.sock
        sock.settimeout(timeout)
        sock.sendall(PLACE.pack(PLACE_MAGIC, len(values)) + b"".join(PLACE_SIZE.pack(len(v)) for v in values))
        head, fds, _flags, _address = socket.recv_fds(sock, ANSWER.size, len(values))
        try:
            head += recv_exactly(sock, ANSWER.size - len(head))
            status, message_bytes, trailing_bytes = ANSWER.unpack(head)
            message = recv_exactly(sock, message_bytes).decode(errors="replace")
            trailing = decode_pairs(recv_exactly(sock, trailing_bytes))
            if status or len(fds) != len(values):
                why = message or "no files came with the places"
                raise from_status(_CODES.get(status or grpc.StatusCode.INTERNAL.value[0]), why, trailing, address)
            placed = []
            for place, fd, value in zip(message.split(), fds, values, strict=True):
                placed.append((int(place), _write_place(fd, value)))
            return placed
        finally:
            for fd in fds:
                os.close(fd)  # before the commit: the server refuses a place still open for writing

    def commit(
        self,
        items: list[tuple[bytes, int, int, int]],
        head: tuple[int, float, float],
        metadata: bytes,
        timeout: float,
    ) -> tuple[int, str, list[tuple[str, str]]]:
        """Sends one request for `items` (key, offset or place, length, checksum); (status, message, trailing)."""
        flags, lease, ttl = head
        parts = [REQUEST.pack(MAGIC, flags, len(items), len(metadata), lease, ttl), metadata]
        for key, offset, length, checksum in items:
            parts += [ITEM.pack(len(key), offset, length, checksum), key]
        sock = self.sock
        sock.settimeout(timeout)
        sock.sendall(b"".join(parts))
        status, message_bytes, trailing_bytes = ANSWER.unpack(recv_exactly(sock, ANSWER.size))
        message = recv_exactly(sock, message_bytes).decode(errors="replace")
        return status, message, decode_pairs(recv_exactly(sock, trailing_bytes))


class StagedWriter:
    """One process's co-located writes to the server whose arena socket is `path` (see the module docstring).

    Args:
        path: the server's arena socket.
        address: the server's gRPC address (named in errors).
        token: the data token, when the server has one.
    """

    def __init__(self, path: str, address: str, token: str | None) -> None:
        self.path = path
        self.address = address
        self._token = token
        self._pid = os.getpid()
        self._free: list[_Session] = []
        self._open = 0
        self._bytes = 0
        self._changed = threading.Condition()
        self._closed = False
        self._file_from: int | None = None
        """The server's `file_from`, once a session told it."""

    def put_many(
        self,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        durable: bool,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ) -> int:
        """Writes `pairs` in order, as many per request as a staging area holds; returns how many were written
        (the rest, from the first over `MAX_VALUE_BYTES` or after the session broke, are the caller's to send
        over gRPC).

        Raises:
            CacheClientError: the server refused a request, as PutMany would have.
        """
        if os.getpid() != self._pid:
            self._forked()
        sent = [(name, value) for name, value in metadata if name != AUTH_METADATA]
        metadata_bytes = encode_pairs(sent)
        if len(metadata_bytes) > MAX_TEXT:
            return 0
        head = (FLAG_DURABLE if durable else 0, lease or 0.0, ttl or 0.0)
        done = 0
        while done < len(pairs):
            largest = len(pairs[done][1])
            placed = (self._file_from is None and largest > STAGING_BYTES) or 0 < (self._file_from or 0) <= largest
            if largest > MAX_VALUE_BYTES and not placed:
                return done
            session = self._take(STAGING_BYTES if placed else _staging_size(largest), timeout)
            if session is None:
                return done
            self._file_from = session.file_from
            placed = 0 < session.file_from <= largest
            if not placed and largest > session.size:
                self._give(session, broken=False)  # this server places nothing this large: a larger area
                continue
            try:
                if placed:
                    written = self._commit_placed(session, pairs, done, head, metadata_bytes, timeout)
                else:
                    written = self._commit(session, pairs, done, head, metadata_bytes, timeout)
            except CacheClientError as exc:  # answered (the session goes on), or no answer in time (it does not)
                self._give(session, broken=isinstance(exc, DeadlineError))
                raise
            except BaseException:
                self._give(session, broken=True)
                raise
            self._give(session, broken=written < 0)
            if written < 0:
                return done
            done += written
        return len(pairs)

    def _commit(
        self,
        session: _Session,
        pairs: Sequence[tuple[bytes, PutValue]],
        start: int,
        head: tuple[int, float, float],
        metadata: bytes,
        timeout: float,
    ) -> int:
        """Copies pairs from `start` into the session's area while they fit, and commits them; how many (-1: the
        session broke)."""
        area = session.area
        items: list[tuple[bytes, int, int, int]] = []
        offset = 0
        for key, value in pairs[start:]:
            size = len(value)
            if offset + size > session.size or len(items) == MAX_BATCH_KEYS or 0 < session.file_from <= size:
                break
            if isinstance(value, Gathered):
                value_sum = _write_pieces(area, offset, value)
            else:
                area[offset : offset + size] = value
                value_sum = xxhash.xxh3_64_intdigest(value)
            items.append((key, offset, size, value_sum))
            offset = (offset + size + _ALIGN - 1) // _ALIGN * _ALIGN
        return self._answered(len(items), timeout, lambda: session.commit(items, head, metadata, timeout))

    def _answered(self, count: int, timeout: float, send: Callable[[], tuple[int, str, list[tuple[str, str]]]]) -> int:
        """`count`, once `send` (a session's request for that many values) was answered done; -1 when the
        session broke.

        Raises:
            DeadlineError: no answer within `timeout`.
            CacheClientError: the server refused the request, as PutMany would have.
        """
        try:
            status, message, trailing = send()
        except TimeoutError:
            raise DeadlineError(
                f"{self.address}: DEADLINE_EXCEEDED: a co-located put of {count} values took over {timeout:g} s"
            ) from None
        except OSError as exc:
            log.info("a co-located write session to %s broke (%s); writing over gRPC", self.address, exc)
            return -1
        if status:
            raise from_status(_CODES.get(status), message, trailing, self.address)
        return count

    def _commit_placed(
        self,
        session: _Session,
        pairs: Sequence[tuple[bytes, PutValue]],
        start: int,
        head: tuple[int, float, float],
        metadata: bytes,
        timeout: float,
    ) -> int:
        """Writes the large values from `start` (up to `MAX_PLACES`) into places and commits them; how many
        (-1: the session broke)."""
        large: list[tuple[bytes, memoryview | Gathered]] = []
        for key, value in pairs[start : start + MAX_PLACES]:
            if len(value) < session.file_from:
                break
            large.append((key, value if isinstance(value, Gathered) else memoryview(value).cast("B")))

        def send() -> tuple[int, str, list[tuple[str, str]]]:
            placed = session.place([value for _, value in large], timeout, self.address)
            items = [
                (key, place, len(value), checksum)
                for (key, value), (place, checksum) in zip(large, placed, strict=True)
            ]
            return session.commit(items, (head[0] | FLAG_PLACED, *head[1:]), metadata, timeout)

        return self._answered(len(large), timeout, send)

    def _take(self, size: int, timeout: float) -> _Session | None:
        """A free session whose area holds `size` bytes (a new one when none does); None when none can be
        opened (the caller writes over gRPC)."""
        with self._changed:
            while True:
                if self._closed:
                    return None
                for i, session in enumerate(self._free):
                    if session.size >= size:
                        return self._free.pop(i)
                if self._free and self._bytes + size > MAX_STAGING_BYTES:
                    # Room for a larger one: the smallest free one goes.
                    small = min(self._free, key=lambda s: s.size)
                    self._free.remove(small)
                    self._drop(small)
                    continue
                if self._open < MAX_SESSIONS and self._bytes + size <= MAX_STAGING_BYTES:
                    self._open += 1
                    self._bytes += size
                    break
                if not self._changed.wait(timeout):
                    return None
        try:
            return _Session(self.path, self._token, size, timeout)
        except (OSError, CacheClientError) as exc:
            log.info("co-located writes to %s go over gRPC: %s", self.address, exc)
            with self._changed:
                self._open -= 1
                self._bytes -= size
                self._changed.notify()
            return None

    def _give(self, session: _Session, *, broken: bool) -> None:
        with self._changed:
            if broken or self._closed:
                self._drop(session)
            else:
                self._free.append(session)
            self._changed.notify()

    def _drop(self, session: _Session) -> None:
        self._open -= 1
        self._bytes -= session.size
        session.close()

    def _forked(self) -> None:
        """In a forked child: the parent's sessions are the parent's (their sockets are shared)."""
        self._pid = os.getpid()
        self._free = []
        self._open = self._bytes = 0
        self._changed = threading.Condition()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            while self._free:
                self._drop(self._free.pop())
            self._changed.notify_all()


def _write_place(fd: int, value: memoryview | Gathered) -> int:
    """Writes `value` through `fd` a piece at a time, hashing each piece as it is written; the value's checksum."""
    hashed = xxhash.xxh3_64()
    done = 0
    for whole in value.pieces if isinstance(value, Gathered) else (value,):
        at = 0
        while at < len(whole):
            piece = whole[at : at + _PIECE]
            written = 0
            while written < len(piece):
                written += os.pwrite(fd, piece[written:], done + written)
            hashed.update(piece)  # the bytes just written, still in the cache
            done += len(piece)
            at += len(piece)
    return hashed.intdigest()


def _write_pieces(area: mmap.mmap, offset: int, value: Gathered) -> int:
    """Copies `value`'s pieces into `area` from `offset`, hashing each where it landed; the value's checksum."""
    hashed = xxhash.xxh3_64()
    with memoryview(area) as out:
        for piece in value.pieces:
            end = offset + len(piece)
            landed = out[offset:end]
            landed[:] = piece
            hashed.update(landed)  # the bytes as written, still in the cache
            landed.release()
            offset = end
    return hashed.intdigest()


def _staging_size(value_bytes: int) -> int:
    return max(STAGING_BYTES, 1 << max(0, value_bytes - 1).bit_length())


def _line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n") and len(line) < 4096:
        chunk = sock.recv(4096 - len(line))
        if not chunk:
            break
        line += chunk
    return line
