"""Read-only access to a co-located cache server's L2 (its LMDB environment).

When a client runs on the machine its cache server runs on, values resident in
the server's L2 can be read straight from the LMDB file: no gRPC round trip, no
copy through a socket. LMDB allows many reader processes beside one writer, so
this never blocks the server.

The record format is the server's (`cachesvc.tiers.lmdb_tier` and
`cachesvc.integrity`), re-implemented here because the client never imports
`cachesvc`; a test checks that both agree on real records. Every value is
verified against its xxh3-64 checksum; a record that fails (or that is not a
record this version understands) reads as a miss, so the caller asks the
server, which verifies it again and drops the bad copy.

Fork safety: the environment is opened lazily and keyed on the process id. An
LMDB environment must not be used in a forked child, so after a fork the
child abandons the parent's handle (never closing it: closing touches the
mapping the parent still uses) and opens its own.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import lmdb
import xxhash

__all__ = ["HEADER", "L2Reader", "parse_record", "storage_key"]

HEADER = struct.Struct("<2sBBQH")
"""magic, version, flags, xxh3-64 of the value, length of the key stored in the record (0: none)."""
_MAGIC = b"CV"
_VERSION = 1
_INLINE_KEY_MAX = 500

# One environment per directory per process: LMDB (and py-lmdb) refuse a
# second open of the same environment in one process.
_envs: dict[str, Any] = {}
_envs_pid = os.getpid()
_envs_lock = threading.Lock()
# Handles opened by a parent process, kept alive in a forked child so that
# garbage collection never closes them there.
_abandoned: list[Any] = []


def _abandon_after_fork() -> None:
    global _envs_lock, _envs_pid
    _abandoned.extend(_envs.values())
    _envs.clear()
    _envs_pid = os.getpid()
    _envs_lock = threading.Lock()


os.register_at_fork(after_in_child=_abandon_after_fork)


def _environment(path: str, map_size: int, max_readers: int) -> Any:
    """This process's read-only handle of the environment at `path`, opened on first use."""
    global _envs_pid
    with _envs_lock:
        if _envs_pid != os.getpid():
            _abandon_after_fork()
        env = _envs.get(path)
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
            _envs[path] = env
        return env


def storage_key(key: bytes) -> bytes:
    """The LMDB key under which the server stores `key`."""
    if len(key) <= _INLINE_KEY_MAX:
        return b"k" + key
    return b"h" + xxhash.xxh3_128_digest(key)


def parse_record(key: bytes, record: bytes | memoryview) -> memoryview | None:
    """The value inside a stored record of `key`, or None if the record is not a valid one for it.

    Invalid means: not a record of this format and version, a stored key that
    is not `key` (a digest collision), or a value that fails its checksum.
    """
    view = memoryview(record)
    if len(view) < HEADER.size:
        return None
    magic, version, _flags, value_checksum, key_len = HEADER.unpack_from(view)
    if magic != _MAGIC or version != _VERSION or HEADER.size + key_len > len(view):
        return None
    start = HEADER.size + key_len
    if key_len and view[HEADER.size : start] != key:
        return None
    value = view[start:]
    if xxhash.xxh3_64_intdigest(value) != value_checksum:
        return None
    return value


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

    def _environment(self) -> Any:
        return _environment(self.path, self.map_size, self.max_readers)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The verified values of `keys` (None for a miss or a record that failed verification), in one snapshot.

        Raises:
            lmdb.Error: the environment cannot be opened or read.
        """
        results: list[bytes | None] = [None] * len(keys)
        with self._environment().begin(buffers=True) as txn:
            for i, key in enumerate(keys):
                record = txn.get(storage_key(key))
                if record is None:
                    continue
                value = parse_record(key, record)
                if value is None:
                    self.corrupt += 1
                    continue
                # Copy out before the snapshot ends: the buffer points into the map.
                results[i] = value.tobytes()
        return results
