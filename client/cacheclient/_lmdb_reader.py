"""Read-only access to a co-located cache server's L2 (its LMDB environment).

When a client runs on the machine its cache server runs on, values resident in
the server's L2 can be read straight from the LMDB file: no gRPC round trip, no
copy through a socket. LMDB allows many reader processes beside one writer, so
this never blocks the server.

The record format is the wire contract's (`cacheclient.wire.record`), the
same code the server writes with: a value's own record, or a locator of its
record in the pack of small values, read in the same snapshot. Every value
is verified against its xxh3-64 checksum; a record that fails (or that is
not a record this version understands) reads as a miss, so the caller asks
the server, which verifies it again and drops the bad copy. A record whose wall-clock expiry has passed also
reads as a miss: the server would not return it either. So does a value the
server marked as one it would check against its source before serving it
(read back after a restart, cached before its slot moved away and back,
or held through a lost lease: `unvouched_key`), and every value while the
server doubts its lease (`IN_DOUBT_KEY`): the server answers those. Nor is
anything read while no server holds its lock on the directory
(`SERVING_LOCK`, looked at most every `SERVER_CHECK_SECONDS`): a killed
node's file keeps copies that other nodes may have superseded since (the
caller asks the cluster, which routes around it).

Fork safety: the environments are a `ProcessLocal`, opened lazily in each
process. LMDB forbids using a handle across `fork`, and py-lmdb refuses to
open an environment a second time in a process, a forked child included
(its registry of open files is inherited), so a child whose parent had the
L2 open could never open its own. The parent therefore closes its handles
just before a fork, once no read of its threads is in flight (they reopen
on the next read), and the child opens its own on first use.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import lmdb

from cacheclient.errors import CacheClientError
from cacheclient.process_local import ProcessLocal
from cacheclient.wire import boot_id
from cacheclient.wire.record import (
    IN_DOUBT_KEY,
    SERVING_LOCK,
    FileRef,
    file_ref,
    is_file_ref,
    open_stored,
    read_file_value,
    storage_key,
    unvouched_key,
)

__all__ = ["L2Reader", "colocated_reader"]

log = logging.getLogger(__name__)


class _Informs(Protocol):
    def info(self, *, timeout: float | None = None) -> dict[str, Any]: ...


SERVER_CHECK_SECONDS = 0.005
"""How long a reader trusts that the server still holds its lock on the directory before it looks again."""
FORK_WAIT_SECONDS = 2.0
"""Longest a fork waits for this process's reads in flight before closing its handles (past it, the
child cannot open the L2 and its reads go over gRPC)."""


class _Environments:
    """This process's read-only LMDB handles by directory.

    One per directory per process: LMDB (and py-lmdb) refuse a second open of
    the same environment in one process. Reads count themselves in
    (`reading`) so that `close_before_fork` closes no handle under one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_path: dict[str, Any] = {}
        self._reads = 0
        self._idle = threading.Condition(self.lock)

    def _open(self, path: str, map_size: int, max_readers: int) -> Any:
        env = self.by_path.get(path)
        if env is None:
            kwargs: dict[str, Any] = {"map_size": map_size} if map_size else {}
            env = lmdb.open(
                path,
                readonly=True,
                lock=True,
                subdir=True,
                create=False,
                readahead=False,
                max_readers=max_readers,
                max_dbs=0,
                **kwargs,
            )
            self.by_path[path] = env
        return env

    @contextmanager
    def reading(self, path: str, map_size: int, max_readers: int) -> Iterator[Any]:
        """A read transaction (buffers) on the environment at `path`, opened if this process has none."""
        with self.lock:
            env = self._open(path, map_size, max_readers)
            self._reads += 1
        try:
            with env.begin(buffers=True) as txn:
                yield txn
        finally:
            with self.lock:
                self._reads -= 1
                if not self._reads:
                    self._idle.notify_all()

    def close_before_fork(self) -> None:
        """Closes every handle once no read is in flight, and keeps new reads out until `after_fork`."""
        self.lock.acquire()
        if not self._idle.wait_for(lambda: not self._reads, timeout=FORK_WAIT_SECONDS):
            log.warning("a fork did not close this process's co-located L2 handles: reads still in flight")
            return
        for env in self.by_path.values():
            env.close()
        self.by_path.clear()

    def after_fork(self) -> None:
        self.lock.release()


