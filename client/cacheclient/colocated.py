"""Reads from a co-located server's shared L1 without a round trip: `SharedL1`, and `Colocated`, the transport.

A server whose L1 is shared (`l1.shared = true`; `cachesvc up` sets it) says
in Info where its arena socket is. A client on the same machine (the same
boot id) asks that socket for the arena with its token, maps it read-only
and reads published values straight from it (`cacheclient.wire.arena`: a
lock-free probe, a seqlock, the checksum). Whatever the arena cannot answer
(a miss there, a value the server has not published, a race lost) goes
to the server over gRPC as before, and the server's answer publishes the
value for the next read. A read with `release` that the arena answered ends
its leases with one small call (no bytes). Writes go through the server's
staging sessions (`cacheclient.staged`: the bytes are written once, into
shared memory of this process's, and committed with a small call; a
tenant's token writes over gRPC); every other call goes over gRPC unchanged.
A tenant's token is handed its own tenant's arena only (its other reads go
over gRPC, where they are refused).

`Colocated` finds out at its first read (one Info call, in the background:
that read and those until the arena is mapped go over gRPC) and again at
most every `RETRY_SECONDS` after a failure or a server restart (the old arena
reads as closed); `colocated=False` on `CacheClient` turns it off, `True` makes a
client fail at once when it cannot map the arena. A forked child keeps its
parent's mapping (shared memory survives fork); each process counts its own
reads (`counts`). A fork waits for a mapping under way
(`cacheclient.process_local.background_call`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cacheclient._batches import PutValue
from cacheclient._batches import view as value_view
from cacheclient.errors import CacheClientError, InvalidRequestError, UnavailableError
from cacheclient.node import NodeClient
from cacheclient.process_local import background_call
from cacheclient.staged import StagedWriter
from cacheclient.transport import OneNode, Transport
from cacheclient.wire import boot_id
from cacheclient.wire.arena import ASK, MAX_TENANT_SEGMENTS, ArenaView

__all__ = ["LIVENESS_SECONDS", "RETRY_SECONDS", "Colocated", "NodeArena", "SharedL1", "lent_values"]

log = logging.getLogger(__name__)

LIVENESS_SECONDS = 0.005
"""How long a client trusts that the server it maps the arena of is alive before it checks again."""
RETRY_SECONDS = 5.0
"""How long a client that could not map a server's arena (or saw it closed) goes over gRPC before it asks again."""
INFO_SECONDS = 5.0
"""The deadline of the Info call that finds a server's arena."""
_MAX_ANSWER = 1 << 16
"""The arena socket's answer, at most (a line per handshake: one word per tenant segment)."""


