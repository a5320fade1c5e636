"""Directed tests of the pure core, with messages passed by hand between cores."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachesvc.meta.raft.core import Config, RaftCore
from cachesvc.meta.raft.messages import Entry, HardState, Message, MessageType, ReadState, Role
from cachesvc.meta.raft.quorum import VoteResult, committed_index, majority, vote_result
from cachesvc.meta.raft.storage import MemoryStorage, persist_ready

from raft_sim import Cluster


class Net:
    """Cores wired together by hand: deliver everything until quiet, or filter."""

    def __init__(self, cores: dict[int, RaftCore]) -> None:
        self.cores = cores
        self.storage = {i: MemoryStorage() for i in cores}
        for i, c in cores.items():
            self.storage[i].save(c.hard_state, c.log.entries)
        self.applied: dict[int, list[Entry]] = {i: [] for i in cores}
        self.read_states: dict[int, list[ReadState]] = {i: [] for i in cores}
        self.inbox: list[Message] = []
        self.delivered: list[Message] = []

    def drain(self) -> None:
        for i, core in self.cores.items():
            while core.has_ready():
                rd = core.ready()
                persist_ready(self.storage[i], rd)
                self.inbox.extend(rd.messages)
                self.applied[i].extend(rd.committed_entries)
                self.read_states[i].extend(rd.read_states)
                core.advance(rd)

    def pump(self, net_filter: Callable[[Message], Message | None] = lambda m: m, limit: int = 10_000) -> None:
        """Deliver messages (as `net_filter` rewrites them; None drops) until none are left."""
        self.drain()
        for _ in range(limit):
            if not self.inbox:
                return
            m = self.inbox.pop(0)
            got = net_filter(m)
            if got is not None and got.dst in self.cores:
                m = got
                self.delivered.append(m)
                self.cores[m.dst].step(m)
                self.drain()
        raise AssertionError("messages never quiesced")


def core(
    i: int,
    voters: tuple[int, ...],
    hs: HardState | None = None,
    entries: tuple[Entry, ...] = (),
    **kw: object,
) -> RaftCore:
    return RaftCore(Config(id=i, **kw), voters, random.Random(i), hs, None, entries)  # type: ignore[arg-type]


def elect(net: Net, leader: int) -> None:
    net.cores[leader].campaign()
    net.pump()
    assert net.cores[leader].role is Role.LEADER


def test_figure8_old_term_entry_is_not_committed_by_counting() -> None:
    """Raft §5.4.2: replicating an entry of an earlier term to a majority does not
    commit it; only an entry of the leader's own term does (and then everything before)."""
    # Node 1 holds an uncommitted entry from term 2 that nobody else has.
    old = (Entry(1, 1, b"a"), Entry(2, 2, b"old"))
    cores = {
        1: core(1, (1, 2, 3), HardState(3, None, 1), old, max_entries_per_message=1),
        2: core(2, (1, 2, 3), HardState(3, None, 1), old[:1]),
        3: core(3, (1, 2, 3), HardState(3, None, 1), old[:1]),
    }
    net = Net(cores)
    leader = cores[1]
    leader.campaign()
    # Strip the no-op at index 3 from every APPEND, as if it were lost on the way,
    # so that followers acknowledge only the old entry at index 2.
    net.pump(lambda m: dataclasses.replace(m, entries=tuple(e for e in m.entries if e.index < 3)))
    assert leader.role is Role.LEADER and leader.term == 4
    assert cores[2].log.last_index() >= 2 and cores[3].log.last_index() >= 2
    assert leader.progress[2].match == 2
    assert leader.log.committed == 1, "an entry of an earlier term was committed by counting replicas"
    # Once the no-op of term 4 reaches a majority, index 2 commits with it.
    for _ in range(5):
        leader.tick()
    net.pump()
    assert leader.log.committed == 3
    assert [e.data for e in net.applied[2]][:2] == [b"a", b"old"]


def test_conflict_hint_skips_whole_terms() -> None:
    """A follower with 50 entries of a stale term is repaired in a few round trips."""
    common = tuple(Entry(1, i, b"c") for i in range(1, 4))
    stale = tuple(Entry(2, i, b"stale") for i in range(4, 54))
    newer = tuple(Entry(3, i, b"new") for i in range(4, 10))
    cores = {
        1: core(1, (1, 2, 3), HardState(3, 1, 3), common + newer),
        2: core(2, (1, 2, 3), HardState(3, 1, 3), common + stale),
        3: core(3, (1, 2, 3), HardState(3, 1, 3), common + newer),
    }
    net = Net(cores)
    elect(net, 1)
    appends_to_2 = [m for m in net.delivered if m.type is MessageType.APPEND and m.dst == 2]
    rejects = [m for m in net.delivered if m.type is MessageType.APPEND_RESP and m.src == 2 and m.reject]
    assert len(rejects) <= 2, f"{len(rejects)} rejections to back up over one stale term"
    assert len(appends_to_2) <= 4
    assert cores[2].log.slice(4, 11) == cores[1].log.slice(4, 11)


def test_read_index_is_forwarded_from_a_follower() -> None:
    cores = {i: core(i, (1, 2, 3)) for i in (1, 2, 3)}
    net = Net(cores)
    elect(net, 1)
    cores[1].propose(b"x")
    net.pump()
    cores[3].read_index(b"r1")
    net.pump()
    assert net.read_states[3] == [ReadState(cores[1].log.committed, b"r1")]


