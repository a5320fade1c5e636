"""The driver of one metadata-shard node: a thread that runs the Raft core.

`MetaNode` owns the core, its LMDB storage, the transport and the state
machine. Exactly one thread (the Raft thread) touches them. Everything else
talks to it through one bounded queue of events:

* messages from peers (`deliver`; dropped when the queue is full, Raft
  re-sends),
* client commands (`propose`), linearizable reads (`read`), cache-node
  heartbeats (`heartbeat`) and local inspections (`inspect`), each answered
  through a `concurrent.futures.Future`.

Each turn of the loop takes every queued event, ticks the core by the real
clock, turns all waiting client commands into as few log entries as fit
(proposal batching: one entry, one fsync and one replication round for many
writes), starts one ReadIndex round for all waiting reads, and then handles
the core's `Ready` in the required order: persist (fsync), send, apply,
serve reads, advance. Heartbeats are buffered by the leader and replicated
as one command every `heartbeat_flush_ms`.

The core quiesces (`Config.quiesce`): once everything is replicated and
committed and nothing is proposed, the leader heartbeats every
`QUIESCED_HEARTBEAT_MS` instead of every `heartbeat_tick`, and its followers
wait `QUIESCED_ELECTION_MS` (randomised up to twice that) before they
campaign (and answer every other quiet heartbeat), so an idle shard costs a
heartbeat round every 500 ms and a dead idle leader is replaced within about
1.7 s (docs/reliability.md promises 2 s; bench/idle.py measures it).
The loop sleeps until the core is next due (a leader with no cache-node beat
buffered: until then or the first lease to run out), so quiet nodes sleep.

Failpoints (`cachesvc.meta.failpoint`) sit around every persist.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cacheclient.wire import meta_pb2 as pb
from cachesvc.config import NodeConfig
from cachesvc.meta.failpoint import failpoint
from cachesvc.meta.raft import (
    Config,
    EntryKind,
    HardState,
    LmdbStorage,
    LogFullError,
    MessageType,
    NotLeaderError,
    ProposalDroppedError,
    RaftCore,
    Ready,
    Role,
    Snapshot,
    SnapshotMetadata,
)
from cachesvc.meta.state import HeartbeatBatcher, MetaState, encode_batch
from cachesvc.meta.transport import Transport

__all__ = ["LogFullRefusal", "MetaNode", "NodeInfo", "OutcomeUnknownError", "OverloadedError"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutcomeUnknownError(Exception):
    """A command may or may not have been applied (leadership changed meanwhile).

    Retrying with the same request id is safe: the state machine applies a
    request id once.
    """


class OverloadedError(Exception):
    """The node's event queue is full."""


class LogFullRefusal(OverloadedError):
    """A proposal refused: the Raft log has no room for it, even after compacting what is applied.

    Room comes back once entries commit and apply (a quorum is needed) and
    the next compaction drops them.
    """


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the node reports without a consensus round (updated by the Raft thread)."""

    id: int
    role: Role = Role.FOLLOWER
    term: int = 0
    leader: int | None = None
    commit: int = 0
    applied: int = 0
    last_index: int = 0
    snapshot_index: int = 0
    quiesced: bool = False
    """Leader: it heartbeats at the quiesced rate. Follower: its leader said it does."""


@dataclass(slots=True)
class _Waiting:
    """Client requests whose commands went into one proposed entry."""

    term: int
    requests: list[tuple[Future[list[pb.CommandResult]], int]] = field(default_factory=list)


@dataclass(slots=True)
class _ReadRound:
    started: float
    reads: list[tuple[Callable[[MetaState], Any], Future[Any]]]
    index: int | None = None


_STALL_TICKS = 5
"""A wake-up this many ticks past the plan is a stall (CPU starvation, a pause), not a sleep: it ticks once."""
_READ_ROUND_POLL = 0.05
"""Seconds between checks for expired ReadIndex rounds while any is pending."""
QUIESCED_HEARTBEAT_MS = 500
"""A quiesced leader's heartbeat interval (never shorter than the configured heartbeat)."""
QUIESCED_ELECTION_MS = 800
"""A quiesced leader's followers' base election timeout (randomised up to twice it; never shorter than the
configured one). Twice it plus an election round is the failover time of an idle shard: within the 2 s promised."""


