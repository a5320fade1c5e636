"""Raft for the metadata shard: a pure, deterministic core and its durable storage.

Modules:
    messages: entries, hard state, snapshots, peer messages and the `Ready` batch.
    log: the in-memory log with commit/apply/persist marks (`RaftLog`).
    progress: the leader's per-follower replication state (`Progress`).
    quorum: majority arithmetic.
    core: the state machine itself (`RaftCore`, `Config`).
    storage: `LmdbStorage` for real nodes, `MemoryStorage` for the simulator.

The core does no I/O: a driver ticks it, steps it with received messages, and for
each `Ready` persists, then sends, then applies, then calls `advance`.
"""

from cachesvc.meta.raft.core import Config, NotLeaderError, ProposalDroppedError, RaftCore
from cachesvc.meta.raft.messages import (
    ConfChange,
    ConfChangeType,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    ReadState,
    Ready,
    Role,
    Snapshot,
    SnapshotMetadata,
    SoftState,
)
from cachesvc.meta.raft.storage import LmdbStorage, LogFullError, MemoryStorage, Storage, persist_ready

__all__ = [
    "ConfChange",
    "ConfChangeType",
    "Config",
    "Entry",
    "EntryKind",
    "HardState",
    "LmdbStorage",
    "LogFullError",
    "MemoryStorage",
    "Message",
    "MessageType",
    "NotLeaderError",
    "ProposalDroppedError",
    "RaftCore",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "SnapshotMetadata",
    "SoftState",
    "Storage",
    "persist_ready",
]
