"""Which keys the cache tiers hold under the KV prefixes, as digests, and the recent changes to that set.

A client's local index of the KV blocks the cache holds (`cacheclient`'s
`KVIndex`) follows this set through the `KeyDigest` RPC: once a full
snapshot, then only the changes. The engine reports every key its cache
tiers take in (`admitted`) and every key no tier holds any more
(`removed`: deleted, evicted from the last tier, expired, dropped as
corrupt); only keys under one of the configured prefixes are followed, each
as its 8-byte digest (`cacheclient.wire.key_digest`).

Each prefix keeps a bounded log of changes numbered by a sequence number.
An epoch, drawn at random when the server starts, names this run of the
server: a caller whose epoch differs (the server restarted) or whose
sequence number fell out of the log gets a full snapshot instead, in pages.

Pure bookkeeping: no clock, lock or I/O. The engine calls it under its lock;
the sorting of a snapshot page runs after the lock is left (`Pending`).
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cacheclient.wire import KEY_DIGEST_ENTRIES, key_digest
from cachesvc.errors import InvalidKey, NotConfigured

__all__ = ["DigestAnswer", "DigestLog", "KeyIndex", "Pending"]


@dataclass(frozen=True, slots=True)
class DigestAnswer:
    """One KeyDigest answer (see cache.proto): digests now held and no longer held, up to `seq`."""

    epoch: int
    seq: int
    full: bool = False
    reset: bool = False
    added: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    more: bool = False
    next_after: int = 0


Pending = Callable[[], DigestAnswer]
"""The rest of an answer's work, run outside the engine lock."""


class DigestLog:
    """The digests held under one prefix, and the last changes to them (at least `capacity`).

    A change is `digest << 1 | 1` (now held) or `digest << 1` (no longer
    held); only real changes are logged, so a key admitted into a second
    tier (a demotion, a promotion) adds nothing.
    """

    def __init__(self, prefix: bytes, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.prefix = prefix
        self.capacity = capacity
        self.held: set[int] = set()
        self.seq = 0
        """The sequence number of the newest change (0: none yet)."""
        self._changes: list[int] = []
        self._first = 1
        """The sequence number of `_changes[0]`."""

    def admit(self, digest: int) -> None:
        if digest not in self.held:
            self.held.add(digest)
            self._log(digest << 1 | 1)

    def remove(self, digest: int) -> None:
        if digest in self.held:
            self.held.discard(digest)
            self._log(digest << 1)

    def _log(self, change: int) -> None:
        self._changes.append(change)
        self.seq += 1
        if len(self._changes) >= 2 * self.capacity:  # amortized: trim in halves
            drop = len(self._changes) - self.capacity
            del self._changes[:drop]
            self._first += drop

    def knows_since(self, since_seq: int) -> bool:
        """Whether every change after `since_seq` is still in the log."""
        return self._first - 1 <= since_seq <= self.seq

    def changes_since(self, since_seq: int, max_entries: int) -> tuple[list[int], list[int], int]:
        """(now held, no longer held, sequence number reached) for up to `max_entries` changes after `since_seq`.

        A digest changed twice in the range counts by its last change.
        """
        start = since_seq - (self._first - 1)
        last: dict[int, int] = {}
        for change in self._changes[start : start + max_entries]:
            last[change >> 1] = change & 1
        added = [digest for digest, held in last.items() if held]
        removed = [digest for digest, held in last.items() if not held]
        return added, removed, min(self.seq, since_seq + max_entries)


class KeyIndex:
    """The followed prefixes' digest logs, and this server run's epoch.

    Args:
        prefixes: key prefixes to follow (the server's `kv_index_prefixes`).
        capacity: changes each prefix remembers at least, for incremental syncs.
        epoch: this run's epoch; None: a random non-zero 64-bit number.
    """

    def __init__(self, prefixes: Sequence[bytes], capacity: int = 65536, epoch: int | None = None) -> None:
        self.epoch = epoch if epoch is not None else secrets.randbelow((1 << 64) - 1) + 1
        self._logs = [DigestLog(prefix, capacity) for prefix in prefixes]

    @property
    def prefixes(self) -> list[bytes]:
        return [log.prefix for log in self._logs]

    def admitted(self, key: bytes) -> None:
        """A cache tier took `key` in."""
        for log in self._logs:
            if key.startswith(log.prefix):
                log.admit(key_digest(key))

    def removed(self, key: bytes) -> None:
        """No cache tier holds `key` any more, or it reads as a miss (expired)."""
        for log in self._logs:
            if key.startswith(log.prefix):
                log.remove(key_digest(key))

    def held(self, prefix: bytes) -> set[int]:
        """The digests held under `prefix` (a view: do not change it)."""
        return self._log_of(prefix).held

    def _log_of(self, prefix: bytes) -> DigestLog:
        if not prefix:
            raise InvalidKey("KeyDigest: prefix must not be empty")
        for log in self._logs:
            if log.prefix == prefix:
                return log
        followed = ", ".join(repr(p.decode(errors="replace")) for p in self.prefixes) or "none"
        raise NotConfigured(
            f"KeyDigest: prefix {prefix.decode(errors='replace')!r} is not one of this server's "
            f"kv_index_prefixes ({followed})"
        )

    def read(
        self, prefix: bytes, epoch: int, since_seq: int, snapshot: bool, snapshot_after: int, max_entries: int
    ) -> Pending:
        """The answer to a KeyDigest request; call the result once the engine lock is left.

        Raises:
            InvalidKey: an empty prefix, or `max_entries` over KEY_DIGEST_ENTRIES.
            NotConfigured: `prefix` is not followed.
        """
        if max_entries > KEY_DIGEST_ENTRIES:
            raise InvalidKey(f"KeyDigest: max_entries {max_entries} is over the limit of {KEY_DIGEST_ENTRIES}")
        log = self._log_of(prefix)
        limit = max_entries or KEY_DIGEST_ENTRIES
        known = epoch == self.epoch and log.knows_since(since_seq)
        if not known or snapshot:
            # A page of what is held now. Pages of one snapshot are read at
            # different moments; the changes after its first page, applied
            # next in order, make the union right.
            copy = list(log.held)
            reset = not known
            seq = log.seq if reset else since_seq
            after = -1 if reset else snapshot_after

            def page() -> DigestAnswer:
                rest = [digest for digest in copy if digest > after]
                taken = heapq.nsmallest(limit, rest)
                return DigestAnswer(
                    self.epoch,
                    seq,
                    full=True,
                    reset=reset,
                    added=taken,
                    more=len(rest) > len(taken),
                    next_after=taken[-1] if taken else max(after, 0),
                )

            return page
        added, removed, reached = log.changes_since(since_seq, limit)
        answer = DigestAnswer(self.epoch, reached, added=added, removed=removed, more=reached < log.seq)
        return lambda: answer
