"""A simulated network of Raft nodes in one process, in simulated time, seeded.

The harness plays the driver for every node exactly as a real one would: it
persists each Ready before sending its messages, then applies committed entries
and takes snapshots. The network drops, delays, reorders (by delaying some
messages for a long time) and partitions messages; nodes crash and restart with
whatever their storage holds. Everything random comes from one seed, so any
failure replays exactly: every failure message carries "seed=N".

After every Ready the harness checks the Raft safety properties:

* at most one leader per term;
* log matching: two logs holding an entry with the same index and term hold the
  same data there and the same term at the previous index;
* committed entries never change (also across restarts);
* every state machine applies the same sequence (a rolling digest per index);
* a node's term never goes down, even across restarts.

The client layer mirrors MIT 6.5840's `config.go` (`one`, `check_one_leader`,
`n_committed`, ...), plus a key-value service for linearizability tests.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from cachesvc.meta.raft.core import Config, NotLeaderError, ProposalDroppedError, RaftCore
from cachesvc.meta.raft.messages import Entry, EntryKind, Message, MessageType, Ready, Role
from cachesvc.meta.raft.storage import MemoryStorage, Storage, persist_ready

from linearizability import KvInput, Operation

__all__ = ["Cluster", "KvClient", "SimStateMachine"]

TICK_MS = 10
ELECTION_TICK = 15  # 150-300 ms election timeouts
HEARTBEAT_TICK = 5  # 50 ms heartbeats
ELECTION_TIMEOUT_MS = ELECTION_TICK * TICK_MS
# With quiescence (Cluster(quiesce=True)), as cachesvc/meta/node.py: an idle leader heartbeats every 500 ms;
# its followers wait 800-1600 ms.
QUIESCED_HEARTBEAT_TICK = 50
QUIESCED_ELECTION_TICK = 80


class SimStateMachine:
    """What the harness applies: every command, a KV map, and a digest chain.

    The digest after index i hashes the digest after i-1 with entry i's data, so
    equal digests at an index mean equal applied sequences up to it.
    """

    def __init__(self) -> None:
        self.index = 0
        self.digest = b""
        self.kv: dict[str, str] = {}

    def apply(self, entry: Entry) -> dict[str, Any] | None:
        """Apply one committed entry; returns the decoded KV command if it was one."""
        self.index = entry.index
        self.digest = hashlib.blake2b(self.digest + entry.data, digest_size=16).digest()
        if entry.kind is EntryKind.NORMAL and entry.data.startswith(b"{"):
            cmd: dict[str, Any] = json.loads(entry.data)
            if cmd["op"] == "put":
                self.kv[cmd["k"]] = cmd["v"]
            return cmd
        return None

    def snapshot(self) -> bytes:
        """Serialise the whole state."""
        return json.dumps({"index": self.index, "digest": self.digest.hex(), "kv": self.kv}).encode()

    def restore(self, data: bytes) -> None:
        """Replace the state by a snapshot's."""
        d = json.loads(data)
        self.index = d["index"]
        self.digest = bytes.fromhex(d["digest"])
        self.kv = dict(d["kv"])


@dataclass
class SimNode:
    """One node: its core, storage, state machine and driver-side bookkeeping."""

    id: int
    storage: Storage
    core: RaftCore | None = None
    sm: SimStateMachine = field(default_factory=SimStateMachine)
    incarnation: int = 0
    last_snapshot_index: int = 0
    checked_commit: int = 0
    # Requests this node serves for KV clients: request id -> reply callback.
    pending_writes: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    pending_reads: dict[bytes, tuple[str, Callable[[Any], None]]] = field(default_factory=dict)
    # Confirmed reads waiting for the state machine to reach their index.
    ready_reads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.core is not None


