"""The vocabulary of the Raft core: log entries, hard state, snapshots, messages, Ready.

Everything here is a plain, immutable-by-convention dataclass so that a driver can
encode it to protobuf field by field and the simulator can pass it around as is.
Node ids are positive ints; 0 means "none" only on the wire, the core uses None.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "ConfChange",
    "ConfChangeType",
    "Entry",
    "EntryKind",
    "HardState",
    "Message",
    "MessageType",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "SnapshotMetadata",
    "SoftState",
]


class EntryKind(enum.IntEnum):
    """What a log entry carries."""

    NORMAL = 0
    """Application data (empty data is the no-op a new leader appends)."""
    CONF_CHANGE = 1
    """An encoded `ConfChange`; the core applies it when the entry is applied."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry.

    Attributes:
        term: Term of the leader that created the entry.
        index: Position in the log, starting at 1.
        data: Opaque application payload, or an encoded `ConfChange`.
        kind: What `data` is.
    """

    term: int
    index: int
    data: bytes = b""
    kind: EntryKind = EntryKind.NORMAL


class ConfChangeType(enum.IntEnum):
    """Single-server membership changes."""

    ADD_NODE = 0
    REMOVE_NODE = 1


@dataclass(frozen=True, slots=True)
class ConfChange:
    """Add or remove one voter.

    Attributes:
        type: Add or remove.
        node_id: The voter added or removed.
    """

    type: ConfChangeType
    node_id: int

    def encode(self) -> bytes:
        """The bytes stored in a CONF_CHANGE entry's data."""
        return f"{int(self.type)}:{self.node_id}".encode()

    @classmethod
    def decode(cls, data: bytes) -> ConfChange:
        """Inverse of `encode`.

        Raises:
            ValueError: `data` is not an encoded ConfChange.
        """
        kind, node = data.decode().split(":")
        return cls(ConfChangeType(int(kind)), int(node))


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before a vote is granted or an append acknowledged.

    Attributes:
        term: Current term.
        vote: Who this node voted for in `term`, or None.
        commit: Highest index known committed (persisted so a restart can
            re-apply without waiting for a leader; losing it is safe).
    """

    term: int = 0
    vote: int | None = None
    commit: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotMetadata:
    """Where a snapshot sits in the log and which voters were in force there.

    Attributes:
        index: Last log index the snapshot covers.
        term: Term of the entry at `index`.
        voters: The voter set after applying everything up to `index`.
    """

    index: int = 0
    term: int = 0
    voters: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state-machine image plus its position in the log.

    Attributes:
        metadata: Index, term and voters.
        data: The application's serialised state machine.
    """

    metadata: SnapshotMetadata
    data: bytes = b""


class MessageType(enum.IntEnum):
    """Messages exchanged between Raft peers."""

    APPEND = 0
    APPEND_RESP = 1
    HEARTBEAT = 2
    HEARTBEAT_RESP = 3
    VOTE = 4
    VOTE_RESP = 5
    PRE_VOTE = 6
    PRE_VOTE_RESP = 7
    SNAPSHOT = 8
    TIMEOUT_NOW = 9
    READ_INDEX = 10
    READ_INDEX_RESP = 11


@dataclass(frozen=True, slots=True)
class Message:
    """A message between peers. Which fields matter depends on `type`.

    Attributes:
        type: The message type.
        src: Sender id.
        dst: Recipient id.
        term: Sender's term (for PRE_VOTE: the term it would campaign in).
        log_term: APPEND: term of the entry at `index`. VOTE/PRE_VOTE: the
            candidate's last log term. APPEND_RESP reject: term of the follower's
            entry at `reject_hint` (the conflict-term hint; 0 if unknown).
        index: APPEND: index preceding `entries`. APPEND_RESP: the highest
            index now matching (accept) or the rejected `index` (reject).
            VOTE/PRE_VOTE: the candidate's last log index. READ_INDEX_RESP:
            the read index.
        entries: APPEND: entries to append after `index`.
        commit: The sender's commit index (APPEND, HEARTBEAT).
        reject: Whether a request was refused.
        reject_hint: APPEND_RESP reject: the follower's guess of the last
            index that may match, so the leader skips a whole term at a time.
        snapshot: SNAPSHOT: the snapshot to install.
        context: HEARTBEAT(_RESP) and READ_INDEX(_RESP): the read request it
            confirms; VOTE: b"transfer" when campaigning after TIMEOUT_NOW.
        quiesce: HEARTBEAT: the leader is quiesced (everything replicated and
            committed, nothing proposed): it heartbeats every
            `Config.quiesced_heartbeat_tick` only, and the follower waits the
            quiesced election timeout before campaigning.
    """

    type: MessageType
    src: int
    dst: int
    term: int = 0
    log_term: int = 0
    index: int = 0
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0
    snapshot: Snapshot | None = None
    context: bytes = b""
    quiesce: bool = False


@dataclass(frozen=True, slots=True)
class ReadState:
    """A linearizable read may be served once the state machine has applied `index`.

    Attributes:
        index: The leader's commit index when the read was confirmed.
        request_ctx: The context the caller passed to `read_index`.
    """

    index: int
    request_ctx: bytes


class Role(enum.Enum):
    """A node's role in its current term."""

    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass(frozen=True, slots=True)
class SoftState:
    """Volatile state worth reporting; never persisted.

    Attributes:
        lead: The leader this node follows, or None.
        role: This node's role.
    """

    lead: int | None
    role: Role


@dataclass(slots=True)
class Ready:
    """One batch of work for the driver, handled strictly in this order.

    1. Persist `snapshot` (if any), then `entries` (replacing any stored
       entries from `entries[0].index` on), then `hard_state` (if any),
       durably.
    2. Send `messages`. Never before step 1: a vote or an acknowledgement
       promises that the state behind it survives a crash.
    3. Restore the state machine from `snapshot` (if any), then apply
       `committed_entries` in order.
    4. Serve `read_states` once the state machine has applied their index.
    5. Call `RaftCore.advance(ready)`.

    Attributes:
        soft_state: Leader and role after this batch.
        hard_state: New term/vote/commit to persist, or None if unchanged.
        entries: Entries to persist.
        snapshot: A snapshot received from the leader, to persist and restore.
        messages: Messages to send after persisting.
        committed_entries: Entries to apply to the state machine.
        read_states: Confirmed linearizable reads.
    """

    soft_state: SoftState
    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    messages: list[Message] = field(default_factory=list)
    committed_entries: list[Entry] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
