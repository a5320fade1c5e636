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

Large values are not copied at all: a session hands out places, new files in
L2's `incoming/` directory (`LMDBTier.incoming`), whose descriptors the
client writes through; a commit of a place maps the file once no descriptor
of it is open for writing (`PlacedFile.open`), and the engine checks and
indexes it where it lies. A place not committed by the end of its session is
deleted (and one a kill left, at the tier's next open).
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
from pathlib import Path

import grpc

from cacheclient.wire.limits import MAX_BATCH_KEYS, MAX_KEY_BYTES
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
from cachesvc.errors import CacheError, InvalidKey, LimitReached, NotOwner
from cachesvc.server.status import status_of
from cachesvc.tiers.base import PlacedFile, WriterStillOpen

__all__ = ["MAX_SESSIONS", "StagingSessions", "Writer"]

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
"""Staging sessions open at once (each holds a thread and a mapping); more are refused."""
MAX_REQUEST_BYTES = 1 << 30
"""The most value bytes one request copies out of a staging area (the client's areas are smaller)."""
TIMEOUT = 5.0
"""Seconds the rest of a request may take to arrive once its first bytes have."""

Writer = Callable[
    [dict[str, str], Sequence[tuple[bytes, bytes | PlacedFile, int]], float | None, float | None, bool], None
]
"""Writes (key, value, checksum) items as a PutMany with this metadata, lease, TTL and durability would;
raises `CacheError` as that call would fail."""


class _Refused(Exception):
    """A request that breaks the framing: answered, and the session ends."""


class StagingSessions:
    """The open staging sessions of one server (see the module docstring).

    Args:
        writer: what commits a request's values (the servicer's `put_staged`).
        check_size: raises `CacheError` for a value size the server refuses (asked before any copy).
        places: where large values' files are made (L2's `incoming/`); None: no places (no L2).
        file_from: the size from which a value is a file of its own in L2 (told to clients); 0: none.
    """

    def __init__(
        self,
        writer: Writer,
        check_size: Callable[[int], None],
        *,
        places: Path | None = None,
        file_from: int = 0,
    ) -> None:
        self._writer = writer
        self._check_size = check_size
        self._places = places if file_from else None
        self.file_from = file_from if places is not None else 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._places_open = 0
        """Places handed out and not yet committed or dropped, in every session."""
        self.counters: Counter[str] = Counter()
        """staging_sessions (opened), staging_puts, staging_put_bytes, staging_refused."""

    def writing(self) -> bool:
        """Whether a co-located client holds places it is writing into (a save under way)."""
        return self._places_open > 0

    def _opened_places(self, count: int) -> None:
        with self._lock:
            self._places_open += count

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
        conn.sendall(f"OK file_from={self.file_from}\n".encode())
        threading.Thread(target=self._serve, args=(conn, area), name="staging", daemon=True).start()
        return ""

    def close(self) -> None:
        """Ends every session (their threads see the connection shut)."""
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _serve(self, conn: socket.socket, area: mmap.mmap) -> None:
        places: dict[int, Path] = {}
        try:
            with conn:
                while self._one(conn, area, places):
                    pass
        except OSError as exc:
            log.debug("a staging session ended: %s", exc)
        finally:
            with self._lock:
                self._open.discard(conn)
            area.close()
            self._opened_places(-len(places))
            for path in places.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _one(self, conn: socket.socket, area: mmap.mmap, places: dict[int, Path]) -> bool:
        """Answers one request; False when the session is over."""
        conn.settimeout(None)  # a session may sit idle between writes
        first = conn.recv(len(MAGIC))
        if not first:
            return False
        conn.settimeout(TIMEOUT)
        first += recv_exactly(conn, len(MAGIC) - len(first))
        if first == PLACE_MAGIC:
            return self._place(conn, first + recv_exactly(conn, PLACE.size - len(first)), places)
        try:
            metadata, wanted, lease, ttl, flags = self._read(conn, first, len(area))
        except _Refused as exc:
            self.counters["staging_refused"] += 1
            _answer(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return False
        durable = bool(flags & FLAG_DURABLE)
        placed = bool(flags & FLAG_PLACED)
        taken: list[Path] = []
        try:
            total = 0
            for _, _, length, _ in wanted:
                self._check_size(length)  # before a byte is copied
                total += length
            items: list[tuple[bytes, bytes | PlacedFile, int]]
            if placed:
                items = [
                    (key, self._placed(places, taken, place, length), checksum)
                    for key, place, length, checksum in wanted
                ]
            else:
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
        finally:
            for path in taken:  # what the tier did not take (written elsewhere, or refused) goes
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if placed:
            self.counters["staging_placed_puts"] += len(items)
        self.counters["staging_puts"] += len(items)
        self.counters["staging_put_bytes"] += total
        _answer(conn, grpc.StatusCode.OK, "")
        return True

    def _place(self, conn: socket.socket, request: bytes, places: dict[int, Path]) -> bool:
        """Answers a request for places: new files in L2's `incoming/`, their descriptors sent with the answer;
        False when the request breaks the framing (answered, and the session ends)."""
        _, count = PLACE.unpack(request)
        if not 0 < count <= MAX_PLACES:
            self.counters["staging_refused"] += 1
            _answer(conn, grpc.StatusCode.INVALID_ARGUMENT, f"{count} places asked for: from 1 to {MAX_PLACES}")
            return False
        sizes = [size for (size,) in PLACE_SIZE.iter_unpack(recv_exactly(conn, count * PLACE_SIZE.size))]
        try:
            if self._places is None:
                raise InvalidKey("this server has no local disk tier to place large values in")
            for size in sizes:
                self._check_size(size)
            if len(places) + count > MAX_PLACES:
                raise LimitReached(f"{MAX_PLACES} places may be uncommitted in a session; commit them first")
        except CacheError as exc:
            _answer(conn, status_of(exc), str(exc))
            return True
        made: list[int] = []
        fds: list[int] = []
        try:
            for _ in sizes:
                place = int.from_bytes(os.urandom(8), "little")
                path = self._places / f"place-{place:016x}"
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                places[place] = path
                self._opened_places(1)
                made.append(place)
            text = " ".join(map(str, made)).encode()
            socket.send_fds(conn, [ANSWER.pack(grpc.StatusCode.OK.value[0], len(text), 0) + text], fds)
        finally:
            for fd in fds:
                os.close(fd)  # the client's copies are the only ones open for writing from here
        self.counters["staging_places"] += count
        return True

    def _placed(self, places: dict[int, Path], taken: list[Path], place: int, length: int) -> PlacedFile:
        """The file of `place`, mapped once no descriptor of it is open for writing (and checked for `length`)."""
        path = places.pop(place, None)
        if path is None:
            raise InvalidKey(f"place {place} was not handed out in this session, or is committed already")
        self._opened_places(-1)
        taken.append(path)
        try:
            placed = PlacedFile.open(path)
        except WriterStillOpen:
            raise InvalidKey(f"place {place} is still open for writing: close it before the commit") from None
        except OSError as exc:
            raise InvalidKey(f"place {place}: {exc}") from None
        if len(placed) != length:
            size = len(placed)
            placed.close()
            raise InvalidKey(f"place {place} holds {size} bytes, the commit says {length}")
        return placed

    def _read(
        self, conn: socket.socket, first: bytes, size: int
    ) -> tuple[dict[str, str], list[tuple[bytes, int, int, int]], float | None, float | None, int]:
        """A request's metadata, (key, offset or place, length, checksum) per value, lease, TTL and flags."""
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
            if not flags & FLAG_PLACED and offset + length > size:
                raise _Refused(f"value of key {key[:64]!r} at {offset}+{length} lies outside the {size}-byte area")
            wanted.append((key, offset, length, checksum))
        return metadata, wanted, lease or None, ttl or None, flags


def _answer(conn: socket.socket, code: grpc.StatusCode, message: str, trailing: Sequence[tuple[str, str]] = ()) -> None:
    text = message.encode()
    pairs = encode_pairs(list(trailing))
    conn.sendall(ANSWER.pack(code.value[0], len(text), len(pairs)) + text + pairs)