class Cluster:
    """A simulated Raft cluster; see the module docstring."""

    def __init__(
        self,
        n: int,
        seed: int,
        *,
        unreliable: bool = False,
        snapshot_every: int = 0,
        pre_vote: bool = True,
        check_quorum: bool = True,
        local_reads: bool = False,
        open_storage: Callable[[int], Storage] | None = None,
        crash_after_persist: float = 0.0,
        quiesce: bool = False,
    ) -> None:
        """Start `n` nodes (ids 1..n) with empty storage.

        Args:
            n: Number of nodes.
            seed: Seeds everything random; printed with every failure.
            unreliable: Drop 10% of messages and delay them 0-27 ms.
            snapshot_every: Take a snapshot every this many applied entries (0: never).
            pre_vote: Config.pre_vote for every node.
            check_quorum: Config.check_quorum for every node.
            local_reads: The deliberately broken KV service: a node that thinks it
                leads answers reads from its own state machine, without ReadIndex.
            open_storage: Opens node i's storage (called again at each restart);
                defaults to one MemoryStorage per node that survives crashes.
            crash_after_persist: Probability that a node crashes right after
                persisting a Ready, before sending or applying any of it (a crash
                point); it restarts 100-500 ms later.
            quiesce: Config.quiesce for every node (QUIESCED_HEARTBEAT_TICK,
                QUIESCED_ELECTION_TICK).
        """
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.unreliable = unreliable
        self.long_reordering = False
        self.snapshot_every = snapshot_every
        self.pre_vote = pre_vote
        self.check_quorum = check_quorum
        self.local_reads = local_reads
        self.crash_after_persist = crash_after_persist
        self.quiesce = quiesce
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._memory: dict[int, MemoryStorage] = {}
        self._open_storage = open_storage or self._memory_storage
        self.nodes: dict[int, SimNode] = {}
        self.connected: dict[int, bool] = {}
        self.group: dict[int, int] = {}
        # Safety bookkeeping shared by all nodes.
        self.leader_of_term: dict[int, int] = {}
        self.entry_at: dict[tuple[int, int], tuple[bytes, int | None]] = {}
        self.committed: dict[int, tuple[int, bytes]] = {}
        self.digest_at: dict[int, bytes] = {}
        self.applied_cmd: dict[int, bytes] = {}
        self.max_term: dict[int, int] = {}
        self.stats: dict[str, int] = {
            "sent": 0,
            "heartbeats_sent": 0,
            "dropped": 0,
            "snapshots_sent": 0,
            "snapshots_installed": 0,
        }
        self.bootstrap = tuple(range(1, n + 1))
        for i in self.bootstrap:
            self._add(i, self.bootstrap)

    # ------------------------------------------------------------------ failure reporting

    def fail(self, msg: str) -> None:
        """Fail the test with the seed that replays it."""
        raise AssertionError(f"{msg} [t={self.now:.0f}ms; replay with seed={self.seed}]")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and f"seed={self.seed}" not in str(exc):
            exc.add_note(f"replay with seed={self.seed} (simulated t={self.now:.0f}ms)")

    # ------------------------------------------------------------------ nodes

    def _memory_storage(self, node_id: int) -> Storage:
        return self._memory.setdefault(node_id, MemoryStorage())

    def _add(self, node_id: int, voters: tuple[int, ...]) -> None:
        node = SimNode(node_id, self._open_storage(node_id))
        self.nodes[node_id] = node
        self.connected[node_id] = True
        self.group.setdefault(node_id, 0)
        self._boot(node, voters)

    def _boot(self, node: SimNode, voters: tuple[int, ...]) -> None:
        hs, snap, entries = node.storage.load()
        if hs.term < self.max_term.get(node.id, 0):
            self.fail(f"node {node.id} restarted with term {hs.term} < {self.max_term[node.id]}")
        cfg = Config(
            id=node.id,
            election_tick=ELECTION_TICK,
            heartbeat_tick=HEARTBEAT_TICK,
            pre_vote=self.pre_vote,
            check_quorum=self.check_quorum,
            quiesce=self.quiesce,
            quiesced_heartbeat_tick=QUIESCED_HEARTBEAT_TICK,
            quiesced_election_tick=QUIESCED_ELECTION_TICK,
        )
        rng = random.Random(f"{self.seed}/{node.id}/{node.incarnation}")
        node.core = RaftCore(cfg, voters, rng, hs, snap, entries)
        node.sm = SimStateMachine()
        if snap is not None:
            node.sm.restore(snap.data)
            self._check_digest(node)
        node.last_snapshot_index = snap.metadata.index if snap else 0
        node.checked_commit = node.core.log.snapshot_index
        node.pending_writes.clear()
        node.pending_reads.clear()
        node.ready_reads.clear()
        inc = node.incarnation
        self._schedule(self.rng.uniform(0, TICK_MS), lambda: self._tick(node, inc))
        self._drain(node)

    def add_node(self, node_id: int, voters: tuple[int, ...]) -> None:
        """Start a new, empty node that will join with the given voter set."""
        self._add(node_id, voters)

    def crash(self, i: int) -> None:
        """Stop node i; only what its storage holds survives."""
        node = self.nodes[i]
        if node.core is None:
            return
        node.core = None
        node.incarnation += 1
        node.storage.close()

    def restart(self, i: int) -> None:
        """Crash node i if it is up, then boot it from its storage."""
        self.crash(i)
        node = self.nodes[i]
        node.storage = self._open_storage(i)
        self._boot(node, self.bootstrap)

    def _restart_if_down(self, i: int) -> None:
        if self.nodes[i].core is None:
            self.restart(i)

    def disconnect(self, i: int) -> None:
        """Cut node i off from everyone (messages to and from it are lost)."""
        self.connected[i] = False

    def connect(self, i: int) -> None:
        """Undo `disconnect`."""
        self.connected[i] = True

    def partition(self, *groups: tuple[int, ...]) -> None:
        """Only nodes in the same group can talk; nodes not named form group 0."""
        self.group = dict.fromkeys(self.nodes, 0)
        for g, members in enumerate(groups, start=1):
            for i in members:
                self.group[i] = g

    def heal(self) -> None:
        """Remove all partitions and reconnect every node."""
        self.group = dict.fromkeys(self.nodes, 0)
        for i in self.nodes:
            self.connected[i] = True

    def reachable(self, a: int, b: int) -> bool:
        """Whether a message from a to b can get through now."""
        return (
            self.connected.get(a, False)
            and self.connected.get(b, False)
            and self.group.get(a, 0) == self.group.get(b, 0)
        )

    # ------------------------------------------------------------------ events

    def _schedule(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._seq), fn))

    def run_for(self, ms: float) -> None:
        """Advance simulated time by `ms`, processing every event due."""
        self.run_until(self.now + ms)

    def run_until(self, t: float) -> None:
        """Process events up to simulated time `t`."""
        while self._events and self._events[0][0] <= t:
            when, _, fn = heapq.heappop(self._events)
            self.now = when
            fn()
        self.now = max(self.now, t)

    def _tick(self, node: SimNode, inc: int) -> None:
        if node.core is None or node.incarnation != inc:
            return
        node.core.tick()
        self._drain(node)
        self._schedule(TICK_MS, lambda: self._tick(node, inc))

    def _send(self, m: Message) -> None:
        self.stats["sent"] += 1
        if m.type is MessageType.HEARTBEAT:
            self.stats["heartbeats_sent"] += 1
        if not self.reachable(m.src, m.dst) or (self.unreliable and self.rng.random() < 0.1):
            self.stats["dropped"] += 1
            return
        delay = self.rng.uniform(0, 27) if self.unreliable else self.rng.uniform(0, 2)
        if self.long_reordering and self.rng.random() < 0.1:
            delay = self.rng.uniform(200, 2000)
        self._schedule(delay, lambda: self._deliver(m))

    def _deliver(self, m: Message) -> None:
        node = self.nodes.get(m.dst)
        if node is None or node.core is None or not self.reachable(m.src, m.dst):
            self.stats["dropped"] += 1
            return
        if m.type is MessageType.SNAPSHOT:
            self.stats["snapshots_sent"] += 1
        node.core.step(m)
        self._drain(node)

    # ------------------------------------------------------------------ the driver

    def _drain(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        while core.has_ready():
            rd = core.ready()
            self._check_ready(node, rd)
            persist_ready(node.storage, rd)  # Persist first ...
            if rd.hard_state is not None:
                self.max_term[node.id] = max(self.max_term.get(node.id, 0), rd.hard_state.term)
            if self.crash_after_persist and self.rng.random() < self.crash_after_persist:
                self.stats["crash_points"] = self.stats.get("crash_points", 0) + 1
                self.crash(node.id)
                self._schedule(self.rng.uniform(100, 500), lambda: self._restart_if_down(node.id))
                return
            for m in rd.messages:  # ... then send ...
                self._send(m)
            if rd.snapshot is not None:  # ... then apply.
                self.stats["snapshots_installed"] += 1
                node.sm.restore(rd.snapshot.data)
                self._check_digest(node)
            for entry in rd.committed_entries:
                self._apply(node, entry)
            for rs in rd.read_states:
                node.ready_reads.append((rs.index, rs.request_ctx))
            core.advance(rd)
            self._serve_reads(node)
            if self.snapshot_every and core.log.applied - node.last_snapshot_index >= self.snapshot_every:
                snap = core.compact(node.sm.snapshot())
                node.storage.compact(snap)
                node.last_snapshot_index = snap.metadata.index
            self._check_after(node)
            if node.core is not core:
                return

    def _apply(self, node: SimNode, entry: Entry) -> None:
        if entry.index != node.sm.index + 1:
            self.fail(f"node {node.id} applied index {entry.index} after {node.sm.index}")
        committed = self.committed.get(entry.index)
        if committed is not None and committed != (entry.term, entry.data):
            self.fail(f"node {node.id} applied {entry} but {committed} was committed at that index")
        self.committed.setdefault(entry.index, (entry.term, entry.data))
        cmd = node.sm.apply(entry)
        self._check_digest(node)
        self.applied_cmd.setdefault(entry.index, entry.data)
        if cmd is not None and cmd.get("id") in node.pending_writes:
            node.pending_writes.pop(cmd["id"])("ok")

    def _serve_reads(self, node: SimNode) -> None:
        waiting = []
        for index, ctx in node.ready_reads:
            if node.sm.index >= index:
                req = node.pending_reads.pop(ctx, None)
                if req is not None:
                    key, reply = req
                    reply(node.sm.kv.get(key))
            else:
                waiting.append((index, ctx))
        node.ready_reads = waiting

    def _check_digest(self, node: SimNode) -> None:
        known = self.digest_at.setdefault(node.sm.index, node.sm.digest)
        if known != node.sm.digest:
            self.fail(f"node {node.id} state machine diverged at index {node.sm.index}")

    def _check_ready(self, node: SimNode, rd: Ready) -> None:
        core = node.core
        assert core is not None
        if rd.hard_state is not None and rd.hard_state.term < self.max_term.get(node.id, 0):
            self.fail(f"node {node.id} term went down to {rd.hard_state.term}")
        for e in rd.entries:
            prev_term = core.log.term(e.index - 1)
            seen = self.entry_at.setdefault((e.index, e.term), (e.data, prev_term))
            if seen[0] != e.data:
                self.fail(f"log matching: two different entries at index {e.index} term {e.term}")
            if prev_term is not None and seen[1] is not None and seen[1] != prev_term:
                self.fail(f"log matching: entry {e.index}/{e.term} follows different terms")

    def _check_after(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        if core.role is Role.LEADER:
            other = self.leader_of_term.setdefault(core.term, node.id)
            if other != node.id:
                self.fail(f"two leaders in term {core.term}: {other} and {node.id}")
        lo = max(node.checked_commit, core.log.snapshot_index) + 1
        for e in core.log.slice(lo, core.log.committed + 1) if lo <= core.log.committed else []:
            got = self.committed.setdefault(e.index, (e.term, e.data))
            if got != (e.term, e.data):
                self.fail(f"committed entry {e.index} changed on node {node.id}: {got} -> {e}")
        node.checked_commit = max(node.checked_commit, core.log.committed)

    def check_logs_match(self) -> None:
        """Full pairwise log-matching check (the per-Ready checks are incremental)."""
        live = [n for n in self.nodes.values() if n.core is not None]
        for a, b in itertools.combinations(live, 2):
            la, lb = a.core.log, b.core.log  # type: ignore[union-attr]
            lo = max(la.snapshot_index, lb.snapshot_index) + 1
            hi = min(la.last_index(), lb.last_index())
            agree = None
            for i in range(hi, lo - 1, -1):
                if la.term(i) == lb.term(i):
                    agree = i
                    break
            if agree is not None and la.slice(lo, agree + 1) != lb.slice(lo, agree + 1):
                self.fail(f"logs of {a.id} and {b.id} differ before matching index {agree}")

    # ------------------------------------------------------------------ MIT-style client helpers

    def alive_connected(self) -> list[int]:
        """Nodes up and connected (ignoring partitions)."""
        return [i for i, n in self.nodes.items() if n.core is not None and self.connected[i]]

    def leaders(self) -> dict[int, list[int]]:
        """Term -> nodes that are up, connected and think they lead in it."""
        out: dict[int, list[int]] = {}
        for i in self.alive_connected():
            core = self.nodes[i].core
            assert core is not None
            if core.role is Role.LEADER:
                out.setdefault(core.term, []).append(i)
        return out

    def check_one_leader(self) -> int:
        """Wait (up to ~5 s) until exactly one connected node leads; return it."""
        for _ in range(10):
            self.run_for(450 + self.rng.uniform(0, 100))
            by_term = self.leaders()
            for term, ids in by_term.items():
                if len(ids) > 1:
                    self.fail(f"term {term} has {len(ids)} leaders: {ids}")
            if by_term:
                return by_term[max(by_term)][0]
        self.fail("expected one leader, got none")
        raise AssertionError  # unreachable

    def check_no_leader(self) -> None:
        """Fail if a connected node thinks it leads."""
        if self.leaders():
            self.fail(f"expected no leader among connected nodes, got {self.leaders()}")

    def check_terms(self) -> int:
        """All connected nodes agree on the term; return it."""
        terms = {self.nodes[i].core.term for i in self.alive_connected()}  # type: ignore[union-attr]
        if len(terms) > 1:
            self.fail(f"servers disagree on term: {terms}")
        return terms.pop()

    def term_of(self, i: int) -> int:
        """Node i's current term."""
        core = self.nodes[i].core
        assert core is not None
        return core.term

    def start(self, i: int, cmd: bytes) -> tuple[int, int, bool]:
        """Propose `cmd` on node i, as MIT's Start(): (index, term, is_leader)."""
        node = self.nodes[i]
        if node.core is None:
            return -1, -1, False
        try:
            index = node.core.propose(cmd)
        except ProposalDroppedError:
            return -1, node.core.term, False
        term = node.core.term
        self._drain(node)
        return index, term, True

    def n_committed(self, index: int) -> tuple[int, bytes | None]:
        """How many nodes have applied `index`, and what was applied there."""
        count = sum(1 for n in self.nodes.values() if n.sm.index >= index)
        return count, self.applied_cmd.get(index)

    def one(self, cmd: bytes, expected: int, retry: bool) -> int:
        """Get `cmd` committed on at least `expected` nodes (MIT's one()); its index."""
        t0 = self.now
        starts = 0
        while self.now - t0 < 10_000:
            index = -1
            ids = sorted(self.nodes)
            for k in range(len(ids)):
                i = ids[(starts + k) % len(ids)]
                if self.nodes[i].core is not None and self.connected[i]:
                    idx, _, ok = self.start(i, cmd)
                    if ok:
                        index = idx
                        break
            starts += 1
            if index != -1:
                t1 = self.now
                while self.now - t1 < 2_000:
                    nd, got = self.n_committed(index)
                    if nd > 0 and nd >= expected and got == cmd:
                        return index
                    self.run_for(20)
                if not retry:
                    self.fail(f"one({cmd!r}) failed to reach agreement")
            else:
                self.run_for(50)
        self.fail(f"one({cmd!r}) failed to reach agreement in 10 s")
        raise AssertionError  # unreachable

    def wait(self, index: int, n: int, start_term: int) -> bytes | None:
        """Wait for `index` to be applied on `n` nodes unless the term moves on."""
        to = 10.0
        for _ in range(30):
            nd, _ = self.n_committed(index)
            if nd >= n:
                break
            self.run_for(to)
            to = min(to * 2, 1000)
            if start_term > -1 and any(
                self.nodes[i].core.term > start_term  # type: ignore[union-attr]
                for i in self.alive_connected()
            ):
                return None
        nd, cmd = self.n_committed(index)
        if nd < n:
            self.fail(f"only {nd} decided for index {index}; wanted {n}")
        return cmd

    def log_size(self, i: int) -> int:
        """Entries node i's storage holds beyond its snapshot."""
        return len(self.nodes[i].storage.load()[2])

    # ------------------------------------------------------------------ KV service

    def kv_request(self, i: int, inp: KvInput, req_id: str, reply: Callable[[Any], None]) -> None:
        """Node i handles a client request (already delivered to it)."""
        node = self.nodes[i]
        core = node.core
        if core is None:
            return  # A crashed node never answers; the client times out.
        if core.role is not Role.LEADER:
            reply(("not_leader", core.lead))
            return
        if inp.op == "put":
            data = json.dumps({"op": "put", "k": inp.key, "v": inp.value, "id": req_id}).encode()
            try:
                core.propose(data)
            except NotLeaderError as e:
                reply(("not_leader", e.leader))
                return
            except ProposalDroppedError:
                reply(("not_leader", None))
                return
            node.pending_writes[req_id] = reply
        elif self.local_reads:
            reply(node.sm.kv.get(inp.key))  # The broken variant: no ReadIndex.
            return
        else:
            ctx = req_id.encode()
            node.pending_reads[ctx] = (inp.key, reply)
            core.read_index(ctx)
        self._drain(node)


class KvClient:
    """A simulated client: one operation at a time, each recorded in `history`.

    A write that gets no reply within the timeout stays in the history with
    return time infinity (it may or may not have taken effect); a read without a
    reply is left out. Requests and replies cross the simulated network with the
    same delays and drops as Raft messages, but are never partitioned.
    """

    TIMEOUT_MS = 600.0

    def __init__(self, cluster: Cluster, client_id: int, keys: list[str], history: list[Operation]) -> None:
        self.c = cluster
        self.id = client_id
        self.keys = keys
        self.history = history
        self.rng = random.Random(f"{cluster.seed}/client/{client_id}")
        self.server = self.rng.choice(sorted(cluster.nodes))
        self.attempt = 0
        self.n = 0
        self.stopped = False
        self.op: KvInput | None = None
        self.call = 0.0

    def start(self) -> None:
        """Begin issuing operations."""
        self.c._schedule(self.rng.uniform(0, 20), self._next_op)

    def stop(self) -> None:
        """Issue no new operations (the one in flight may still complete)."""
        self.stopped = True

    def _next_op(self) -> None:
        if self.stopped:
            return
        self.n += 1
        key = self.rng.choice(self.keys)
        if self.rng.random() < 0.5:
            self.op = KvInput("put", key, f"c{self.id}-{self.n}")
        else:
            self.op = KvInput("get", key)
        self.call = self.c.now
        self._send()

    def _send(self) -> None:
        self.attempt += 1
        attempt = self.attempt
        server = self.server
        op = self.op
        assert op is not None
        req_id = f"{self.id}-{self.n}-{attempt}"

        def reply(result: Any) -> None:
            self._net(lambda: self._on_reply(attempt, result))

        self._net(lambda: self.c.kv_request(server, op, req_id, reply))
        self.c._schedule(self.TIMEOUT_MS, lambda: self._on_timeout(attempt))

    def _net(self, fn: Callable[[], None]) -> None:
        if self.c.unreliable and self.c.rng.random() < 0.1:
            return
        self.c._schedule(self.c.rng.uniform(0, 27 if self.c.unreliable else 2), fn)

    def _on_reply(self, attempt: int, result: Any) -> None:
        if attempt != self.attempt or self.op is None:
            return
        if isinstance(result, tuple) and result[0] == "not_leader":
            # Nothing was proposed, so trying the same operation elsewhere is safe.
            hint = result[1]
            self.server = hint if hint is not None else self.rng.choice(sorted(self.c.nodes))
            self.c._schedule(10, self._send)
            return
        output = None if self.op.op == "put" else result
        self.history.append(Operation(self.id, self.op, self.call, output, self.c.now))
        self.op = None
        self.c._schedule(self.rng.uniform(0, 10), self._next_op)

    def _on_timeout(self, attempt: int) -> None:
        if attempt != self.attempt or self.op is None:
            return
        if self.op.op == "put":
            self.history.append(Operation(self.id, self.op, self.call, None, math.inf))
        self.op = None
        self.attempt += 1  # Ignore a late reply to the abandoned operation.
        self.server = self.rng.choice(sorted(self.c.nodes))
        self.c._schedule(self.rng.uniform(0, 10), self._next_op)
