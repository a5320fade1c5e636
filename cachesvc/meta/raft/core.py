"""The pure Raft state machine: messages and ticks in, a `Ready` batch out.

No sockets, clocks, threads or files: the driver calls `tick()` on a timer, feeds
received messages to `step()`, submits work with `propose()`, `propose_conf_change()`,
`read_index()` and `transfer_leadership()`, and then drains `ready()` / `advance()`
(see `Ready` for the persist-then-send order). Randomness (election timeouts) comes
from an injected `random.Random`, so a seeded run replays exactly.

The algorithm follows the Raft paper and Ongaro's thesis, structured like
etcd-io/raft: pre-vote and check-quorum (§9.6), conflict-term back-tracking for
APPEND rejections, commitment by counting only for entries of the leader's term
(§5.4.2), ReadIndex reads (§6.4), InstallSnapshot (§7), single-server membership
changes applied when the entry is applied (§4.1, one pending at a time, and only
after the leader has committed an entry of its term), and leadership transfer
with TIMEOUT_NOW (§3.10).

Quiescence (optional, `Config.quiesce`; the idea of CockroachDB's quiesced
ranges): a leader whose every follower has its whole log, committed, with no
read, transfer or proposal under way, marks its next heartbeat `quiesce` and
from then on heartbeats every `quiesced_heartbeat_tick` instead of every
`heartbeat_tick`. A follower told so waits `quiesced_election_tick` (randomised
up to twice that) before campaigning, treats a vote request as coming from a
cut-off node for as long (the check-quorum lease), and answers only every
other quiesced heartbeat; the leader's quorum check runs on a window of twice
`quiesced_election_tick`, so it holds a few answers. Any entry appended (a proposal, a membership change)
wakes the leader up at once, and an APPEND or an ordinary heartbeat wakes its
followers. So an idle shard costs a heartbeat round every
`quiesced_heartbeat_tick`, and a dead leader of an idle shard is replaced
within about twice `quiesced_election_tick`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from cachesvc.meta.raft.log import RaftLog
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
from cachesvc.meta.raft.progress import Progress, ProgressState
from cachesvc.meta.raft.quorum import VoteResult, committed_index, majority, vote_result

__all__ = ["Config", "NotLeaderError", "ProposalDroppedError", "RaftCore"]

_TRANSFER = b"transfer"
# After this many heartbeat replies with no word on a snapshot sent, it is presumed
# lost (the network may drop it) and sent again.
_SNAPSHOT_RETRY_HEARTBEATS = 3


def _request_type(resp: MessageType) -> MessageType:
    """The request type a vote response answers."""
    return MessageType.PRE_VOTE if resp is MessageType.PRE_VOTE_RESP else MessageType.VOTE


class ProposalDroppedError(Exception):
    """The proposal was not appended (not the leader, a transfer is in progress, ...)."""


class NotLeaderError(ProposalDroppedError):
    """Only the leader accepts proposals.

    Attributes:
        leader: The leader this node knows of, as a redirection hint, or None.
    """

    def __init__(self, leader: int | None) -> None:
        super().__init__(f"not the leader (leader hint: {leader})")
        self.leader = leader


@dataclass(frozen=True, slots=True)
class Config:
    """Tunables of one node. Times are in ticks of the driver's timer.

    Attributes:
        id: This node's id (positive).
        election_tick: Base election timeout; the actual timeout is drawn
            uniformly from [election_tick, 2 * election_tick).
        heartbeat_tick: Ticks between leader heartbeats; well below election_tick.
        pre_vote: Run a pre-vote round before bumping the term, so a node cut off
            from the cluster does not inflate terms and depose a healthy leader.
        check_quorum: A leader steps down when it has not heard from a quorum in
            an election timeout; followers that heard a leader recently ignore votes.
        max_entries_per_message: Cap on entries in one APPEND.
        quiesce: A leader with nothing to replicate slows its heartbeats down
            to `quiesced_heartbeat_tick` (see the module docstring).
        quiesced_heartbeat_tick: Ticks between a quiesced leader's heartbeats.
        quiesced_election_tick: Base election timeout of a follower whose
            leader is quiesced (twice it: the quiesced leader's quorum-check
            window); well above `quiesced_heartbeat_tick`.
    """

    id: int
    election_tick: int = 10
    heartbeat_tick: int = 1
    pre_vote: bool = True
    check_quorum: bool = True
    max_entries_per_message: int = 64
    quiesce: bool = False
    quiesced_heartbeat_tick: int = 0
    quiesced_election_tick: int = 0

    def validate(self) -> None:
        """Raise ValueError on nonsensical settings."""
        if self.id <= 0:
            raise ValueError("id must be positive")
        if self.heartbeat_tick <= 0 or self.election_tick <= self.heartbeat_tick:
            raise ValueError("need 0 < heartbeat_tick < election_tick")
        if self.max_entries_per_message <= 0:
            raise ValueError("max_entries_per_message must be positive")
        if self.quiesce and not (
            self.heartbeat_tick <= self.quiesced_heartbeat_tick < self.quiesced_election_tick
            and self.election_tick <= self.quiesced_election_tick
        ):
            raise ValueError(
                "quiesce needs heartbeat_tick <= quiesced_heartbeat_tick < quiesced_election_tick"
                " and election_tick <= quiesced_election_tick"
            )


@dataclass(slots=True)
class _PendingRead:
    index: int
    src: int
    acks: set[int]


class RaftCore:
    """One Raft node's consensus state, driven entirely by its caller.

    Typical driver loop::

        core = RaftCore(cfg, voters, rng, *storage.load())
        while True:
            ... on timer: core.tick(); on message m: core.step(m); on client write:
                core.propose(data); on linearizable read: core.read_index(ctx)
            while core.has_ready():
                rd = core.ready()
                storage.save(rd.hard_state, rd.entries, rd.snapshot)  # durably
                transport.send(rd.messages)
                state_machine.restore(rd.snapshot); apply(rd.committed_entries)
                serve(rd.read_states)  # once applied >= read_state.index
                core.advance(rd)
            if log grew: snap = core.compact(state_machine.snapshot()); storage.compact(snap)
    """

    def __init__(
        self,
        config: Config,
        voters: Iterable[int],
        rng: random.Random,
        hard_state: HardState | None = None,
        snapshot: Snapshot | None = None,
        entries: Iterable[Entry] = (),
    ) -> None:
        """Create a node, fresh or from what its storage recovered.

        Args:
            config: This node's settings.
            voters: The bootstrap voter set. Ignored when `snapshot` is given
                (the snapshot records the voters in force at its index); later
                changes come from applying CONF_CHANGE entries. A node joining an
                existing cluster passes the cluster's voters plus itself.
            rng: Source of election-timeout jitter; seed it for replayable runs.
            hard_state: Recovered term, vote and commit.
            snapshot: Recovered latest snapshot.
            entries: Recovered entries after the snapshot.
        """
        config.validate()
        self.config = config
        self.id = config.id
        self._rng = rng
        hs = hard_state or HardState()
        self.log = RaftLog(snapshot.metadata if snapshot else None, list(entries))
        self.snapshot: Snapshot | None = snapshot
        self.voters: set[int] = set(snapshot.metadata.voters) if snapshot else set(voters)
        self.term = hs.term
        self.vote = hs.vote
        if hs.commit > self.log.last_index():
            raise ValueError(f"hard state commit {hs.commit} past last index {self.log.last_index()}")
        self.log.commit_to(hs.commit)
        self.role = Role.FOLLOWER
        self.lead: int | None = None
        self.progress: dict[int, Progress] = {}
        self._votes: dict[int, bool] = {}
        self._msgs: list[Message] = []
        self._read_states: list[ReadState] = []
        self._pending_reads: dict[bytes, _PendingRead] = {}
        self._read_queue: list[bytes] = []
        # ReadIndex requests that arrived before this leader committed an entry of its term.
        self._deferred_reads: list[tuple[bytes, int]] = []
        self.lead_transferee: int | None = None
        self.pending_conf_index = 0
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = 0
        # Leader: it is quiesced. Follower: its leader said so in its last heartbeat.
        self.quiesced = False
        # Follower: it answered the last quiesced heartbeat (it answers every other one).
        self._ack_quiet = False
        self._prev_hard_state = HardState(self.term, self.vote, self.log.committed)
        self._prev_soft_state = SoftState(None, Role.FOLLOWER)
        self._become_follower(self.term, None)

    # ------------------------------------------------------------------ public API

    @property
    def hard_state(self) -> HardState:
        """Current term, vote and commit index."""
        return HardState(self.term, self.vote, self.log.committed)

    @property
    def soft_state(self) -> SoftState:
        """Current leader and role."""
        return SoftState(self.lead, self.role)

    @property
    def is_leader(self) -> bool:
        """Whether this node leads in its current term (it may since have been deposed)."""
        return self.role is Role.LEADER

    def promotable(self) -> bool:
        """Whether this node may campaign: only voters do."""
        return self.id in self.voters

    def ticks_until_due(self) -> int:
        """How many ticks from now `tick` first acts (a heartbeat, a quorum check, an election), at least 1.

        A driver with nothing else to do may sleep that long, then tick that
        many times: the ticks in between change nothing but counters. A
        leader alone (no other member to heartbeat) is due only for its
        quorum check; a node that may not campaign never is (it answers the
        election timeout).
        """
        if self.role is Role.LEADER:
            due = self._lease_ticks() - self._election_elapsed
            if len(self.progress) > 1:
                due = min(due, self._heartbeat_interval() - self._heartbeat_elapsed)
            return max(1, due)
        if not self.promotable():
            return self.config.election_tick
        return max(1, self._randomized_timeout - self._election_elapsed)

    def tick(self) -> None:
        """Advance logical time by one tick."""
        if self.role is Role.LEADER:
            self._tick_heartbeat()
        else:
            self._tick_election()

    def campaign(self) -> None:
        """Start an election now (pre-vote first if enabled), as if the timer fired."""
        self._hup(transfer=False)

    def propose(self, data: bytes) -> int:
        """Append application data to the log as leader.

        Returns:
            The index of the new entry. It is committed once it comes back in
            `Ready.committed_entries` with the term this node had when proposing.

        Raises:
            ValueError: `data` is empty (empty entries are leaders' no-ops, which
                the state machine skips).
            NotLeaderError: This node is not the leader.
            ProposalDroppedError: A leadership transfer is in progress.
        """
        if not data:
            raise ValueError("empty proposals are reserved for leader no-ops")
        return self._propose(data, EntryKind.NORMAL)

    def propose_conf_change(self, change: ConfChange) -> int:
        """Propose adding or removing one voter.

        Raises:
            NotLeaderError: This node is not the leader.
            ProposalDroppedError: Another change is still unapplied, or this leader
                has not yet committed an entry of its own term (which single-server
                changes need to be safe across leader changes).
        """
        if self.role is not Role.LEADER:
            raise NotLeaderError(self.lead)
        if self.pending_conf_index > self.log.applied:
            raise ProposalDroppedError("a membership change is still being applied")
        if self.log.term(self.log.committed) != self.term:
            raise ProposalDroppedError("leader has not committed an entry of its term yet")
        index = self._propose(change.encode(), EntryKind.CONF_CHANGE)
        self.pending_conf_index = index
        return index

    def read_index(self, ctx: bytes) -> None:
        """Ask for a linearizable read; answered by a `ReadState` with the same `ctx`.

        The leader records its commit index and confirms with a heartbeat round
        that a quorum still follows it; a follower forwards the request to its
        leader. A request that cannot be confirmed (no leader, deposed leader,
        lost messages) is silently dropped: callers time out and retry.

        Args:
            ctx: A caller-chosen id, unique among outstanding reads.
        """
        if self.role is Role.LEADER:
            self._leader_read_index(ctx, self.id)
        elif self.lead is not None:
            self._send(Message(MessageType.READ_INDEX, self.id, self.lead, term=self.term, context=ctx))

    def transfer_leadership(self, target: int) -> None:
        """As leader, hand leadership to `target` once its log has caught up.

        Proposals are refused until the transfer finishes or is abandoned after
        an election timeout.
        """
        if self.role is not Role.LEADER or target == self.id or target not in self.voters:
            return
        if self.lead_transferee == target:
            return
        self.lead_transferee = target
        self._election_elapsed = 0
        if self.progress[target].match == self.log.last_index():
            self._send(Message(MessageType.TIMEOUT_NOW, self.id, target, term=self.term))
        else:
            self._send_append(target)

    def compact(self, data: bytes, keep: int = 0) -> Snapshot:
        """Record a state-machine snapshot at the applied index and drop older entries.

        The driver persists the returned snapshot (`Storage.compact`). The snapshot
        is also what the leader sends to followers that fall behind the log.

        Args:
            data: The state machine serialised as of `self.log.applied`.
            keep: Entries to keep before the applied index, so followers that are
                only a little behind still get entries rather than a snapshot.
        """
        index = self.log.applied
        term = self.log.term(index)
        assert term is not None
        snap = Snapshot(SnapshotMetadata(index, term, tuple(sorted(self.voters))), data)
        self.snapshot = snap
        self.log.compact(max(self.log.snapshot_index, index - keep))
        return snap

    def has_ready(self) -> bool:
        """Whether `ready()` would hand out any work."""
        return bool(
            self._msgs
            or self._read_states
            or self.log.pending_snapshot is not None
            or self.log.stable < self.log.last_index()
            or self.hard_state != self._prev_hard_state
            or self.soft_state != self._prev_soft_state
            or self.log.committed > max(self.log.applied, self.log.snapshot_index)
        )

    def ready(self) -> Ready:
        """The work accumulated since the last `advance` (see `Ready` for the order)."""
        hs = self.hard_state
        return Ready(
            soft_state=self.soft_state,
            hard_state=hs if hs != self._prev_hard_state else None,
            entries=self.log.unstable_entries(),
            snapshot=self.log.pending_snapshot,
            messages=list(self._msgs),
            committed_entries=self.log.next_committed_entries(),
            read_states=list(self._read_states),
        )

    def advance(self, rd: Ready) -> None:
        """The driver has persisted, sent and applied everything in `rd`."""
        if rd.hard_state is not None:
            self._prev_hard_state = rd.hard_state
        self._prev_soft_state = rd.soft_state
        if rd.snapshot is not None:
            if self.log.pending_snapshot is rd.snapshot:
                self.log.pending_snapshot = None
            self.log.applied = max(self.log.applied, rd.snapshot.metadata.index)
        if rd.entries:
            last = rd.entries[-1]
            # Only mark stable what is still in the log as persisted (a later step may
            # already have truncated and replaced these entries).
            if self.log.term(last.index) == last.term:
                self.log.stable = max(self.log.stable, last.index)
        del self._msgs[: len(rd.messages)]
        del self._read_states[: len(rd.read_states)]
        for entry in rd.committed_entries:
            self.log.applied = max(self.log.applied, entry.index)
            if entry.kind is EntryKind.CONF_CHANGE:
                self._apply_conf_change(ConfChange.decode(entry.data))

    def step(self, m: Message) -> None:
        """Process one message from a peer."""
        if m.dst != self.id:
            return
        if m.term > self.term:
            if m.type in (MessageType.VOTE, MessageType.PRE_VOTE):
                forced = m.context == _TRANSFER
                in_lease = (
                    self.config.check_quorum and self.lead is not None and self._election_elapsed < self._lease_ticks()
                )
                if in_lease and not forced:
                    # We heard from a live leader within the minimum election timeout:
                    # a vote request now comes from a node that was cut off; ignore it.
                    return
            if m.type is MessageType.PRE_VOTE:
                pass  # A pre-vote never changes our term.
            elif m.type is MessageType.PRE_VOTE_RESP and not m.reject:
                pass  # Granted pre-votes carry the future term; we bump it when we win.
            elif m.type in (MessageType.APPEND, MessageType.HEARTBEAT, MessageType.SNAPSHOT):
                self._become_follower(m.term, m.src)
            else:
                self._become_follower(m.term, None)
        elif m.term < self.term:
            if (self.config.check_quorum or self.config.pre_vote) and m.type in (
                MessageType.APPEND,
                MessageType.HEARTBEAT,
            ):
                # A stale leader that never hears a higher term would keep its
                # followers' pre-votes failing forever; tell it our term.
                self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term))
            elif m.type is MessageType.PRE_VOTE:
                self._send(Message(MessageType.PRE_VOTE_RESP, self.id, m.src, term=self.term, reject=True))
            return

        if m.type in (MessageType.VOTE, MessageType.PRE_VOTE):
            self._handle_vote_request(m)
            return
        if self.role is Role.LEADER:
            self._step_leader(m)
        elif self.role in (Role.CANDIDATE, Role.PRE_CANDIDATE):
            self._step_candidate(m)
        else:
            self._step_follower(m)

    # ------------------------------------------------------------------ roles

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = None
        self.lead = None
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self.quiesced = False
        self._randomized_timeout = self.config.election_tick + self._rng.randrange(self.config.election_tick)
        self.lead_transferee = None
        self._votes = {}
        self._pending_reads = {}
        self._read_queue = []
        self._deferred_reads = []
        last = self.log.last_index()
        self.progress = {v: Progress(match=0, next=last + 1) for v in self.voters}
        if self.id in self.progress:
            self.progress[self.id].match = last

    def _become_follower(self, term: int, lead: int | None) -> None:
        self._reset(term)
        self.lead = lead
        self.role = Role.FOLLOWER

    def _become_pre_candidate(self) -> None:
        # Term and vote stay: a pre-candidate changes nothing a restart would need.
        self._votes = {}
        self.lead = None
        self.role = Role.PRE_CANDIDATE

    def _become_candidate(self) -> None:
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = Role.CANDIDATE

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.lead = self.id
        self.role = Role.LEADER
        for pr in self.progress.values():
            pr.recent_active = True
        # No membership change until everything before this term is applied.
        self.pending_conf_index = self.log.last_index()
        # The no-op: entries of earlier terms commit only once one of ours does.
        self._append_entries([Entry(self.term, 0)])
        self._bcast_append()

    def _hup(self, transfer: bool) -> None:
        if self.role is Role.LEADER or not self.promotable():
            return
        lo = max(self.log.applied, self.log.snapshot_index) + 1
        for entry in self.log.slice(lo, self.log.committed + 1):
            if entry.kind is EntryKind.CONF_CHANGE:
                return  # Campaign only under the membership we will really have.
        if self.config.pre_vote and not transfer:
            self._campaign(MessageType.PRE_VOTE, transfer)
        else:
            self._campaign(MessageType.VOTE, transfer)

    def _campaign(self, kind: MessageType, transfer: bool) -> None:
        if kind is MessageType.PRE_VOTE:
            self._become_pre_candidate()
            vote_term = self.term + 1
        else:
            self._become_candidate()
            vote_term = self.term
        self._votes[self.id] = True
        if self._poll_result() is VoteResult.WON:
            self._on_election_won(kind)
            return
        for v in sorted(self.voters):
            if v == self.id:
                continue
            self._send(
                Message(
                    kind,
                    self.id,
                    v,
                    term=vote_term,
                    index=self.log.last_index(),
                    log_term=self.log.last_term(),
                    context=_TRANSFER if transfer else b"",
                )
            )

    def _on_election_won(self, kind: MessageType) -> None:
        if kind is MessageType.PRE_VOTE:
            self._campaign(MessageType.VOTE, transfer=False)
        else:
            self._become_leader()

    def _poll_result(self) -> VoteResult:
        return vote_result(self.voters, self._votes)

    def _handle_vote_request(self, m: Message) -> None:
        resp = MessageType.VOTE_RESP if m.type is MessageType.VOTE else MessageType.PRE_VOTE_RESP
        can_vote = (
            self.vote == m.src
            or (self.vote is None and self.lead is None)
            or (m.type is MessageType.PRE_VOTE and m.term > self.term)
        )
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            # Grants carry the requested term, so a pre-candidate counts them.
            self._send(Message(resp, self.id, m.src, term=m.term))
            if m.type is MessageType.VOTE:
                self._election_elapsed = 0
                self.vote = m.src
        else:
            self._send(Message(resp, self.id, m.src, term=self.term, reject=True))

    def _step_candidate(self, m: Message) -> None:
        expected = MessageType.PRE_VOTE_RESP if self.role is Role.PRE_CANDIDATE else MessageType.VOTE_RESP
        if m.type is MessageType.APPEND:
            self._become_follower(m.term, m.src)
            self._handle_append(m)
        elif m.type is MessageType.HEARTBEAT:
            self._become_follower(m.term, m.src)
            self._handle_heartbeat(m)
        elif m.type is MessageType.SNAPSHOT:
            self._become_follower(m.term, m.src)
            self._handle_snapshot(m)
        elif m.type is expected:
            self._votes.setdefault(m.src, not m.reject)
            result = self._poll_result()
            if result is VoteResult.WON:
                self._on_election_won(_request_type(expected))
            elif result is VoteResult.LOST:
                self._become_follower(self.term, None)

    def _step_follower(self, m: Message) -> None:
        if m.type is MessageType.APPEND:
            self._election_elapsed = 0
            self.lead = m.src
            self._handle_append(m)
        elif m.type is MessageType.HEARTBEAT:
            self._election_elapsed = 0
            self.lead = m.src
            self._handle_heartbeat(m)
        elif m.type is MessageType.SNAPSHOT:
            self._election_elapsed = 0
            self.lead = m.src
            self._handle_snapshot(m)
        elif m.type is MessageType.TIMEOUT_NOW:
            self._hup(transfer=True)
        elif m.type is MessageType.READ_INDEX:
            if self.lead is not None:
                self._send(Message(MessageType.READ_INDEX, self.id, self.lead, term=self.term, context=m.context))
        elif m.type is MessageType.READ_INDEX_RESP:
            self._read_states.append(ReadState(m.index, m.context))

    def _step_leader(self, m: Message) -> None:
        if m.type is MessageType.READ_INDEX:
            self._leader_read_index(m.context, m.src)
            return
        pr = self.progress.get(m.src)
        if pr is None:
            return
        if m.type is MessageType.APPEND_RESP:
            pr.recent_active = True
            self._handle_append_resp(m, pr)
        elif m.type is MessageType.HEARTBEAT_RESP:
            pr.recent_active = True
            pr.probe_sent = False
            if pr.state is ProgressState.REPLICATE and pr.is_paused():
                # A full window with the follower still answering: the APPENDs were
                # lost (or the follower restarted). Probe again from its match.
                pr.become_probe()
            elif pr.state is ProgressState.SNAPSHOT:
                pr.snapshot_heartbeats += 1
                if pr.snapshot_heartbeats >= _SNAPSHOT_RETRY_HEARTBEATS:
                    pr.become_probe()
            if pr.match < self.log.last_index():
                self._send_append(m.src)
            if m.context:
                self._ack_read(m.context, m.src)

    # ------------------------------------------------------------------ leader

    def _propose(self, data: bytes, kind: EntryKind) -> int:
        if self.role is not Role.LEADER:
            raise NotLeaderError(self.lead)
        if self.lead_transferee is not None:
            raise ProposalDroppedError("leadership transfer in progress")
        if self.id not in self.progress:
            raise ProposalDroppedError("this leader was removed from the cluster")
        self._append_entries([Entry(self.term, 0, data, kind)])
        self._bcast_append()
        return self.log.last_index()

    def _append_entries(self, entries: list[Entry]) -> None:
        if self.quiesced:
            # Something to replicate: heartbeat at the usual rate again (the APPENDs wake the followers),
            # and start a fresh quorum window of the usual length, which the replies to them will fill.
            self.quiesced = False
            self._election_elapsed = 0
        last = self.log.last_index()
        stamped = [Entry(self.term, last + 1 + i, e.data, e.kind) for i, e in enumerate(entries)]
        self.log.append(stamped)
        # The leader's own copy counts toward the quorum: the driver persists it
        # before acting on any commit this Ready reports.
        self.progress[self.id].maybe_update(self.log.last_index())
        self._maybe_commit()

    def _maybe_commit(self) -> bool:
        match = {v: pr.match for v, pr in self.progress.items()}
        committed = self.log.maybe_commit(committed_index(self.voters, match), self.term)
        if committed:
            self._release_deferred_reads()
        return committed

    def _bcast_append(self) -> None:
        for v in sorted(self.progress):
            if v != self.id:
                self._send_append(v)

    def _bcast_heartbeat(self) -> None:
        ctx = self._read_queue[-1] if self._read_queue else b""
        for v in sorted(self.progress):
            if v == self.id:
                continue
            # Never claim a commit index the follower may not have the entries for.
            commit = min(self.progress[v].match, self.log.committed)
            self._send(
                Message(
                    MessageType.HEARTBEAT,
                    self.id,
                    v,
                    term=self.term,
                    commit=commit,
                    context=ctx,
                    quiesce=self.quiesced,
                )
            )

    def _can_quiesce(self) -> bool:
        """Whether there is nothing for this leader to replicate, confirm or hand over."""
        last = self.log.last_index()
        return (
            self.config.quiesce
            and self.lead_transferee is None
            and not self._pending_reads
            and not self._deferred_reads
            and self.log.committed == last
            and all(pr.match == last for pr in self.progress.values())
        )

    def _send_append(self, to: int, send_if_empty: bool = True) -> bool:
        pr = self.progress[to]
        if pr.is_paused():
            return False
        prev = pr.next - 1
        prev_term = self.log.term(prev)
        if prev_term is None or (prev < self.log.snapshot_index):
            if self.snapshot is None:
                raise AssertionError("log compacted without a snapshot")
            self._send(Message(MessageType.SNAPSHOT, self.id, to, term=self.term, snapshot=self.snapshot))
            pr.become_snapshot(self.snapshot.metadata.index)
            return True
        entries = self.log.slice(pr.next, pr.next + self.config.max_entries_per_message)
        if not entries and not send_if_empty:
            return False
        self._send(
            Message(
                MessageType.APPEND,
                self.id,
                to,
                term=self.term,
                index=prev,
                log_term=prev_term,
                entries=tuple(entries),
                commit=self.log.committed,
            )
        )
        if entries:
            if pr.state is ProgressState.REPLICATE:
                pr.next = entries[-1].index + 1
            elif pr.state is ProgressState.PROBE:
                pr.probe_sent = True
        return True

    def _handle_append_resp(self, m: Message, pr: Progress) -> None:
        if m.reject:
            next_probe = m.reject_hint
            if m.log_term > 0:
                next_probe, _ = self.log.find_conflict_by_term(m.reject_hint, m.log_term)
            if pr.maybe_decr_to(m.index, next_probe):
                if pr.state is ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(m.src)
            return
        old_paused = pr.is_paused()
        if not pr.maybe_update(m.index):
            return
        if pr.state is ProgressState.PROBE:
            pr.become_replicate()
        elif pr.state is ProgressState.SNAPSHOT and pr.match >= pr.pending_snapshot:
            pr.become_probe()
            pr.become_replicate()
        if self._maybe_commit():
            self._bcast_append()
        elif old_paused:
            self._send_append(m.src)
        # Stream the rest of a long backlog without waiting for a heartbeat.
        while self._send_append(m.src, send_if_empty=False):
            if pr.state is not ProgressState.REPLICATE:
                break
        if m.src == self.lead_transferee and pr.match == self.log.last_index():
            self._send(Message(MessageType.TIMEOUT_NOW, self.id, m.src, term=self.term))

    def _leader_read_index(self, ctx: bytes, src: int) -> None:
        if self.log.term(self.log.committed) != self.term:
            # The commit index may lag entries committed by earlier leaders until
            # we commit one of our own (thesis §6.4 step 1): hold the read.
            self._deferred_reads.append((ctx, src))
            return
        if len(self.voters) == 1 and self.id in self.voters:
            self._answer_read(ReadState(self.log.committed, ctx), src)
            return
        if ctx in self._pending_reads:
            return
        self._pending_reads[ctx] = _PendingRead(self.log.committed, src, {self.id})
        self._read_queue.append(ctx)
        self._bcast_heartbeat()

    def _release_deferred_reads(self) -> None:
        if self._deferred_reads and self.log.term(self.log.committed) == self.term:
            deferred, self._deferred_reads = self._deferred_reads, []
            for ctx, src in deferred:
                self._leader_read_index(ctx, src)

    def _ack_read(self, ctx: bytes, src: int) -> None:
        req = self._pending_reads.get(ctx)
        if req is None:
            return
        req.acks.add(src)
        if sum(1 for v in self.voters if v in req.acks) < majority(self.voters):
            return
        # A heartbeat confirming `ctx` confirms every read queued before it too.
        pos = self._read_queue.index(ctx)
        done, self._read_queue = self._read_queue[: pos + 1], self._read_queue[pos + 1 :]
        for c in done:
            r = self._pending_reads.pop(c)
            self._answer_read(ReadState(r.index, c), r.src)

    def _answer_read(self, rs: ReadState, src: int) -> None:
        if src == self.id:
            self._read_states.append(rs)
        else:
            self._send(
                Message(
                    MessageType.READ_INDEX_RESP,
                    self.id,
                    src,
                    term=self.term,
                    index=rs.index,
                    context=rs.request_ctx,
                )
            )

    # ------------------------------------------------------------------ follower

    def _follow_quiesced(self, quiesced: bool) -> None:
        """The leader is (no longer) quiesced: wait the election timeout that goes with its heartbeats."""
        if quiesced == self.quiesced:
            return
        self.quiesced = quiesced
        self._ack_quiet = False
        base = self.config.quiesced_election_tick if quiesced else self.config.election_tick
        self._randomized_timeout = base + self._rng.randrange(base)

    def _handle_append(self, m: Message) -> None:
        self._follow_quiesced(False)
        if m.index < self.log.committed:
            self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term, index=self.log.committed))
            return
        last_new = self.log.maybe_append(m.index, m.log_term, m.commit, m.entries)
        if last_new is not None:
            self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term, index=last_new))
            return
        hint = min(m.index, self.log.last_index())
        hint, hint_term = self.log.find_conflict_by_term(hint, m.log_term)
        self._send(
            Message(
                MessageType.APPEND_RESP,
                self.id,
                m.src,
                term=self.term,
                index=m.index,
                reject=True,
                reject_hint=hint,
                log_term=hint_term,
            )
        )

    def _handle_heartbeat(self, m: Message) -> None:
        self._follow_quiesced(m.quiesce and self.config.quiesce)
        self.log.commit_to(min(m.commit, self.log.last_index()))
        if self.quiesced and not m.context:
            # A quiesced leader checks its quorum over two quiesced election timeouts: an answer to every
            # other heartbeat is plenty, and halves what an idle shard sends. A read's heartbeat is answered.
            self._ack_quiet = not self._ack_quiet
            if not self._ack_quiet:
                return
        self._send(Message(MessageType.HEARTBEAT_RESP, self.id, m.src, term=self.term, context=m.context))

    def _handle_snapshot(self, m: Message) -> None:
        self._follow_quiesced(False)
        assert m.snapshot is not None
        meta = m.snapshot.metadata
        if meta.index <= self.log.committed:
            self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term, index=self.log.committed))
            return
        if self.log.match_term(meta.index, meta.term):
            # We already have the entries the snapshot covers: just commit them.
            self.log.commit_to(meta.index)
            self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term, index=self.log.committed))
            return
        self.log.restore(m.snapshot)
        self.snapshot = m.snapshot
        self.voters = set(meta.voters)
        self.pending_conf_index = 0
        last = self.log.last_index()
        self.progress = {v: Progress(match=0, next=last + 1) for v in self.voters}
        self._send(Message(MessageType.APPEND_RESP, self.id, m.src, term=self.term, index=last))

    # ------------------------------------------------------------------ timers, membership

    def _tick_election(self) -> None:
        self._election_elapsed += 1
        if self.promotable() and self._election_elapsed >= self._randomized_timeout:
            self._election_elapsed = 0
            self._hup(transfer=False)

    def _heartbeat_interval(self) -> int:
        return self.config.quiesced_heartbeat_tick if self.quiesced else self.config.heartbeat_tick

    def _lease_ticks(self) -> int:
        """How long a leader is presumed alive after it was last heard from (the leader: its quorum window).

        A quiesced leader's window is twice its followers' election timeout: they answer every other of
        its heartbeats only, and a window must hold a few answers.
        """
        if not self.quiesced:
            return self.config.election_tick
        return self.config.quiesced_election_tick * (2 if self.role is Role.LEADER else 1)

    def _tick_heartbeat(self) -> None:
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self._lease_ticks():
            self._election_elapsed = 0
            if self.config.check_quorum:
                active = {v for v, pr in self.progress.items() if pr.recent_active or v == self.id}
                if sum(1 for v in self.voters if v in active) < majority(self.voters):
                    self._become_follower(self.term, None)
                    return
                for v, pr in self.progress.items():
                    pr.recent_active = v == self.id
            if self.lead_transferee is not None:
                self.lead_transferee = None  # The transfer timed out; take proposals again.
        if self._heartbeat_elapsed >= self._heartbeat_interval():
            self._heartbeat_elapsed = 0
            if not self.quiesced and self._can_quiesce():
                # This heartbeat carries the final commit index and tells the followers to slow down with us.
                self.quiesced = True
            self._bcast_heartbeat()

    def _apply_conf_change(self, cc: ConfChange) -> None:
        if cc.type is ConfChangeType.ADD_NODE:
            self.voters.add(cc.node_id)
            if self.role is Role.LEADER and cc.node_id not in self.progress:
                self.progress[cc.node_id] = Progress(match=0, next=self.log.last_index() + 1, recent_active=True)
        else:
            self.voters.discard(cc.node_id)
            self.progress.pop(cc.node_id, None)
            if cc.node_id == self.lead_transferee:
                self.lead_transferee = None
        if self.role is not Role.LEADER:
            return
        if self.id not in self.voters:
            # A removed leader stops leading; the remaining voters elect a successor.
            self._become_follower(self.term, None)
            return
        # A smaller quorum may commit what a larger one could not; a new voter
        # needs entries either way.
        self._maybe_commit()
        self._bcast_append()

    def _send(self, m: Message) -> None:
        self._msgs.append(m)