def core_config(cfg: NodeConfig) -> Config:
    """The Raft core's settings for a node: its timing in ticks, quiescence on."""
    quiet_hb = max(cfg.heartbeat_tick, -(-QUIESCED_HEARTBEAT_MS // cfg.tick_ms))
    quiet_election = max(cfg.election_tick, -(-QUIESCED_ELECTION_MS // cfg.tick_ms), 2 * quiet_hb + 1)
    return Config(
        cfg.id,
        election_tick=cfg.election_tick,
        heartbeat_tick=cfg.heartbeat_tick,
        quiesce=True,
        quiesced_heartbeat_tick=quiet_hb,
        quiesced_election_tick=quiet_election,
    )


class MetaNode:
    """One node of the metadata shard; see the module docstring."""

    def __init__(self, cfg: NodeConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.state = MetaState()
        self.info = NodeInfo(cfg.id)
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=cfg.queue_size)
        self._stop = threading.Event()
        self.failed: BaseException | None = None
        """Set when the Raft thread died; the node is unusable (and `serve` exits)."""
        self._thread: threading.Thread | None = None
        self._storage: LmdbStorage | None = None
        self._core: RaftCore | None = None
        self._transport: Transport | None = None
        self._commands: list[tuple[list[pb.Command], Future[list[pb.CommandResult]]]] = []
        self._waiting: dict[int, _Waiting] = {}
        self._new_reads: list[tuple[Callable[[MetaState], Any], Future[Any]]] = []
        self._read_rounds: dict[bytes, _ReadRound] = {}
        self._read_ids = itertools.count(1)
        self._heartbeats = HeartbeatBatcher(cfg.lease_ms)
        self._last_flush = 0.0
        self._last_snapshot_index = 0
        self._persisted_vote: tuple[int, int | None] = (0, None)
        self._persisted_hs = HardState()
        self._latest_hs = HardState()
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "entries_proposed",
                "commands_proposed",
                "persists",
                "elections_won",
                "snapshots",
                "snapshots_installed",
                "proposals_refused_log_full",
                "log_full_compactions",
                "raft_messages_sent",
                "heartbeats_sent",
            ),
            0,
        )
        """Counters the Raft thread keeps (read by the Status RPC and the metrics)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover from storage and start the Raft thread."""
        cfg = self.cfg
        self._storage = LmdbStorage(cfg.data_dir, map_size=cfg.log_map_bytes)
        hs, snap, entries = self._storage.load()
        rng = random.Random(cfg.seed) if cfg.seed is not None else random.Random()
        core_cfg = core_config(cfg)
        self._core = RaftCore(core_cfg, sorted(cfg.peers), rng, hs, snap, entries)
        self._persisted_vote = (hs.term, hs.vote)
        self._persisted_hs = self._latest_hs = hs
        if snap is not None:
            self.state.restore(snap.data)
            self._last_snapshot_index = snap.metadata.index
        self._transport = Transport(
            {i: a for i, a in cfg.peers.items() if i != cfg.id},
            peer_token=cfg.peer_token,
            tls_ca=Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None,
        )
        self._publish()
        log.info(
            "meta node %d recovered term=%d commit=%d snapshot=%d entries=%d",
            cfg.id,
            hs.term,
            hs.commit,
            snap.metadata.index if snap else 0,
            len(entries),
        )
        self._thread = threading.Thread(target=self._run, name=f"raft-{cfg.id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the Raft thread and release storage and connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._transport is not None:
            self._transport.close()
        if self._storage is not None:
            self._storage.close()

    def address_of(self, node_id: int | None) -> str:
        """The address of a member, or "" for None or an unknown id."""
        return self.cfg.peers.get(node_id, "") if node_id is not None else ""

    # ------------------------------------------------------------------ thread-safe API

    def _submit(self, kind: str, payload: Any) -> None:
        try:
            self._events.put((kind, payload), timeout=1.0)
        except queue.Full:
            raise OverloadedError("metadata node overloaded: event queue full") from None

    def deliver(self, messages: Sequence[Any]) -> None:
        """Queue messages from a peer; drops them when the queue is full."""
        with contextlib.suppress(queue.Full):
            self._events.put_nowait(("msgs", messages))

    def propose(self, commands: list[pb.Command]) -> Future[list[pb.CommandResult]]:
        """Replicate and apply `commands`; the future gets one result per command.

        The future fails with `NotLeaderError` (with a leader hint),
        `ProposalDroppedError` (not applied; retry), or `OutcomeUnknownError`.
        """
        self._check_leader()
        fut: Future[list[pb.CommandResult]] = Future()
        self._submit("propose", (commands, fut))
        return fut

    def read(self, fn: Callable[[MetaState], T]) -> Future[T]:
        """Evaluate `fn` on the state once a ReadIndex round confirms it is current.

        `fn` runs on the Raft thread and must be quick; it sees every write
        acknowledged before `read` was called.
        """
        fut: Future[T] = Future()
        self._submit("read", (fn, fut))
        return fut

    def inspect(self, fn: Callable[[MetaNode], T]) -> Future[T]:
        """Evaluate `fn` on this node, on the Raft thread, without a consensus round."""
        fut: Future[T] = Future()
        self._submit("inspect", (fn, fut))
        return fut

    def heartbeat(self, beats: Sequence[pb.NodeHeartbeat]) -> int:
        """Buffer cache-node heartbeats (leader only); returns the lease they buy, in ms.

        Raises:
            NotLeaderError: this node does not lead.
        """
        self._check_leader()
        self._submit("beats", list(beats))
        return self.cfg.lease_ms

    def transfer_leadership(self, target: int) -> None:
        """Ask the core to hand leadership to `target` (if this node leads)."""
        self._submit("transfer", target)

    def hand_over_leadership(self, wait: float) -> None:
        """If this node leads, transfer leadership to its most caught-up peer; wait up to `wait` s for it."""

        def best_peer(node: MetaNode) -> int | None:
            core = node._core
            if core is None or core.role is not Role.LEADER:
                return None
            peers = [(pr.match, v) for v, pr in core.progress.items() if v != node.cfg.id]
            return max(peers)[1] if peers else None

        try:
            target = self.inspect(best_peer).result(timeout=1.0)
        except Exception:
            return
        if target is None:
            return
        self.transfer_leadership(target)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.info.role is Role.LEADER:
            time.sleep(0.01)

    def _check_leader(self) -> None:
        info = self.info
        if info.role is not Role.LEADER:
            raise NotLeaderError(info.leader)

    # ------------------------------------------------------------------ the Raft thread

    def _run(self) -> None:
        core = self._core
        assert core is not None
        tick = self.cfg.tick_ms / 1000.0
        last_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                busy = bool(self._commands)
                # Sleep until the core is next due (not every tick: an idle node wakes for its heartbeats,
                # elections and quorum checks only), or an event; the leader's buffered cache-node beats and
                # lease expiries, and pending reads, are looked at on their own clocks.
                planned = core.ticks_until_due()
                wake_at = last_tick + planned * tick
                if core.is_leader:
                    wake_at = min(wake_at, self._flush_due())
                if self._read_rounds:
                    wake_at = min(wake_at, time.monotonic() + _READ_ROUND_POLL)
                timeout = 0.0 if busy else max(0.0, wake_at - time.monotonic())
                try:
                    events = [self._events.get(timeout=timeout)]
                except queue.Empty:
                    events = []
                if events:
                    for _ in range(self.cfg.queue_size):
                        try:
                            events.append(self._events.get_nowait())
                        except queue.Empty:
                            break
                for kind, payload in events:
                    self._handle_event(core, kind, payload)
                now = time.monotonic()
                elapsed = int((now - last_tick) / tick)
                if elapsed > planned + _STALL_TICKS:
                    # A loop stalled well past its plan ticks once: elapsed time only
                    # drives elections here, and catching up would start one at once.
                    core.tick()
                    last_tick = now
                elif elapsed:
                    # The ticks slept through (at most up to what was due) change only counters until the last.
                    for _ in range(min(elapsed, planned)):
                        core.tick()
                    last_tick += elapsed * tick
                if core.is_leader:
                    self._flush_heartbeats(core, now)
                self._propose_commands(core)
                self._start_read_round(core, now)
                self._process_ready(core)
                self._expire_read_rounds(now)
        except BaseException as exc:
            # Raft assumes fail-stop: a node whose loop died must not keep answering.
            log.exception("raft thread of node %d died", self.cfg.id)
            self.failed = exc
            self._stop.set()

    def _handle_event(self, core: RaftCore, kind: str, payload: Any) -> None:
        if kind == "msgs":
            for m in payload:
                core.step(m)
        elif kind == "propose":
            self._commands.append(payload)
            # A beat buffered before a node's state is set (a graceful leave marks it down) must not be
            # replicated after it: applied later, it would mark the node up again for a whole lease.
            for cmd in payload[0]:
                if cmd.WhichOneof("op") in ("set_node_state", "remove_node"):
                    self._heartbeats.discard(getattr(cmd, cmd.WhichOneof("op")).address)
        elif kind == "read":
            self._new_reads.append(payload)
        elif kind == "beats":
            if core.is_leader:
                for beat in payload:
                    self._heartbeats.add(beat.address, beat.used_bytes)
        elif kind == "inspect":
            fn, fut = payload
            try:
                fut.set_result(fn(self))
            except Exception as exc:
                fut.set_exception(exc)
        elif kind == "transfer":
            core.transfer_leadership(payload)

    def _flush_due(self) -> float:
        """When (monotonic) the leader next has cache-node beats to replicate or a lease to expire."""
        flush_at = self._last_flush + self.cfg.heartbeat_flush_ms / 1000.0
        if len(self._heartbeats):
            return flush_at
        # Nothing buffered: an idle leader sleeps until the first lease runs out (if any does), not every flush.
        expiries = [n.lease_expiry_ms for n in self.state.nodes.values() if n.state != pb.NODE_STATE_DOWN]
        expiries = [e for e in expiries if e > 0]
        if not expiries:
            return float("inf")
        return max(flush_at, time.monotonic() + (min(expiries) - _now_ms() + 2) / 1000.0)

    def _flush_heartbeats(self, core: RaftCore, now: float) -> None:
        if (now - self._last_flush) * 1000 < self.cfg.heartbeat_flush_ms:
            return
        self._last_flush = now
        cmd = self._heartbeats.flush()
        if cmd is None and self.state.expired_nodes(_now_ms()):
            # Nothing to extend, but a lease ran out: an empty batch carries the
            # leader's clock into the log, and applying it marks the node down.
            cmd = pb.Command(heartbeats=pb.Heartbeats(lease_ms=self.cfg.lease_ms))
        if cmd is not None:
            try:
                core.propose(encode_batch(_now_ms(), [cmd]))
                self.stats["entries_proposed"] += 1
            except ProposalDroppedError:
                pass

    def _propose_commands(self, core: RaftCore) -> None:
        if not self._commands:
            return
        if not self.cfg.batching:
            # One request, one entry, one fsync: the baseline without batching.
            cmds, fut = self._commands.pop(0)
            self._propose_entry(core, [(cmds, fut)])
            return
        pending, self._commands = self._commands, []
        group: list[tuple[list[pb.Command], Future[list[pb.CommandResult]]]] = []
        n = size = 0
        for cmds, fut in pending:
            req_size = sum(c.ByteSize() for c in cmds)
            if group and (n + len(cmds) > self.cfg.max_batch_commands or size + req_size > self.cfg.max_batch_bytes):
                self._propose_entry(core, group)
                group, n, size = [], 0, 0
            group.append((cmds, fut))
            n += len(cmds)
            size += req_size
        if group:
            self._propose_entry(core, group)

    def _propose_entry(
        self, core: RaftCore, group: list[tuple[list[pb.Command], Future[list[pb.CommandResult]]]]
    ) -> None:
        commands = [c for cmds, _ in group for c in cmds]
        data = encode_batch(_now_ms(), commands)
        if not self._room_for(core, len(data)):
            refusal = LogFullRefusal(
                f"raft log full ({self.cfg.log_map_bytes} bytes, log_map_bytes): proposal of {len(data)} bytes refused"
                " until committed entries are compacted; retry later"
            )
            self.stats["proposals_refused_log_full"] += 1
            for _, fut in group:
                fut.set_exception(refusal)
            return
        try:
            index = core.propose(data)
        except ProposalDroppedError as exc:
            for _, fut in group:
                fut.set_exception(exc)
            return
        self.stats["entries_proposed"] += 1
        self.stats["commands_proposed"] += len(commands)
        self._waiting[index] = _Waiting(core.term, [(fut, len(cmds)) for cmds, fut in group])

    def _start_read_round(self, core: RaftCore, now: float) -> None:
        if not self._new_reads:
            return
        reads, self._new_reads = self._new_reads, []
        if core.lead is None:
            for _, fut in reads:
                fut.set_exception(NotLeaderError(None))
            return
        # One ReadIndex round (one heartbeat broadcast) confirms every read queued.
        ctx = f"{self.cfg.id}/{next(self._read_ids)}".encode()
        self._read_rounds[ctx] = _ReadRound(now, reads)
        core.read_index(ctx)

    def _expire_read_rounds(self, now: float) -> None:
        for ctx, rnd in list(self._read_rounds.items()):
            # Unconfirmed, or confirmed but this node's state is not catching up
            # (cut off from the leader): the callers retry elsewhere.
            if now - rnd.started > self.cfg.read_timeout:
                del self._read_rounds[ctx]
                for _, fut in rnd.reads:
                    fut.set_exception(ProposalDroppedError("read not served in time"))

    def _serve_reads(self) -> None:
        applied = self.state.applied_index
        for ctx, rnd in list(self._read_rounds.items()):
            if rnd.index is not None and rnd.index <= applied:
                del self._read_rounds[ctx]
                for fn, fut in rnd.reads:
                    try:
                        fut.set_result(fn(self.state))
                    except Exception as exc:
                        fut.set_exception(exc)

    def _process_ready(self, core: RaftCore) -> None:
        assert self._storage is not None and self._transport is not None
        was_leader = self.info.role is Role.LEADER
        while core.has_ready():
            rd = core.ready()
            self._persist(rd)
            self._transport.send(rd.messages)
            self.stats["raft_messages_sent"] += len(rd.messages)
            self.stats["heartbeats_sent"] += sum(1 for m in rd.messages if m.type is MessageType.HEARTBEAT)
            if rd.snapshot is not None:
                self.state.restore(rd.snapshot.data)
                self._last_snapshot_index = rd.snapshot.metadata.index
                self.stats["snapshots_installed"] += 1
                self._fail_waiting_upto(rd.snapshot.metadata.index)
            for entry in rd.committed_entries:
                self._apply(entry.index, entry.term, entry.data if entry.kind is EntryKind.NORMAL else b"")
            for rs in rd.read_states:
                rnd = self._read_rounds.get(rs.request_ctx)
                if rnd is not None:
                    rnd.index = rs.index
            core.advance(rd)
            self._serve_reads()
            self._maybe_snapshot(core)
        if core.is_leader and not was_leader:
            self.stats["elections_won"] += 1
            # A fresh lease for every cache node not down, replicated at once: their beats could not reach
            # anyone while there was no leader (an idle shard's election takes up to about 1.7 s, most of a
            # lease), and the first entry applied with this leader's clock would otherwise mark them all down.
            for node in self.state.nodes.values():
                if node.state not in (pb.NODE_STATE_DOWN, pb.NODE_STATE_JOINING):
                    self._heartbeats.add(node.address, node.used_bytes)
            self._last_flush = 0.0
            log.info("node %d leads in term %d", self.cfg.id, core.term)
        if not core.is_leader:
            self._heartbeats.clear()
            if self._commands:
                for _, fut in self._commands:
                    fut.set_exception(NotLeaderError(core.lead))
                self._commands = []
        if self.info.role is not core.role or self.info.leader != core.lead:
            # Leadership moved: reads waiting for a ReadIndex answer will not get one.
            for ctx, rnd in list(self._read_rounds.items()):
                if rnd.index is None:
                    del self._read_rounds[ctx]
                    for _, fut in rnd.reads:
                        fut.set_exception(NotLeaderError(core.lead))
        self._publish()

    def _persist(self, rd: Ready) -> None:
        assert self._storage is not None
        if rd.hard_state is not None:
            self._latest_hs = rd.hard_state
        hs = self._latest_hs
        term_or_vote = (hs.term, hs.vote) != self._persisted_vote
        vote = term_or_vote and hs.vote is not None
        if not (rd.entries or rd.snapshot is not None or term_or_vote):
            # Only the commit index moved. Losing it in a crash is safe (the leader
            # tells a restarted node again), so it rides along with the next write
            # that must be durable instead of costing an fsync of its own.
            return
        points = [
            name
            for name, hit in (("snapshot", rd.snapshot is not None), ("vote", vote), ("append", bool(rd.entries)))
            if hit
        ]
        for name in points:
            failpoint(f"before-{name}")
        # Every entry up to this hard state's commit is in the log already or in
        # `rd.entries`, so the saved commit never points past the saved log.
        try:
            self._storage.save(hs if hs != self._persisted_hs else None, rd.entries, rd.snapshot)
        except LogFullError:
            # Entries from the leader, or a proposal the headroom check let through: make room
            # by dropping what is applied, then try once more (a second failure stops the node).
            log.warning("meta node %d: raft log full; compacting the applied entries", self.cfg.id)
            self._compact_storage()
            self._storage.save(hs if hs != self._persisted_hs else None, rd.entries, rd.snapshot)
        self.stats["persists"] += 1
        self._persisted_hs = hs
        self._persisted_vote = (hs.term, hs.vote)
        for name in points:
            failpoint(f"after-{name}")

    def _apply(self, index: int, term: int, data: bytes) -> None:
        results = self.state.apply(index, data)
        waiting = self._waiting.pop(index, None)
        if waiting is None:
            return
        if waiting.term != term:
            # Another leader's entry took this index: ours was never committed.
            for fut, _ in waiting.requests:
                fut.set_exception(ProposalDroppedError("leadership changed before the write committed"))
            return
        pos = 0
        for fut, n in waiting.requests:
            fut.set_result(results[pos : pos + n])
            pos += n

    def _fail_waiting_upto(self, index: int) -> None:
        for i in [i for i in self._waiting if i <= index]:
            for fut, _ in self._waiting.pop(i).requests:
                fut.set_exception(OutcomeUnknownError("state replaced by a snapshot; retry with the same request id"))

    def _room_for(self, core: RaftCore, size: int) -> bool:
        """Whether the log has room for a new entry of `size` bytes, compacting what is applied if not."""
        assert self._storage is not None
        # Twice the entry (overflow pages, a follower's copy in flight) plus slack for the B-tree.
        need = 2 * size + (1 << 20)
        if self._storage.headroom() >= need:
            return True
        self._compact_storage()
        return self._storage.headroom() >= need

    def _compact_storage(self) -> None:
        """Drop the stored entries the state has applied, behind a snapshot of the state.

        Only the storage is compacted; the core's in-memory log is left as it
        is (it may be mid-Ready), and the next `_maybe_snapshot` catches up.
        """
        core, storage = self._core, self._storage
        assert core is not None and storage is not None
        index = self.state.applied_index
        term = core.log.term(index)
        if term is None or index <= self._last_snapshot_index:
            return
        storage.compact(Snapshot(SnapshotMetadata(index, term, tuple(sorted(core.voters))), self.state.snapshot()))
        storage.recycle_freed_pages()
        self._last_snapshot_index = index
        self.stats["log_full_compactions"] += 1

    def _maybe_snapshot(self, core: RaftCore) -> None:
        if core.log.applied - self._last_snapshot_index < self.cfg.snapshot_every:
            return
        assert self._storage is not None
        snap = core.compact(self.state.snapshot())
        failpoint("before-snapshot")
        self._storage.compact(snap)
        failpoint("after-snapshot")
        self._last_snapshot_index = snap.metadata.index
        self.stats["snapshots"] += 1

    def _publish(self) -> None:
        core = self._core
        assert core is not None
        self.info = NodeInfo(
            id=self.cfg.id,
            role=core.role,
            term=core.term,
            leader=core.lead,
            commit=core.log.committed,
            applied=self.state.applied_index,
            last_index=core.log.last_index(),
            snapshot_index=core.log.snapshot_index,
            quiesced=core.quiesced,
        )

    # ------------------------------------------------------------------ inspection helpers (Raft thread)

    def committed_entries(self, lo: int, hi: int) -> list[tuple[int, int, bytes]]:
        """(index, term, data) of committed entries held in [lo, hi]; call via `inspect`."""
        core = self._core
        assert core is not None
        lo = max(lo, core.log.snapshot_index + 1)
        hi = min(hi, core.log.committed)
        if lo > hi:
            return []
        return [(e.index, e.term, e.data) for e in core.log.slice(lo, hi + 1)]


def _now_ms() -> int:
    return int(time.time() * 1000)
