"""Durable Raft state: term, vote and log in LMDB; snapshots as atomically written files.

Two implementations of one `Storage` contract:

* `LmdbStorage`, for real nodes. Every `save` is one LMDB transaction committed
  with fsync (``sync=True``), so when it returns the vote or the entries are on
  disk and the driver may send the messages that promise them. Snapshots go to
  ``<dir>/snapshots`` by write-to-temp, fsync, rename, fsync-directory; the log is
  trimmed only after the snapshot file is durable, and `load` repairs a crash in
  between.
* `MemoryStorage`, for the simulator: same semantics, the "disk" is the object
  itself, which survives a simulated crash of the node that used it.

A node restarted from either recovers exactly what the last completed `save` and
`compact` calls recorded.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import lmdb

from cachesvc.meta.raft.messages import Entry, EntryKind, HardState, Ready, Snapshot, SnapshotMetadata

__all__ = ["LmdbStorage", "LogFullError", "MemoryStorage", "Storage", "persist_ready"]


class LogFullError(Exception):
    """The log has no room for what a `save` was to write; nothing of that save was written."""


class Storage(Protocol):
    """What the driver needs to make Raft state survive a crash."""

    def load(self) -> tuple[HardState, Snapshot | None, list[Entry]]:
        """Recover hard state, latest snapshot and the entries after it.

        Returns values suitable for `RaftCore(..., hard_state, snapshot, entries)`.
        """
        ...

    def save(self, hard_state: HardState | None, entries: Sequence[Entry], snapshot: Snapshot | None = None) -> None:
        """Durably record a Ready's state before its messages are sent.

        `snapshot` (one received from the leader) replaces the whole stored log.
        `entries` replace every stored entry from ``entries[0].index`` on.
        All-or-nothing: a failed or interrupted save leaves the previous state.

        Raises:
            LogFullError: no room for the entries (compacting may make some).
        """
        ...

    def compact(self, snapshot: Snapshot) -> None:
        """Durably store a locally taken snapshot, then drop entries it covers.

        A snapshot no newer than the stored one is ignored.
        """
        ...

    def close(self) -> None:
        """Release files and handles. The storage is unusable afterwards."""
        ...


def persist_ready(storage: Storage, rd: Ready) -> None:
    """Persist what a Ready asks for (step 1 of the driver loop)."""
    if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
        storage.save(rd.hard_state, rd.entries, rd.snapshot)


class MemoryStorage:
    """`Storage` kept in memory: the simulator's stand-in for a disk."""

    def __init__(self) -> None:
        self.hard_state = HardState()
        self.snapshot: Snapshot | None = None
        self.entries: list[Entry] = []

    def load(self) -> tuple[HardState, Snapshot | None, list[Entry]]:
        """See `Storage.load`."""
        return self.hard_state, self.snapshot, list(self.entries)

    def save(self, hard_state: HardState | None, entries: Sequence[Entry], snapshot: Snapshot | None = None) -> None:
        """See `Storage.save`."""
        if snapshot is not None:
            self.snapshot = snapshot
            self.entries = []
        if entries:
            base = self.snapshot.metadata.index if self.snapshot else 0
            first = entries[0].index
            if first > base + len(self.entries) + 1:
                raise ValueError(f"gap in log: appending {first} after {base + len(self.entries)}")
            del self.entries[max(0, first - base - 1) :]
            self.entries.extend(e for e in entries if e.index > base)
        if hard_state is not None:
            self.hard_state = hard_state

    def compact(self, snapshot: Snapshot) -> None:
        """See `Storage.compact`."""
        if self.snapshot is not None and snapshot.metadata.index <= self.snapshot.metadata.index:
            return
        self.snapshot = snapshot
        self.entries = [e for e in self.entries if e.index > snapshot.metadata.index]

    def close(self) -> None:
        """Nothing to release."""


_HS_KEY = b"hard_state"
_BASE_KEY = b"log_base"
_SCRATCH_KEY = b"scratch"  # written and deleted to advance the transaction id (recycle_freed_pages)
_ENTRY_PREFIX = b"e"
_SNAP_SUFFIX = ".snap"


