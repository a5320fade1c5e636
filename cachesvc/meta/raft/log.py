"""The Raft log as the core sees it: a snapshot base plus the entries after it.

The whole uncompacted log is held in memory (a metadata shard's log stays small
between snapshots). `stable` marks how far the driver has persisted; entries past
it are handed out in the next Ready.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachesvc.meta.raft.messages import Entry, Snapshot, SnapshotMetadata

__all__ = ["RaftLog"]


class RaftLog:
    """Entries after a snapshot, with commit, apply and persistence marks.

    Invariant: ``snapshot_index <= applied <= committed <= last_index()`` and
    ``entries[i].index == snapshot_index + 1 + i``.
    """

    def __init__(self, snapshot: SnapshotMetadata | None = None, entries: Sequence[Entry] = ()) -> None:
        """Rebuild a log from what storage recovered.

        Args:
            snapshot: Metadata of the latest persisted snapshot, if any.
            entries: Persisted entries following the snapshot, contiguous.
        """
        meta = snapshot or SnapshotMetadata()
        self.snapshot_index = meta.index
        self.snapshot_term = meta.term
        self.entries: list[Entry] = [e for e in entries if e.index > meta.index]
        for offset, entry in enumerate(self.entries):
            if entry.index != meta.index + 1 + offset:
                raise ValueError(f"log not contiguous at index {entry.index}")
        self.committed = meta.index
        self.applied = meta.index
        self.stable = self.last_index()
        # A snapshot received from the leader that the driver has not persisted yet.
        self.pending_snapshot: Snapshot | None = None

    def last_index(self) -> int:
        """The last index in the log (the snapshot's if no entries follow it)."""
        return self.snapshot_index + len(self.entries)

    def last_term(self) -> int:
        """Term of the last entry."""
        return self.entries[-1].term if self.entries else self.snapshot_term

    def term(self, index: int) -> int | None:
        """Term of the entry at `index`, or None if compacted away or past the end."""
        if index == self.snapshot_index:
            return self.snapshot_term
        if index < self.snapshot_index or index > self.last_index():
            return None
        return self.entries[index - self.snapshot_index - 1].term

    def match_term(self, index: int, term: int) -> bool:
        """Whether the entry at `index` exists and has `term`."""
        return self.term(index) == term

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Whether a candidate's log is at least as up to date as this one (§5.4.1)."""
        mine = self.last_term()
        return last_term > mine or (last_term == mine and last_index >= self.last_index())

    def slice(self, lo: int, hi: int) -> list[Entry]:
        """Entries with ``lo <= index < hi``; `lo` must not be compacted."""
        if lo <= self.snapshot_index:
            raise ValueError(f"index {lo} is compacted (snapshot at {self.snapshot_index})")
        hi = min(hi, self.last_index() + 1)
        return self.entries[lo - self.snapshot_index - 1 : hi - self.snapshot_index - 1]

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """The last index at or below `index` whose term is at most `term`.

        This is the fast back-tracking step: every entry of a term newer than the
        leader's probe can be skipped at once. Returns (index, term of that entry),
        with term 0 when it is compacted away and unknown.
        """
        while index > self.snapshot_index:
            t = self.term(index)
            if t is not None and t <= term:
                return index, t
            index -= 1
        if index == self.snapshot_index:
            return index, self.snapshot_term
        return index, 0

    def append(self, entries: Sequence[Entry]) -> None:
        """Append entries, truncating whatever the log holds from entries[0].index on."""
        if not entries:
            return
        first = entries[0].index
        if first <= self.committed:
            raise AssertionError(f"truncating committed index {first} (committed {self.committed})")
        del self.entries[first - self.snapshot_index - 1 :]
        self.entries.extend(entries)
        self.stable = min(self.stable, first - 1)

    def maybe_append(self, index: int, log_term: int, commit: int, entries: Sequence[Entry]) -> int | None:
        """Follower side of APPEND: the new last matching index, or None on mismatch.

        Entries already present with the same term are kept (a reordered, older
        APPEND must not truncate entries that a newer one added).
        """
        if not self.match_term(index, log_term):
            return None
        last_new = index + len(entries)
        for i, entry in enumerate(entries):
            if entry.index <= self.snapshot_index:
                continue
            if not self.match_term(entry.index, entry.term):
                self.append(entries[i:])
                break
        self.commit_to(min(commit, last_new))
        return last_new

    def commit_to(self, index: int) -> None:
        """Raise the commit index; never lowers it."""
        if index > self.committed:
            if index > self.last_index():
                raise AssertionError(f"commit {index} beyond last index {self.last_index()}")
            self.committed = index

    def maybe_commit(self, index: int, term: int) -> bool:
        """Commit up to `index` if that entry is from `term` (Raft §5.4.2, Figure 8)."""
        if index > self.committed and self.term(index) == term:
            self.committed = index
            return True
        return False

    def unstable_entries(self) -> list[Entry]:
        """Entries the driver has not persisted yet."""
        return self.entries[self.stable - self.snapshot_index :]

    def next_committed_entries(self) -> list[Entry]:
        """Committed entries the state machine has not applied yet."""
        lo = max(self.applied, self.snapshot_index) + 1
        return self.slice(lo, self.committed + 1) if lo <= self.committed else []

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the whole log by a snapshot received from the leader."""
        meta = snapshot.metadata
        self.snapshot_index = meta.index
        self.snapshot_term = meta.term
        self.entries = []
        self.committed = meta.index
        self.stable = meta.index
        self.pending_snapshot = snapshot

    def compact(self, index: int) -> None:
        """Drop entries up to `index`, which a snapshot now covers."""
        if index <= self.snapshot_index:
            return
        if index > self.applied:
            raise ValueError(f"cannot compact to {index}: only {self.applied} applied")
        term = self.term(index)
        assert term is not None
        del self.entries[: index - self.snapshot_index]
        self.snapshot_index = index
        self.snapshot_term = term