class SharedL1:
    """A co-located server's L1 arena, mapped read-only (its hit counters writable).

    On a cluster node with tenants, the arena is in segments (`cacheclient.wire.arena`): a tenant's token maps
    its own tenant's segment only; the data token every segment, each key read from its tenant's.

    Args:
        path: the server's arena socket (Info's `arena_socket`).
        token: the data token (or a tenant's), when the server has one.
        timeout: seconds the exchange on the socket may take.

    Raises:
        CacheClientError: the socket refused (wrong token, another user) or did not answer.
    """

    def __init__(self, path: str, token: str | None = None, timeout: float = 2.0) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(path)
                sock.sendall(b"ARENA1 " + (token or "").encode() + b"\n")
                message, fds, _flags, _address = socket.recv_fds(sock, _MAX_ANSWER, 2 * (MAX_TENANT_SEGMENTS + 1))
            except OSError as exc:
                raise CacheClientError(f"the shared L1 at {path}: {exc}") from exc
        maps: list[mmap.mmap] = []
        try:
            words = message.split()
            segments = [word[4:].split(b":") for word in words[4:] if word.startswith(b"seg=")]
            if not message.startswith(b"OK ") or len(fds) != 2 * (1 + len(segments)):
                raise CacheClientError(f"the shared L1 at {path} refused: {message.decode(errors='replace').strip()}")
            arena_bytes, hits_bytes, self.boot = (int(x) for x in words[1:4])
            self.writes = b"stage=0" not in words[4:]
            """Whether this token may write through the server's staging sessions (a tenant's may not)."""
            sizes = [(arena_bytes, hits_bytes), *((int(seg[0]), int(seg[1])) for seg in segments)]
            for i, (arena_size, hits_size) in enumerate(sizes):
                maps.append(mmap.mmap(fds[2 * i], arena_size, prot=mmap.PROT_READ))
                maps.append(mmap.mmap(fds[2 * i + 1], hits_size))
            self.view = ArenaView(memoryview(maps[0]), memoryview(maps[1]))
            extra = [
                (bytes.fromhex(prefix.decode()), ArenaView(memoryview(maps[2 * i]), memoryview(maps[2 * i + 1])))
                for i, seg in enumerate(segments, start=1)
                for prefix in seg[3].split(b",")
                if prefix
            ]
        except BaseException:
            for fd in fds:
                os.close(fd)
            for mapped in maps:
                mapped.close()
            raise
        self._fd = fds[0]  # kept: its lock says whether the server lives
        for fd in fds[1:]:
            os.close(fd)
        self._maps = maps
        self._extra = tuple(sorted(extra, key=lambda e: -len(e[0])))
        """(prefix, its tenant's segment), longest first: the data token's view of every tenant's arena."""
        self._generation = self.view.segments
        self.path = path
        self._alive_until = 0.0
        self._dead = False

    def _view(self, key: bytes) -> ArenaView:
        """The segment that holds `key` if any does: its tenant's, else the first one handed."""
        for prefix, view in self._extra:
            if key.startswith(prefix):
                return view
        return self.view

    @property
    def open(self) -> bool:
        """Whether the arena may be read: the server neither stopped (the arena marked closed) nor died, and its
        tenants' segments are those mapped."""
        return not self._dead and self.view.open and self.view.segments == self._generation and self._alive()

    @property
    def regrouped(self) -> bool:
        """Whether the server's tenants' segments changed since this was mapped (the server goes on): map again
        now, to read them."""
        return not self._dead and self.view.segments != self._generation

    def _alive(self) -> bool:
        """Whether the server still holds its lock on the arena; asked at most every `LIVENESS_SECONDS` (a
        server killed, restarted and written to takes far longer than that)."""
        now = time.monotonic()
        if now < self._alive_until:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._alive_until = now + LIVENESS_SECONDS
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._dead = True
        log.info("the server of the shared L1 at %s is gone; reading over gRPC", self.path)
        return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._dead = True

    def _gone(self) -> bool:
        """Whether the server is gone (or stopped): nothing here may be read."""
        return self._dead or (time.monotonic() >= self._alive_until and not self._alive())

    def get(self, key: bytes, verify: bool = True) -> bytes | object:
        """`key`'s value, or `cacheclient.wire.arena.ASK`: ask the server (also once it is gone)."""
        if self._gone():
            return ASK
        return self._view(key).get(key, verify)

    def get_answered(self, key: bytes, checksum: int) -> bytes | None:
        """`ArenaView.get_answered`: the value a Get just answered with `checksum`, when the arena holds it;
        None: take it from the server."""
        if self._gone():
            return None
        value = self._view(key).get_answered(key, checksum)
        return value if isinstance(value, bytes) else None

    def lend(self, key: bytes) -> tuple[memoryview, Callable[[], bool]] | object:
        """`ArenaView.lend`: a view of `key`'s value in the arena and the check to call after copying from it,
        or `ASK`."""
        if self._gone():
            return ASK
        return self._view(key).lend(key)