def _entry_key(index: int) -> bytes:
    return _ENTRY_PREFIX + struct.pack(">Q", index)


def _encode_entry(e: Entry) -> bytes:
    return struct.pack(">QB", e.term, int(e.kind)) + e.data


def _decode_entry(index: int, raw: bytes) -> Entry:
    term, kind = struct.unpack_from(">QB", raw)
    return Entry(term, index, bytes(raw[9:]), EntryKind(kind))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LmdbStorage:
    """`Storage` on disk: LMDB for hard state and log, files for snapshots.

    Layout under `path`: ``log/`` (the LMDB environment) and ``snapshots/``
    (``<index>-<term>.snap`` files). Not shared across processes or forks: one
    node process owns the directory.
    """

    def __init__(self, path: str | os.PathLike[str], map_size: int = 1 << 30) -> None:
        """Open (creating if needed) the storage under `path`.

        Args:
            path: The node's data directory.
            map_size: LMDB map size in bytes (the most the log may occupy).
        """
        self.path = Path(path)
        self._snap_dir = self.path / "snapshots"
        self._snap_dir.mkdir(parents=True, exist_ok=True)
        (self.path / "log").mkdir(parents=True, exist_ok=True)
        # sync=True: a committed write transaction is fsync'd before commit returns.
        self._env = lmdb.open(str(self.path / "log"), map_size=map_size, sync=True, metasync=True)
        self.map_size = map_size

    def headroom(self) -> int:
        """Bytes of the map not holding log pages now (pages freed by compaction count as free)."""
        st = self._env.stat()
        used = (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] + 2) * st["psize"]
        return max(0, self._env.info()["map_size"] - used)

    # -- snapshots ---------------------------------------------------------

    def _snapshot_files(self) -> list[tuple[int, int, Path]]:
        found = []
        for p in self._snap_dir.iterdir():
            if p.suffix == ".tmp":
                p.unlink()  # A write interrupted before its rename.
                continue
            if p.suffix != _SNAP_SUFFIX:
                continue
            index, term = (int(x) for x in p.stem.split("-"))
            found.append((index, term, p))
        return sorted(found)

    def _write_snapshot(self, snap: Snapshot) -> None:
        meta = snap.metadata
        final = self._snap_dir / f"{meta.index:020d}-{meta.term:020d}{_SNAP_SUFFIX}"
        tmp = final.with_suffix(".tmp")
        header = json.dumps({"index": meta.index, "term": meta.term, "voters": list(meta.voters)}).encode()
        with open(tmp, "wb") as f:
            f.write(struct.pack(">I", len(header)) + header + snap.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self._snap_dir)

    def _drop_old_snapshots(self, keep_index: int) -> None:
        for index, _, p in self._snapshot_files():
            if index < keep_index:
                p.unlink()

    @staticmethod
    def _read_snapshot(p: Path) -> Snapshot:
        raw = p.read_bytes()
        (n,) = struct.unpack_from(">I", raw)
        header = json.loads(raw[4 : 4 + n])
        meta = SnapshotMetadata(header["index"], header["term"], tuple(header["voters"]))
        return Snapshot(meta, raw[4 + n :])

    # -- log ---------------------------------------------------------------

    @staticmethod
    def _delete_entries(txn: lmdb.Transaction, lo: int, hi: int | None = None) -> None:
        """Delete entries with lo <= index (< hi if given)."""
        cur = txn.cursor()
        if not cur.set_range(_entry_key(lo)):
            return
        while True:
            key = bytes(cur.key())
            if not key.startswith(_ENTRY_PREFIX):
                return
            if hi is not None and struct.unpack(">Q", key[1:])[0] >= hi:
                return
            if not cur.delete():
                return

    def load(self) -> tuple[HardState, Snapshot | None, list[Entry]]:
        """See `Storage.load`. Also finishes a compaction a crash interrupted."""
        files = self._snapshot_files()
        snap = self._read_snapshot(files[-1][2]) if files else None
        si, st = (snap.metadata.index, snap.metadata.term) if snap else (0, 0)
        with self._env.begin(write=True) as txn:
            raw_hs = txn.get(_HS_KEY)
            hs = HardState()
            if raw_hs is not None:
                term, vote, commit = struct.unpack(">QQQ", raw_hs)
                hs = HardState(term, vote or None, commit)
            raw_base = txn.get(_BASE_KEY)
            bi, bt = struct.unpack(">QQ", raw_base) if raw_base else (0, 0)
            if si < bi:
                raise RuntimeError(f"snapshot at {bi} missing from {self._snap_dir}")
            if (si, st) != (bi, bt):
                # Crashed after the snapshot file became durable, before the log was
                # trimmed. Entries after it are ours only if the log agrees with the
                # snapshot at its index (a local compaction); otherwise the snapshot
                # came from a leader and replaces the whole log.
                raw = txn.get(_entry_key(si))
                if raw is not None and _decode_entry(si, raw).term == st:
                    self._delete_entries(txn, 0, si + 1)
                else:
                    self._delete_entries(txn, 0)
                txn.put(_BASE_KEY, struct.pack(">QQ", si, st))
            entries: list[Entry] = []
            cur = txn.cursor()
            if cur.set_range(_entry_key(si + 1)):
                for key, value in cur:
                    if not key.startswith(_ENTRY_PREFIX):
                        break
                    index = struct.unpack(">Q", key[1:])[0]
                    if index != si + 1 + len(entries):
                        raise RuntimeError(f"log has a gap before index {index}")
                    entries.append(_decode_entry(index, value))
        if files:
            self._drop_old_snapshots(si)
        return hs, snap, entries

    def save(self, hard_state: HardState | None, entries: Sequence[Entry], snapshot: Snapshot | None = None) -> None:
        """See `Storage.save`. Returns once everything is fsync'd."""
        if snapshot is not None:
            self._write_snapshot(snapshot)
        try:
            with self._env.begin(write=True) as txn:
                if snapshot is not None:
                    self._delete_entries(txn, 0)
                    txn.put(_BASE_KEY, struct.pack(">QQ", snapshot.metadata.index, snapshot.metadata.term))
                if entries:
                    self._delete_entries(txn, entries[0].index)
                    for e in entries:
                        txn.put(_entry_key(e.index), _encode_entry(e))
                if hard_state is not None:
                    hs = hard_state
                    txn.put(_HS_KEY, struct.pack(">QQQ", hs.term, hs.vote or 0, hs.commit))
        except lmdb.MapFullError:
            # The transaction was aborted, so the stored log is as before; a received snapshot's
            # file may already be durable, and `load` would finish installing it, as after a crash.
            size = sum(len(e.data) for e in entries)
            raise LogFullError(f"raft log full: {len(entries)} entries ({size} bytes) do not fit the map") from None
        if snapshot is not None:
            self._drop_old_snapshots(snapshot.metadata.index)

    def compact(self, snapshot: Snapshot) -> None:
        """See `Storage.compact`."""
        meta = snapshot.metadata
        files = self._snapshot_files()
        if files and files[-1][0] >= meta.index:
            return
        self._write_snapshot(snapshot)
        with self._env.begin(write=True) as txn:
            self._delete_entries(txn, 0, meta.index + 1)
            txn.put(_BASE_KEY, struct.pack(">QQ", meta.index, meta.term))
        self._drop_old_snapshots(meta.index)

    def recycle_freed_pages(self) -> None:
        """Make the pages a compaction just freed reusable by the next `save`.

        LMDB keeps the previous committed version intact for crash safety, so
        pages freed by the last transaction are reused only two transactions
        later; two empty ones get there.
        """
        for _ in range(2):
            with self._env.begin(write=True) as txn:
                txn.put(_SCRATCH_KEY, b"")
                txn.delete(_SCRATCH_KEY)

    def close(self) -> None:
        """Close the LMDB environment."""
        self._env.close()