def test_read_index_needs_a_quorum_of_heartbeat_replies() -> None:
    cores = {i: core(i, (1, 2, 3)) for i in (1, 2, 3)}
    net = Net(cores)
    elect(net, 1)
    cores[1].read_index(b"r")
    net.pump(lambda m: None if m.type is MessageType.HEARTBEAT_RESP else m)
    assert net.read_states[1] == []
    cores[1].read_index(b"r2")
    net.pump()
    # Confirming the later read confirms the earlier one queued before it.
    assert [rs.request_ctx for rs in net.read_states[1]] == [b"r", b"r2"]


def test_vote_is_persisted_before_the_grant_is_sent() -> None:
    cores = {i: core(i, (1, 2, 3), pre_vote=False) for i in (1, 2, 3)}
    cores[1].campaign()
    rd = cores[1].ready()
    vote_req = next(m for m in rd.messages if m.dst == 2)
    cores[2].step(vote_req)
    rd2 = cores[2].ready()
    grant = next(m for m in rd2.messages if m.type is MessageType.VOTE_RESP)
    assert not grant.reject
    # The same Ready that carries the grant carries the vote to persist first.
    assert rd2.hard_state == HardState(1, 1, 0)


def test_same_seed_same_run() -> None:
    """Everything random is seeded: a replay is exact."""

    def run() -> tuple[dict[str, int], dict[int, tuple[int, bytes]], float]:
        c = Cluster(5, 5, unreliable=True, snapshot_every=5)
        rng = random.Random(5)
        for _ in range(30):
            c.one(str(rng.random()).encode(), 3, True)
            victim = rng.choice(sorted(c.nodes))
            c.crash(victim)
            c.one(str(rng.random()).encode(), 3, True)
            c.restart(victim)
        return c.stats, c.committed, c.now

    assert run() == run()


@given(st.dictionaries(st.integers(1, 7), st.integers(0, 20), max_size=7), st.sets(st.integers(1, 7), max_size=7))
def test_committed_index_matches_definition(match: dict[int, int], voters: set[int]) -> None:
    """The highest index that a majority of voters has, straight from the definition."""
    expected = max(
        (i for i in range(21) if sum(1 for v in voters if match.get(v, 0) >= i) >= majority(voters)),
        default=0,
    )
    assert committed_index(voters, match) == (expected if voters else 0)


@given(st.sets(st.integers(1, 7), min_size=1, max_size=7), st.dictionaries(st.integers(1, 7), st.booleans()))
def test_vote_result_matches_definition(voters: set[int], votes: dict[int, bool]) -> None:
    granted = sum(1 for v in voters if votes.get(v) is True)
    rejected = sum(1 for v in voters if votes.get(v) is False)
    q = majority(voters)
    if granted >= q:
        assert vote_result(voters, votes) is VoteResult.WON
    elif len(voters) - rejected < q:
        assert vote_result(voters, votes) is VoteResult.LOST
    else:
        assert vote_result(voters, votes) is VoteResult.PENDING


def test_ticks_until_due_is_exactly_when_tick_first_acts() -> None:
    """A driver that sleeps `ticks_until_due()` ticks and then ticks that many times misses nothing."""

    def first_action(core: RaftCore) -> int:
        """Ticks, one by one, until one changes the role or term or sends a message."""
        n = 0
        while True:
            n += 1
            role, term = core.role, core.term
            core.tick()
            if core.role is not role or core.term != term or core.ready().messages:
                return n

    # A follower of a 3-node shard: due at its randomised election timeout.
    for seed in range(20):
        follower = RaftCore(Config(1, election_tick=10, heartbeat_tick=2), [1, 2, 3], random.Random(seed))
        due = follower.ticks_until_due()
        assert first_action(follower) == due
    # A leader with peers: its next heartbeat; alone: its quorum check only.
    leader = RaftCore(Config(1, election_tick=10, heartbeat_tick=2), [1], random.Random(1))
    leader.campaign()
    leader.ready()
    assert leader.role is Role.LEADER
    assert leader.ticks_until_due() == 10


def test_quiesce_settings_are_checked() -> None:
    ok = {"election_tick": 10, "heartbeat_tick": 2, "quiesce": True}
    Config(1, **ok, quiesced_heartbeat_tick=5, quiesced_election_tick=20).validate()  # type: ignore[arg-type]
    for hb, election in ((1, 20), (20, 20), (5, 9)):
        bad = Config(1, **ok, quiesced_heartbeat_tick=hb, quiesced_election_tick=election)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="quiesce"):
            bad.validate()


def test_a_quiesced_leader_and_its_followers_sleep_longer() -> None:
    """`ticks_until_due` (what a driver sleeps) grows to the quiesced intervals; a proposal shrinks it again."""
    kw = {"election_tick": 10, "heartbeat_tick": 2, "quiesce": True, "quiesced_heartbeat_tick": 8}
    net = Net({i: core(i, (1, 2, 3), **kw, quiesced_election_tick=30) for i in (1, 2, 3)})
    elect(net, 1)
    leader = net.cores[1]
    assert leader.is_leader and not leader.quiesced
    for _ in range(2):  # one heartbeat round after everything is replicated and committed
        for c in net.cores.values():
            c.tick()
        net.pump()
    assert all(c.quiesced for c in net.cores.values())
    assert leader.ticks_until_due() > 2
    assert all(net.cores[i].ticks_until_due() > 20 for i in (2, 3))
    leader.propose(b"x")
    assert not leader.quiesced and leader.ticks_until_due() <= 2
    net.pump()
    assert all(c.log.committed == leader.log.last_index() for c in net.cores.values())
    assert not any(net.cores[i].quiesced for i in (2, 3)), "the APPEND wakes the followers"