# Kept open for the life of the process (readers are cheap; reopening is not).
_environments = ProcessLocal(_Environments)


def _close_before_fork() -> None:
    environments = _environments.peek()
    if environments is not None:
        environments.close_before_fork()


def _after_fork_in_parent() -> None:
    environments = _environments.peek()
    if environments is not None:
        environments.after_fork()


# The child forgets its parent's `_Environments` (`ProcessLocal`), the lock held here included.
os.register_at_fork(before=_close_before_fork, after_in_parent=_after_fork_in_parent)


class L2Reader:
    """Reads values from a cache server's LMDB directory, read-only.

    Readers of one directory in one process share one LMDB handle, opened on
    first use and kept for the life of the process.

    Args:
        path: the server's L2 directory (`CacheClient.info()["l2_path"]`).
        map_size: the server's map size (`info()["l2_map_size"]`); 0 lets
            LMDB take it from the file.
        max_readers: reader slots; only used if this process creates the
            lock file, which the server normally has done already.
    """

    def __init__(self, path: str, map_size: int = 0, max_readers: int = 256) -> None:
        self.path = str(path)
        self.map_size = map_size
        self.max_readers = max_readers
        self.corrupt = 0
        """Records that failed verification (read as misses)."""
        self.expired = 0
        """Records found past their expiry (read as misses)."""
        self.unvouched = 0
        """Records the server marked to check before serving (read as misses)."""
        self.in_doubt = 0
        """Reads made while the server doubted its lease (all misses)."""
        self.server_gone = 0
        """Reads made while no server held the directory's lock (all misses)."""
        self._serving_until = 0.0

    def _snapshot(self) -> Any:
        return _environments.get().reading(self.path, self.map_size, self.max_readers)

    def get_many(self, keys: Sequence[bytes], *, unchecked: bool = False) -> list[bytes | None]:
        """The verified, unexpired values of `keys` (None for a miss), in one snapshot.

        A record that fails verification or has expired is a miss. With
        `unchecked`, a value the server marked to check against its source
        before serving it (`unvouched_key`: read back after a restart, say)
        is read all the same: for a caller that checks each value against a
        content hash its key names (checkpoint chunks), to whom any stored
        copy of the key is its value.

        Raises:
            lmdb.Error: the environment cannot be opened or read.
        """
        results: list[bytes | None] = [None] * len(keys)
        if keys and not unchecked and not self._served():
            return results
        now = time.time()
        with self._snapshot() as txn:
            if keys and self._in_doubt(txn):
                return results
            for i, key in enumerate(keys):
                value = self._verified(txn, key, now, unchecked=unchecked)
                if isinstance(value, FileRef):
                    found = self._from_file(value)  # into=None: bytes
                    results[i] = None if found is None else bytes(found)
                elif value is not None:
                    # Copy out before the snapshot ends: the buffer points into the map.
                    results[i] = value.tobytes()
        return results

    def _from_file(self, ref: FileRef, into: memoryview | None = None) -> bytes | memoryview | None:
        """A large value read from its file (into `into`), verified where it landed; a miss when the file went
        (the value was replaced or deleted since the snapshot) or its bytes are not the value."""
        value = read_file_value(self.path, ref, into)
        if value is None:
            self.corrupt += 1
        return value

    def get_into(
        self, key: bytes, into: bytearray | memoryview, *, unchecked: bool = False
    ) -> memoryview | bytes | None:
        """The verified, unexpired value of `key` copied into `into` (a view of its first bytes), or None.

        For a reader of large values one after another (shard parts): the
        copy lands in memory the process already has, not in a fresh
        allocation the kernel must fault in page by page. A value longer
        than `into` comes as bytes. The view is `into`'s: the next
        `get_into` with it overwrites it.

        Raises:
            lmdb.Error: the environment cannot be opened or read.
        """
        if not unchecked and not self._served():
            return None
        with self._snapshot() as txn:
            value = None if self._in_doubt(txn) else self._verified(txn, key, time.time(), unchecked=unchecked)
            if value is None:
                return None
            if isinstance(value, FileRef):
                return self._from_file(value, memoryview(into) if value.size <= len(into) else None)
            if len(value) > len(into):
                return value.tobytes()
            out = memoryview(into)[: len(value)]
            out[:] = value  # in the snapshot: the bytes verified are the bytes copied
            return out

    def _served(self) -> bool:
        """Whether a server holds its lock on the directory (`SERVING_LOCK`); asked at most every
        `SERVER_CHECK_SECONDS`."""
        now = time.monotonic()
        if now < self._serving_until:
            return True
        try:
            fd = os.open(os.path.join(self.path, SERVING_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.server_gone += 1  # no server has served this directory yet
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._serving_until = now + SERVER_CHECK_SECONDS
            return True
        finally:
            os.close(fd)  # and with it the shared lock, when it was taken
        self.server_gone += 1
        return False

    def _in_doubt(self, txn: Any) -> bool:
        """Whether the server doubts its lease in `txn`'s snapshot (every value reads as a miss)."""
        if txn.get(IN_DOUBT_KEY) is None:
            return False
        self.in_doubt += 1
        return True

    def _verified(self, txn: Any, key: bytes, now: float, *, unchecked: bool = False) -> memoryview | FileRef | None:
        """The value of `key` in `txn`'s snapshot (a view into the map), checksum verified, or the reference to
        the file of a large value (verified as it is read); None for a miss (a value the server would check
        first too, unless `unchecked`)."""
        stored = txn.get(storage_key(key))
        if stored is None:
            return None
        if not unchecked and txn.get(unvouched_key(key)) is not None:
            self.unvouched += 1
            return None
        if is_file_ref(stored):
            ref = file_ref(key, stored)
            if ref is None:
                self.corrupt += 1
            elif ref.header.expired(now):
                self.expired += 1
                return None
            return ref
        opened = open_stored(key, stored, txn.get)
        if opened is None:
            self.corrupt += 1
            return None
        header, value = opened
        if header.expired(now):
            self.expired += 1
            return None
        return value


def colocated_reader(server: _Informs, name: str, *, timeout: float = 5.0, explain: bool = False) -> L2Reader | None:
    """A reader of the L2 of `server` (a client of one server) when it runs on this machine; else None.

    The server's `Info` names its L2 path, boot id and host name; a reader is
    opened only when all three are this machine's and the file is there.
    `explain` logs why not (a caller that asked for co-located reads
    outright); a file that cannot be opened read-only is always logged.
    """
    try:
        info = server.info(timeout=timeout)
    except CacheClientError as exc:
        if explain:
            log.warning("co-located reads off: cannot ask %s for its L2 (%s)", name, exc)
        return None
    path = info.get("l2_path") or ""
    same_machine = info.get("boot_id") == boot_id() and info.get("hostname") == socket.gethostname()
    if not (same_machine and path and os.path.exists(os.path.join(path, "data.mdb"))):
        if explain:
            log.warning("co-located reads off: %s is not on this machine or has no L2", name)
        return None
    reader = L2Reader(path, int(info.get("l2_map_size") or 0))
    try:
        reader.get_many([])
    except Exception as exc:  # lmdb.Error and OSError alike: the gRPC path still works
        log.warning("co-located reads off: cannot open %s read-only (%s)", path, exc)
        return None
    return reader