class NodeArena:
    """One server's shared L1 as this process sees it: mapped at first use when the server runs on this
    machine and shares it, mapped again after a restart, asked about again at most every `RETRY_SECONDS`.

    Args:
        node: the server.
        required: raise (at the first read) rather than read over gRPC when the arena cannot be mapped.
    """

    def __init__(self, node: NodeClient, *, required: bool = False) -> None:
        self._node = node
        self._required = required
        self._l1: SharedL1 | None = None
        self._writer: StagedWriter | None = None
        self._retry_at = 0.0
        self._mapping = False
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled client (a DataLoader worker's) maps the arena again where it is unpickled.
        return {"_node": self._node, "_required": self._required}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_node"], required=state["_required"])  # type: ignore[misc]

    def get(self, wait: bool = False) -> SharedL1 | None:
        """The mapped arena; None while reads go over gRPC.

        When it is due, the arena is mapped in the background (asking the
        server costs a call, and a hung server must not hold a read up):
        reads go over gRPC until it is. With `wait` (or `required`), mapped
        now, in this thread. A server whose tenants' segments changed is
        mapped again at once (`SharedL1.regrouped`).
        """
        l1 = self._l1
        if l1 is not None and l1.open:
            return l1
        if self._pid != os.getpid():
            self._forked()
        if time.monotonic() < self._retry_at and not (l1 is not None and l1.regrouped):
            return None
        with self._lock:
            if self._l1 is not None and self._l1.open:
                return self._l1
            if self._l1 is not None:
                self._l1.close()
                self._l1 = None
            if self._mapping:
                return None
            self._retry_at = time.monotonic() + RETRY_SECONDS
            if not (wait or self._required):
                self._mapping = True
                threading.Thread(target=self._map_in_background, name="cacheclient-arena", daemon=True).start()
                return None
        self._map_now()
        return self._l1

    def _forked(self) -> None:
        """In a child forked while the parent was mapping the arena: that thread is not here, so this process
        maps it itself (the lock may have been held at the fork, too)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._mapping = False
        self._retry_at = 0.0

    def close(self) -> None:
        """Lets go of the mapping and the write sessions (mapped again if used again)."""
        with self._lock:
            l1, self._l1 = self._l1, None
            writer, self._writer = self._writer, None
            self._retry_at = 0.0
        if writer is not None:
            writer.close()
        if l1 is not None:
            l1.close()

    def writer(self) -> StagedWriter | None:
        """This process's writer to the server's staging sessions (`cacheclient.staged`) while its arena is
        mapped; None while writes go over gRPC."""
        l1 = self.get()
        if l1 is None or not l1.writes:  # a tenant's token writes over gRPC
            return None
        with self._lock:
            writer = self._writer
            if writer is None or writer.path != l1.path:  # a restarted server's socket
                if writer is not None:
                    writer.close()
                writer = self._writer = StagedWriter(l1.path, self._node.address, self._node.token)
            return writer

    def put_many(
        self,
        node: NodeClient,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        durable: bool,
        timeout: float | None,
    ) -> int:
        """Writes `pairs` through this server's staging sessions while they take them, the rest over gRPC
        through `node` (this server's client, carrying the call's metadata); returns how many were staged."""
        writer = self.writer()
        done = 0
        if writer is not None:
            try:
                done = writer.put_many(
                    pairs,
                    lease=lease,
                    ttl=ttl,
                    durable=durable,
                    metadata=node.metadata,
                    timeout=node.timeout if timeout is None else timeout,
                )
            except UnavailableError as exc:
                # A cluster node in doubt of its lease refuses staged writes (a partition does not cut them):
                # all of them go over gRPC, which a partition cuts and routing by the shard's map redirects.
                log.info("writing to %s over gRPC: %s", node.address, exc)
                done = 0
        if done < len(pairs):
            node.put_many(pairs[done:], lease=lease, ttl=ttl, timeout=timeout, durable=durable)
        return done

    def _map_in_background(self) -> None:
        with background_call():  # a fork waits for it
            self._map_now()

    def _map_now(self) -> None:
        try:
            l1 = self._map()
        except CacheClientError as exc:
            if self._required:
                raise
            log.info("reading %s over gRPC: %s", self._node.address, exc)
            l1 = None
        finally:
            self._mapping = False
        self._l1 = l1

    def _map(self) -> SharedL1 | None:
        try:
            info = self._node.info(timeout=min(self._node.timeout, INFO_SECONDS))
        except ValueError as exc:  # grpc's "closed channel": the client was closed while this was due
            raise UnavailableError(f"{self._node.address}: the client is closed") from exc
        if info["boot_id"] != boot_id() or info["hostname"] != socket.gethostname():
            if self._required:
                raise InvalidRequestError(f"colocated=True: {self._node.address} runs on another machine")
            self._retry_at = float("inf")  # it will not move here
            return None
        if not info["arena_socket"]:
            if self._required:
                raise InvalidRequestError(f"colocated=True: {self._node.address} does not share its L1 (l1.shared)")
            return None
        return SharedL1(info["arena_socket"], self._node.token)


class Colocated(OneNode):
    """`OneNode` whose reads try the server's shared L1 first (see the module docstring).

    Args:
        node: the server.
        required: fail (at the first read) rather than read over gRPC when the arena cannot be mapped.
    """

    def __init__(self, node: NodeClient, *, required: bool = False, arena: NodeArena | None = None) -> None:
        super().__init__(node)
        self._required = required
        self._arena = arena if arena is not None else NodeArena(node, required=required)
        self.counts: Counter[str] = Counter()
        """This process's calls: "arena" (reads answered from the shared L1), "asked" (reads sent to the
        server), "staged" (values written through the staging area), "lent_lost" (values copied out of the
        arena that the server changed meanwhile, read again)."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["counts"] = Counter()  # the unpickled client counts its own reads
        return state

    def with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> OneNode:
        return Colocated(self._node.with_metadata(metadata), required=self._required, arena=self._arena)

    def close(self) -> None:
        self._arena.close()
        super().close()

    def shared_l1(self, wait: bool = False) -> SharedL1 | None:
        """The mapped arena; None while reads go over gRPC (`NodeArena.get`: `wait` maps it now when due)."""
        return self._arena.get(wait)

    def get(self, key: bytes, *, release: bool, timeout: float | None) -> bytes | None:
        l1 = self.shared_l1()
        if l1 is not None:
            value = l1.get(key)
            if isinstance(value, bytes):
                self.counts["arena"] += 1
                if release:
                    self._node.release([key], timeout=timeout)
                return value
        self.counts["asked"] += 1
        if l1 is None:
            return self._node.get(key, release=release, timeout=timeout)
        return self._node.get(key, release=release, timeout=timeout, shared=lambda k, c: self._answered(l1, k, c))

    def _answered(self, l1: SharedL1, key: bytes, checksum: int) -> bytes | None:
        """A value too large for the Get's (or GetMany's) answer, copied from the arena when the read published
        it there (a cold read of a large value: one copy, not a stream through two gRPC ends); None: stream it."""
        value = l1.get_answered(key, checksum)
        if value is not None:
            self.counts["arena_after_get"] += 1
        return value

    def get_many(self, keys: Sequence[bytes], *, release: bool, timeout: float | None) -> list[bytes | None]:
        l1 = self.shared_l1()
        if l1 is None:
            self.counts["asked"] += len(keys)
            return self._node.get_many(keys, release=release, timeout=timeout)
        values: list[bytes | None] = [None] * len(keys)
        missing: list[int] = []
        for i, key in enumerate(keys):
            value = l1.get(key)
            if isinstance(value, bytes):
                values[i] = value
            else:
                missing.append(i)
        self._served(keys, missing, release, timeout)
        if missing:
            fetched = self._node.get_many(
                [keys[i] for i in missing],
                release=release,
                timeout=timeout,
                shared=lambda k, c: self._answered(l1, k, c),
            )
            for i, value in zip(missing, fetched, strict=True):
                values[i] = value
        return values

    def iter_pieces(
        self, keys: Sequence[bytes], *, release: bool, timeout: float | None, verify: bool
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        l1 = self.shared_l1()
        if l1 is None:
            self.counts["asked"] += len(keys)
            yield from self._node.iter_pieces(keys, release=release, timeout=timeout, verify=verify)
            return
        found = [l1.get(key, verify) for key in keys]
        missing = [i for i, value in enumerate(found) if not isinstance(value, bytes)]
        self._served(keys, missing, release, timeout)
        rest = (
            self._node.iter_pieces([keys[i] for i in missing], release=release, timeout=timeout, verify=verify)
            if missing
            else None
        )
        for key, value in zip(keys, found, strict=True):
            if isinstance(value, bytes):
                yield key, [memoryview(value)]
            else:
                assert rest is not None
                yield next(rest)

    def put_many(
        self,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        timeout: float | None,
        durable: bool,
    ) -> None:
        staged = self._arena.put_many(self._node, pairs, lease=lease, ttl=ttl, durable=durable, timeout=timeout)
        if staged:
            self.counts["staged"] += staged

    def iter_lent(
        self, keys: Sequence[bytes], *, release: bool, timeout: float | None
    ) -> Iterator[tuple[bytes, memoryview | None, Callable[[], bool] | None]]:
        """(key, its value's bytes or None, check), in order, for a caller that copies each value once and
        verifies what it copied itself (KV blocks).

        From the arena while it answers, as views of the arena (`SharedL1.lend`): the caller copies out of
        the view, then calls `check`, and reads the key again (`get`) when it answers False (the server
        reused the bytes meanwhile). From the first key the arena cannot answer on, over gRPC, in one
        stream, unverified, with `check` None.
        """
        l1 = self.shared_l1()
        lent: list[tuple[memoryview, Callable[[], bool]]] = []
        if l1 is not None:
            for key in keys:
                got = l1.lend(key)
                if not isinstance(got, tuple):
                    break
                lent.append(got)
        if lent:
            self._served(keys[: len(lent)], [], release, timeout)
        for key, (view, check) in zip(keys, lent, strict=False):
            yield key, view, self._counted(check)
        rest = keys[len(lent) :]
        if rest:
            self.counts["asked"] += len(rest)
            for key, pieces in self._node.iter_pieces(rest, release=release, timeout=timeout, verify=False):
                yield key, None if pieces is None else value_view(pieces), None

    def _counted(self, check: Callable[[], bool]) -> Callable[[], bool]:
        """`check`, counting a lost race in "lent_lost"."""

        def counted() -> bool:
            held = check()
            if not held:
                self.counts["lent_lost"] += 1
            return held

        return counted

    def _served(self, keys: Sequence[bytes], missing: list[int], release: bool, timeout: float | None) -> None:
        """Counts a batch's reads; with `release`, ends the leases of those the arena answered (one small call:
        the bytes were read here)."""
        self.counts["arena"] += len(keys) - len(missing)
        self.counts["asked"] += len(missing)
        if release and len(missing) < len(keys):
            skip = set(missing)
            self._node.release([key for i, key in enumerate(keys) if i not in skip], timeout=timeout)


def lent_values(
    transport: Transport, keys: Sequence[bytes], *, release: bool, verify: bool
) -> Iterator[tuple[bytes, memoryview | None, Callable[[], bool] | None]]:
    """(key, its value's bytes or None, check) in order, for a caller that copies each value out once: from a
    co-located server's arena where it can, when the caller verifies what it copies itself (`verify` False;
    `Colocated.iter_lent`: call `check` after the copy, read the key again when it answers False); else over
    the transport's stream, `check` None."""
    if not verify and isinstance(transport, Colocated):
        return transport.iter_lent(keys, release=release, timeout=None)
    return (
        (key, None if pieces is None else value_view(pieces), None)
        for key, pieces in transport.iter_pieces(keys, release=release, timeout=None, verify=verify)
    )
