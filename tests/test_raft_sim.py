"""The MIT 6.5840 Raft scenarios, plus pre-vote, ReadIndex, membership and transfer,
run against the pure core on the simulated network of `tests/raft_sim.py`.

Every step of every test also runs the harness's safety checks (one leader per
term, log matching, committed entries never change, identical applied
sequences). A failure names the seed that replays it exactly.
"""

from __future__ import annotations

import random

import pytest

from cachesvc.meta.raft.core import ProposalDroppedError
from cachesvc.meta.raft.messages import ConfChange, ConfChangeType, Role

from linearizability import KvInput
from raft_sim import ELECTION_TIMEOUT_MS, QUIESCED_ELECTION_TICK, QUIESCED_HEARTBEAT_TICK, TICK_MS, Cluster

# Real sleeps in MIT's tests become simulated milliseconds here.
RAFT_ELECTION_TIMEOUT = 1000


def cmd(rng: random.Random) -> bytes:
    return str(rng.randrange(1 << 40)).encode()


# ---------------------------------------------------------------------- 3A: election


@pytest.mark.parametrize("seed", [1, 2])
def test_initial_election(seed: int) -> None:
    with Cluster(3, seed) as c:
        c.check_one_leader()
        c.run_for(50)
        term1 = c.check_terms()
        assert term1 >= 1, f"term is {term1}, but should be at least 1 (seed={seed})"
        # With no failures the leader and term stay put.
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        term2 = c.check_terms()
        assert term1 == term2, f"term changed from {term1} to {term2} with no failures (seed={seed})"
        c.check_one_leader()


@pytest.mark.parametrize("seed", [1, 2])
def test_re_election(seed: int) -> None:
    with Cluster(3, seed) as c:
        leader1 = c.check_one_leader()
        c.disconnect(leader1)
        c.check_one_leader()
        # The old leader rejoining must not disturb the new one.
        c.connect(leader1)
        leader2 = c.check_one_leader()
        # Without a quorum no leader may be elected.
        c.disconnect(leader2)
        c.disconnect(leader2 % 3 + 1)
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        c.check_no_leader()
        c.connect(leader2 % 3 + 1)
        c.check_one_leader()
        c.connect(leader2)
        c.check_one_leader()


def test_many_elections() -> None:
    seed = 7
    rng = random.Random(seed)
    with Cluster(7, seed) as c:
        c.check_one_leader()
        for _ in range(10):
            out = rng.sample(sorted(c.nodes), 3)
            for i in out:
                c.disconnect(i)
            # Either the old leader is still alive or the other four elect one.
            c.check_one_leader()
            for i in out:
                c.connect(i)
        c.check_one_leader()


# ---------------------------------------------------------------------- 3B: agreement


def test_basic_agree() -> None:
    with Cluster(3, 11) as c:
        for index in range(1, 4):
            nd, _ = c.n_committed(index + 1)
            assert nd == 0, "some have committed before Start()"
            xindex = c.one(str(index * 100).encode(), 3, False)
            # Index 1 is the first leader's no-op, so commands land after it.
            assert xindex > index


def test_fail_agree() -> None:
    with Cluster(3, 12) as c:
        c.one(b"101", 3, False)
        leader = c.check_one_leader()
        c.disconnect(leader % 3 + 1)
        c.one(b"102", 2, False)
        c.one(b"103", 2, False)
        c.run_for(RAFT_ELECTION_TIMEOUT)
        c.one(b"104", 2, False)
        c.connect(leader % 3 + 1)
        c.one(b"106", 3, True)
        c.run_for(RAFT_ELECTION_TIMEOUT)
        c.one(b"107", 3, True)


def test_fail_no_agree() -> None:
    with Cluster(5, 13) as c:
        c.one(b"10", 5, False)
        leader = c.check_one_leader()
        for k in (1, 2, 3):
            c.disconnect((leader - 1 + k) % 5 + 1)
        index, _, ok = c.start(leader, b"20")
        assert ok, "leader rejected Start()"
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        nd, _ = c.n_committed(index)
        assert nd == 0, f"{nd} committed but no majority (seed=13)"
        for k in (1, 2, 3):
            c.connect((leader - 1 + k) % 5 + 1)
        leader2 = c.check_one_leader()
        _, _, ok2 = c.start(leader2, b"30")
        assert ok2, "leader2 rejected Start()"
        c.one(b"1000", 5, True)


def test_rejoin() -> None:
    with Cluster(3, 14) as c:
        c.one(b"101", 3, True)
        leader1 = c.check_one_leader()
        c.disconnect(leader1)
        # The partitioned leader accepts entries that can never commit.
        c.start(leader1, b"102")
        c.start(leader1, b"103")
        c.start(leader1, b"104")
        c.one(b"103", 2, True)
        leader2 = c.check_one_leader()
        c.disconnect(leader2)
        c.connect(leader1)
        c.one(b"104", 2, True)
        c.connect(leader2)
        c.one(b"105", 3, True)
        c.check_logs_match()


@pytest.mark.parametrize("seed", [15, 16])
def test_backup(seed: int) -> None:
    """Leaders back up quickly over 50 incorrect follower entries."""
    rng = random.Random(seed)
    with Cluster(5, seed) as c:
        c.one(cmd(rng), 5, True)
        leader1 = c.check_one_leader()

        def peer(k: int) -> int:
            return (leader1 - 1 + k) % 5 + 1

        for k in (2, 3, 4):
            c.disconnect(peer(k))
        for _ in range(50):
            c.start(leader1, cmd(rng))
        c.run_for(RAFT_ELECTION_TIMEOUT / 2)
        c.disconnect(peer(0))
        c.disconnect(peer(1))
        for k in (2, 3, 4):
            c.connect(peer(k))
        for _ in range(50):
            c.one(cmd(rng), 3, True)

        leader2 = c.check_one_leader()
        other = peer(2) if leader2 != peer(2) else peer(3)
        c.disconnect(other)
        for _ in range(50):
            c.start(leader2, cmd(rng))
        c.run_for(RAFT_ELECTION_TIMEOUT / 2)
        for i in c.nodes:
            c.disconnect(i)
        for i in (peer(0), peer(1), other):
            c.connect(i)
        for _ in range(50):
            c.one(cmd(rng), 3, True)
        for i in c.nodes:
            c.connect(i)
        c.one(cmd(rng), 5, True)
        c.check_logs_match()


def test_count_messages() -> None:
    """An idle cluster and a burst of commands cost a bounded number of messages."""
    with Cluster(3, 17) as c:
        leader = c.check_one_leader()
        before = c.stats["sent"]
        c.run_for(RAFT_ELECTION_TIMEOUT)
        idle = c.stats["sent"] - before
        # Heartbeats every 50 ms to 2 followers plus replies: about 80 a second.
        assert idle < 120, f"{idle} messages in 1 s of idleness"
        start_term = c.term_of(leader)
        before = c.stats["sent"]
        for k in range(10):
            c.start(leader, str(k).encode())
        c.run_for(200)
        assert c.term_of(leader) == start_term
        assert c.stats["sent"] - before < 100


# ---------------------------------------------------------------------- 3C: persistence


def test_persist() -> None:
    with Cluster(3, 21) as c:
        c.one(b"11", 3, True)
        for i in c.nodes:
            c.restart(i)
        c.one(b"12", 3, True)
        leader1 = c.check_one_leader()
        c.restart(leader1)
        c.one(b"13", 3, True)
        leader2 = c.check_one_leader()
        c.crash(leader2)
        c.one(b"14", 2, True)
        c.restart(leader2)
        c.wait(4, 3, -1)  # Everything committed so far reaches the restarted node.
        c.check_logs_match()


def _figure8(c: Cluster, rng: random.Random, iters: int) -> None:
    n = len(c.nodes)
    c.one(cmd(rng), 1, True)
    nup = n
    for _ in range(iters):
        leader = -1
        for i in c.nodes:
            if c.nodes[i].alive:
                _, _, ok = c.start(i, cmd(rng))
                if ok:
                    leader = i
        if rng.randrange(1000) < 100:
            c.run_for(rng.randrange(ELECTION_TIMEOUT_MS))
        else:
            c.run_for(rng.randrange(13))
        if leader != -1:
            c.crash(leader)
            nup -= 1
        if nup < 3:
            s = rng.choice(sorted(c.nodes))
            if not c.nodes[s].alive:
                c.restart(s)
                nup += 1
    for i in c.nodes:
        if not c.nodes[i].alive:
            c.restart(i)
    c.one(cmd(rng), n, True)
    c.check_logs_match()


def _figure8_unreliable(c: Cluster, rng: random.Random, iters: int) -> None:
    n = len(c.nodes)
    c.one(str(rng.randrange(10000)).encode(), 1, True)
    nup = n
    for it in range(iters):
        if it == iters // 5:
            c.long_reordering = True
        leader = -1
        for i in c.nodes:
            _, _, ok = c.start(i, str(rng.randrange(10000)).encode())
            if ok and c.connected[i]:
                leader = i
        if rng.randrange(1000) < 100:
            c.run_for(rng.randrange(ELECTION_TIMEOUT_MS // 2))
        else:
            c.run_for(rng.randrange(13))
        if leader != -1 and rng.randrange(1000) < ELECTION_TIMEOUT_MS // 2:
            c.disconnect(leader)
            nup -= 1
        if nup < 3:
            s = rng.choice(sorted(c.nodes))
            if not c.connected[s]:
                c.connect(s)
                nup += 1
    for i in c.nodes:
        c.connect(i)
    c.long_reordering = False
    c.one(str(rng.randrange(10000)).encode(), n, True)
    c.check_logs_match()


@pytest.mark.parametrize("seed", [31, 32, 33])
@pytest.mark.parametrize("snapshot_every", [0, 7])
def test_figure8(seed: int, snapshot_every: int) -> None:
    with Cluster(5, seed, snapshot_every=snapshot_every) as c:
        _figure8(c, random.Random(seed), iters=300)


@pytest.mark.parametrize("seed", [34, 35, 36])
@pytest.mark.parametrize("snapshot_every", [0, 7])
def test_figure8_unreliable(seed: int, snapshot_every: int) -> None:
    with Cluster(5, seed, unreliable=True, snapshot_every=snapshot_every) as c:
        _figure8_unreliable(c, random.Random(seed), iters=300)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1020))
def test_figure8_nightly(seed: int) -> None:
    with Cluster(5, seed, snapshot_every=7 if seed % 2 else 0) as c:
        _figure8(c, random.Random(seed), iters=1000)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2000, 2020))
def test_figure8_unreliable_nightly(seed: int) -> None:
    with Cluster(5, seed, unreliable=True, snapshot_every=7 if seed % 2 else 0) as c:
        _figure8_unreliable(c, random.Random(seed), iters=1000)


def _churn(c: Cluster, rng: random.Random, iters: int) -> None:
    """Clients keep proposing while servers crash, restart and lose the network."""
    n = len(c.nodes)
    proposed: list[tuple[int, int, bytes]] = []  # (node, index, cmd) the leader accepted

    def client() -> None:
        if stop[0]:
            return
        value = cmd(rng)
        for i in sorted(c.nodes):
            if c.nodes[i].alive:
                index, _, ok = c.start(i, value)
                if ok:
                    proposed.append((i, index, value))
        c._schedule(rng.uniform(5, 50), client)

    stop = [False]
    for _ in range(3):
        c._schedule(rng.uniform(0, 10), client)
    for _ in range(iters):
        r = rng.randrange(1000)
        i = rng.choice(sorted(c.nodes))
        if r < 200:
            c.disconnect(i)
        elif r < 500:
            if not c.nodes[i].alive:
                c.restart(i)
            c.connect(i)
        elif r < 800:
            c.crash(i)
        c.run_for(RAFT_ELECTION_TIMEOUT * 7 / 10)
    c.run_for(RAFT_ELECTION_TIMEOUT)
    stop[0] = True
    for i in c.nodes:
        if not c.nodes[i].alive:
            c.restart(i)
        c.connect(i)
    last = c.one(cmd(rng), n, True)
    applied = {c.applied_cmd[k] for k in range(1, last + 1)}
    committed_values = [v for _, index, v in proposed if c.applied_cmd.get(index) == v]
    assert committed_values, f"churn committed nothing (seed={c.seed})"
    for v in committed_values:
        assert v in applied
    c.check_logs_match()


@pytest.mark.parametrize("seed", [51, 52])
@pytest.mark.parametrize("unreliable", [False, True])
def test_churn(seed: int, unreliable: bool) -> None:
    with Cluster(5, seed, unreliable=unreliable, snapshot_every=10 if seed % 2 else 0) as c:
        _churn(c, random.Random(seed), iters=20)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3000, 3020))
def test_churn_nightly(seed: int) -> None:
    with Cluster(5, seed, unreliable=seed % 2 == 1, snapshot_every=10 if seed % 3 == 0 else 0) as c:
        _churn(c, random.Random(seed), iters=60)


@pytest.mark.parametrize("seed", [55, 56])
def test_crash_after_persist_before_send(seed: int) -> None:
    """Nodes die between persisting a Ready and sending or applying it (the crash
    point a real driver has after its fsync); nothing committed is lost."""
    rng = random.Random(seed)
    with Cluster(5, seed, unreliable=True, snapshot_every=10, crash_after_persist=0.003) as c:
        committed: dict[int, bytes] = {}
        deadline = c.now + 20_000
        while c.now < deadline:
            for i in sorted(c.nodes):
                value = cmd(rng)
                index, _, ok = c.start(i, value)
                if ok:
                    committed[index] = value
            c.run_for(rng.uniform(5, 60))
        assert c.stats.get("crash_points", 0) >= 10, c.stats
        c.crash_after_persist = 0.0
        c.run_for(600)  # Pending restarts happen.
        last = c.one(cmd(rng), 5, True)
        decided = [i for i, v in committed.items() if c.applied_cmd.get(i) == v]
        assert len(decided) > 50, f"only {len(decided)} commands committed (seed={seed})"
        assert all(c.n_committed(i)[0] == 5 for i in range(1, last + 1))
        c.check_logs_match()


# ---------------------------------------------------------------------- 3D: snapshots

SNAPSHOT_INTERVAL = 10


def _snapcommon(c: Cluster, rng: random.Random, disconnect: bool, crash: bool, iters: int) -> None:
    n = len(c.nodes)
    c.one(cmd(rng), n, True)
    leader1 = c.check_one_leader()
    for i in range(iters):
        victim = leader1 % n + 1
        sender = leader1
        if i % 3 == 1:
            sender, victim = victim, leader1
        if disconnect:
            c.disconnect(victim)
            c.one(cmd(rng), n - 1, True)
        if crash:
            c.crash(victim)
            c.one(cmd(rng), n - 1, True)
        # Enough entries for the others to snapshot past what the victim has.
        for _ in range(SNAPSHOT_INTERVAL // 2 + rng.randrange(SNAPSHOT_INTERVAL)):
            c.start(sender, cmd(rng))
        if not disconnect and not crash:
            c.one(cmd(rng), n, True)
        else:
            c.one(cmd(rng), n - 1, True)
        for j in c.nodes:
            if c.nodes[j].alive:
                assert c.log_size(j) <= 4 * SNAPSHOT_INTERVAL + 20, f"log of {j} not compacted (seed={c.seed})"
        if disconnect:
            c.connect(victim)
            c.one(cmd(rng), n, True)
            leader1 = c.check_one_leader()
        if crash:
            c.restart(victim)
            c.one(cmd(rng), n, True)
            leader1 = c.check_one_leader()
    c.check_logs_match()


@pytest.mark.parametrize(
    ("name", "disconnect", "crash", "unreliable"),
    [
        ("basic", False, False, False),
        ("install", True, False, False),
        ("install-unreliable", True, False, True),
        ("install-crash", False, True, False),
        ("install-unreliable-crash", False, True, True),
    ],
)
def test_snapshots(name: str, disconnect: bool, crash: bool, unreliable: bool) -> None:
    seed = 60 + len(name)
    with Cluster(3, seed, unreliable=unreliable, snapshot_every=SNAPSHOT_INTERVAL) as c:
        _snapcommon(c, random.Random(seed), disconnect, crash, iters=30)
        if disconnect or crash:
            assert c.stats["snapshots_installed"] > 0, "no follower ever needed InstallSnapshot"


def test_install_snapshot_after_crash() -> None:
    """A follower that crashes and misses compacted entries catches up by snapshot."""
    rng = random.Random(70)
    with Cluster(3, 70, snapshot_every=SNAPSHOT_INTERVAL) as c:
        c.one(cmd(rng), 3, True)
        leader = c.check_one_leader()
        victim = leader % 3 + 1
        c.crash(victim)
        for _ in range(50):
            c.one(cmd(rng), 2, True)
        installed = c.stats["snapshots_installed"]
        c.restart(victim)
        last = c.one(cmd(rng), 3, True)
        assert c.stats["snapshots_installed"] > installed
        assert c.nodes[victim].sm.digest == c.digest_at[c.nodes[victim].sm.index]
        assert c.nodes[victim].sm.index >= last
        # Restart everyone from snapshot + log: same state machines.
        for i in c.nodes:
            c.restart(i)
        c.one(cmd(rng), 3, True)


# ---------------------------------------------------------------------- pre-vote, check-quorum


@pytest.mark.parametrize("seed", [81, 82])
def test_partitioned_node_rejoining_does_not_depose_leader(seed: int) -> None:
    with Cluster(5, seed) as c:
        c.one(b"1", 5, True)
        leader = c.check_one_leader()
        term = c.term_of(leader)
        follower = leader % 5 + 1
        c.disconnect(follower)
        c.run_for(10 * RAFT_ELECTION_TIMEOUT)
        # Pre-vote: many election timeouts alone did not inflate its term.
        assert c.term_of(follower) == term
        c.connect(follower)
        c.run_for(3 * RAFT_ELECTION_TIMEOUT)
        assert c.check_one_leader() == leader
        assert c.term_of(leader) == term, "a rejoining node disrupted a healthy leader"
        c.one(b"2", 5, True)


def test_without_pre_vote_a_rejoining_node_disrupts() -> None:
    """The control for the test above: it would notice pre-vote missing."""
    with Cluster(5, 83, pre_vote=False, check_quorum=False) as c:
        c.one(b"1", 5, True)
        leader = c.check_one_leader()
        term = c.term_of(leader)
        follower = leader % 5 + 1
        c.disconnect(follower)
        c.run_for(10 * RAFT_ELECTION_TIMEOUT)
        assert c.term_of(follower) > term + 3
        c.connect(follower)
        c.run_for(3 * RAFT_ELECTION_TIMEOUT)
        assert c.term_of(c.check_one_leader()) > term


def test_check_quorum_isolated_leader_steps_down() -> None:
    with Cluster(3, 84) as c:
        leader = c.check_one_leader()
        c.partition((leader,))
        c.run_for(3 * ELECTION_TIMEOUT_MS)
        assert c.nodes[leader].core.role is not Role.LEADER  # type: ignore[union-attr]
        assert c.check_one_leader() != leader


# ---------------------------------------------------------------------- ReadIndex


@pytest.mark.parametrize("check_quorum", [True, False])
def test_read_index_no_stale_read_from_deposed_leader(check_quorum: bool) -> None:
    """A leader cut off from the majority never confirms a read, even if it still
    believes it leads (check_quorum=False keeps it believing)."""
    seed = 90 + int(check_quorum)
    with Cluster(5, seed, check_quorum=check_quorum) as c:
        answers: list[tuple[str, object]] = []
        leader = c.check_one_leader()
        c.kv_request(leader, _put("x", "1"), "w1", lambda r: answers.append(("w1", r)))
        c.run_for(200)
        assert answers == [("w1", "ok")]
        c.partition((leader,))
        c.kv_request(leader, _get("x"), "r1", lambda r: answers.append(("r1", r)))
        new_leader = c.check_one_leader()
        assert new_leader != leader
        c.kv_request(new_leader, _put("x", "2"), "w2", lambda r: answers.append(("w2", r)))
        c.run_for(300)
        assert ("w2", "ok") in answers
        if not check_quorum:
            assert c.nodes[leader].core.role is Role.LEADER  # type: ignore[union-attr]
            c.kv_request(leader, _get("x"), "r2", lambda r: answers.append(("r2", r)))
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        assert not [a for a in answers if a[0] in ("r1", "r2")], f"deposed leader answered a read: {answers}"
        c.heal()
        c.run_for(RAFT_ELECTION_TIMEOUT)
        # After healing the old leader has stepped down; a fresh read sees the new value.
        leader = c.check_one_leader()
        c.kv_request(leader, _get("x"), "r3", lambda r: answers.append(("r3", r)))
        c.run_for(300)
        assert ("r3", "2") in answers
        assert not [a for a in answers if a[0] in ("r1", "r2")]


def test_local_reads_from_deposed_leader_are_stale() -> None:
    """The control: the broken service the checker must catch really is stale."""
    with Cluster(5, 92, check_quorum=False, local_reads=True) as c:
        answers: list[tuple[str, object]] = []
        leader = c.check_one_leader()
        c.kv_request(leader, _put("x", "1"), "w1", lambda r: answers.append(("w1", r)))
        c.run_for(200)
        c.partition((leader,))
        new_leader = c.check_one_leader()
        c.kv_request(new_leader, _put("x", "2"), "w2", lambda r: answers.append(("w2", r)))
        c.run_for(300)
        c.kv_request(leader, _get("x"), "r1", lambda r: answers.append(("r1", r)))
        assert ("w2", "ok") in answers and ("r1", "1") in answers


def test_read_index_waits_for_commit_in_term() -> None:
    """A new leader answers no read until it has committed an entry of its own term."""
    with Cluster(3, 93) as c:
        c.one(b"a", 3, True)
        leader = c.check_one_leader()
        # Cut the leader off so that the next leader's no-op cannot commit at first.
        c.disconnect(leader)
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        others = [i for i in c.nodes if i != leader]
        c.disconnect(others[1])
        c.connect(leader)
        # A two-node majority {leader, others[0]} must elect; reads wait for its no-op.
        got: list[object] = []
        c.run_for(2 * RAFT_ELECTION_TIMEOUT)
        new = c.check_one_leader()
        core = c.nodes[new].core
        assert core is not None and core.log.term(core.log.committed) == core.term
        c.kv_request(new, _get("k"), "r", got.append)
        c.run_for(200)
        assert got == [None]


# ---------------------------------------------------------------------- membership, transfer


def _propose_conf(c: Cluster, cc: ConfChange) -> None:
    for _ in range(50):
        leader = c.check_one_leader()
        core = c.nodes[leader].core
        assert core is not None
        try:
            core.propose_conf_change(cc)
        except ProposalDroppedError:
            c.run_for(100)
            continue
        c._drain(c.nodes[leader])
        c.run_for(300)
        want = cc.type is ConfChangeType.ADD_NODE
        live = [n.core for n in c.nodes.values() if n.core is not None and n.id != cc.node_id]
        if all((cc.node_id in core.voters) == want for core in live):
            return
    c.fail(f"{cc} never applied")


def test_membership_add_and_remove() -> None:
    rng = random.Random(100)
    with Cluster(3, 100) as c:
        c.one(cmd(rng), 3, True)
        for _ in range(20):
            c.one(cmd(rng), 3, True)
        leader = c.check_one_leader()
        c.add_node(4, tuple(sorted(c.nodes[leader].core.voters | {4})))  # type: ignore[union-attr]
        _propose_conf(c, ConfChange(ConfChangeType.ADD_NODE, 4))
        c.one(cmd(rng), 4, True)
        assert c.nodes[4].core.voters == {1, 2, 3, 4}  # type: ignore[union-attr]
        # With 4 voters a quorum is 3: two nodes down means no progress.
        leader = c.check_one_leader()
        down = [i for i in (1, 2, 3, 4) if i != leader][:2]
        for i in down:
            c.disconnect(i)
        index, _, ok = c.start(leader, b"no-quorum")
        assert ok
        c.run_for(RAFT_ELECTION_TIMEOUT)
        assert c.n_committed(index)[0] == 0
        for i in down:
            c.connect(i)
        c.one(cmd(rng), 4, True)
        # Remove a follower; the cluster of three keeps working without it.
        leader = c.check_one_leader()
        gone = next(i for i in (1, 2, 3, 4) if i != leader)
        _propose_conf(c, ConfChange(ConfChangeType.REMOVE_NODE, gone))
        c.crash(gone)
        c.one(cmd(rng), 3, True)
        # Remove the leader itself: it steps down and the other two elect a leader.
        leader = c.check_one_leader()
        _propose_conf(c, ConfChange(ConfChangeType.REMOVE_NODE, leader))
        c.run_for(RAFT_ELECTION_TIMEOUT)
        c.crash(leader)
        new = c.check_one_leader()
        assert new != leader
        assert c.nodes[new].core.voters == {1, 2, 3, 4} - {gone, leader}  # type: ignore[union-attr]
        c.one(cmd(rng), 2, True)
        c.check_logs_match()


def test_membership_change_one_at_a_time() -> None:
    with Cluster(3, 101) as c:
        c.one(b"x", 3, True)
        leader = c.check_one_leader()
        core = c.nodes[leader].core
        assert core is not None
        c.add_node(4, (1, 2, 3, 4))
        core.propose_conf_change(ConfChange(ConfChangeType.ADD_NODE, 4))
        with pytest.raises(ProposalDroppedError):
            core.propose_conf_change(ConfChange(ConfChangeType.ADD_NODE, 5))
        c._drain(c.nodes[leader])
        c.run_for(500)
        core.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 4))


@pytest.mark.parametrize("seed", [110, 111])
def test_leadership_transfer(seed: int) -> None:
    rng = random.Random(seed)
    with Cluster(3, seed) as c:
        c.one(cmd(rng), 3, True)
        leader = c.check_one_leader()
        term = c.term_of(leader)
        target = leader % 3 + 1
        # Let the target fall behind first: the transfer must catch it up.
        c.disconnect(target)
        for _ in range(20):
            c.one(cmd(rng), 2, True)
        c.connect(target)
        c.nodes[leader].core.transfer_leadership(target)  # type: ignore[union-attr]
        c._drain(c.nodes[leader])
        c.run_for(ELECTION_TIMEOUT_MS)
        assert c.leaders() and max(c.leaders()) == c.term_of(target)
        assert c.nodes[target].core.role is Role.LEADER  # type: ignore[union-attr]
        assert c.term_of(target) == term + 1
        c.one(cmd(rng), 3, True)


def test_leadership_transfer_to_unreachable_node_times_out() -> None:
    with Cluster(3, 112) as c:
        c.one(b"a", 3, True)
        leader = c.check_one_leader()
        target = leader % 3 + 1
        c.disconnect(target)
        core = c.nodes[leader].core
        assert core is not None
        core.transfer_leadership(target)
        with pytest.raises(ProposalDroppedError):
            core.propose(b"b")
        c.run_for(3 * ELECTION_TIMEOUT_MS)
        assert core.role is Role.LEADER and core.lead_transferee is None
        c.one(b"c", 2, True)


def _put(key: str, value: str) -> KvInput:
    return KvInput("put", key, value)


def _get(key: str) -> KvInput:
    return KvInput("get", key)


# ---------------------------------------------------------------------- quiescence

QUIESCED_HEARTBEAT_MS = QUIESCED_HEARTBEAT_TICK * TICK_MS
FAILOVER_PROMISE_MS = 2000  # docs/reliability.md: a new leader within 2 s


def _quiesced_leader(c: Cluster) -> int:
    """Elect a leader, commit an entry everywhere and let the shard go quiet; the leader."""
    c.one(b"warm", len(c.nodes), True)
    c.run_for(500)
    leader = c.check_one_leader()
    for i, node in c.nodes.items():
        assert node.core is not None and node.core.quiesced, f"node {i} not quiesced (seed={c.seed})"
    return leader


@pytest.mark.parametrize("quiesce", [True, False])
def test_a_quiesced_idle_shard_sends_few_messages(quiesce: bool) -> None:
    """An idle leader slows its heartbeats to one round every QUIESCED_HEARTBEAT_TICK; nobody campaigns."""
    with Cluster(3, 121, quiesce=quiesce) as c:
        c.one(b"warm", 3, True)
        c.run_for(500)
        leader = c.check_one_leader()
        term = c.term_of(leader)
        before, hb_before = c.stats["sent"], c.stats["heartbeats_sent"]
        c.run_for(10_000)
        sent, heartbeats = c.stats["sent"] - before, c.stats["heartbeats_sent"] - hb_before
        assert c.check_one_leader() == leader and c.term_of(leader) == term
        rounds = 10_000 // QUIESCED_HEARTBEAT_MS + 1
        if quiesce:
            # One heartbeat per follower a round, answered every other round, nothing else.
            assert heartbeats <= 2 * rounds, f"{heartbeats} heartbeats in 10 idle seconds"
            assert sent <= 3 * rounds + 2, f"{sent} messages in 10 idle seconds"
        else:
            # The control: heartbeats every HEARTBEAT_TICK, 10x as many.
            assert heartbeats > 6 * rounds


@pytest.mark.parametrize("seed", [122, 123])
def test_a_proposal_wakes_a_quiesced_shard_and_commits_at_once(seed: int) -> None:
    with Cluster(3, seed, quiesce=True) as c:
        leader = _quiesced_leader(c)
        c.run_for(c.rng.uniform(0, QUIESCED_HEARTBEAT_MS))
        index, _, ok = c.start(leader, b"after a quiet spell")
        assert ok
        c.run_for(3 * TICK_MS)  # a few message delays, not a quiesced heartbeat interval
        assert c.n_committed(index) == (3, b"after a quiet spell")
        # Nothing more to do (the leader may quiesce again as soon as every follower has it): quiet again.
        c.run_for(500)
        assert all(n.core is not None and n.core.quiesced for n in c.nodes.values())
        # A read does not wake it.
        c.nodes[leader].core.read_index(b"r")  # type: ignore[union-attr]
        c._drain(c.nodes[leader])
        c.run_for(3 * TICK_MS)
        assert all(n.core is not None and n.core.quiesced for n in c.nodes.values())


@pytest.mark.parametrize("seed", range(130, 142))
def test_a_killed_quiesced_leader_is_replaced_within_the_promise(seed: int) -> None:
    """Kill -9 of an idle shard's leader: a new leader commits within 2 s (simulated)."""
    with Cluster(3, seed, quiesce=True) as c:
        leader = _quiesced_leader(c)
        c.run_for(c.rng.uniform(0, QUIESCED_HEARTBEAT_MS))  # the kill lands anywhere between two heartbeats
        c.crash(leader)
        killed_at = c.now
        while c.now - killed_at < 3 * FAILOVER_PROMISE_MS:
            c.run_for(TICK_MS)
            new = [i for i in c.alive_connected() if c.nodes[i].core.is_leader]  # type: ignore[union-attr]
            # Answering: it has committed its term's no-op, so it serves reads and writes.
            if new and c.nodes[new[0]].core.log.term(c.nodes[new[0]].core.log.committed) == c.term_of(new[0]):  # type: ignore[union-attr]
                break
        took = c.now - killed_at
        assert took <= 2 * QUIESCED_ELECTION_TICK * TICK_MS + 100, f"failover took {took:.0f} ms (seed={seed})"
        assert took <= FAILOVER_PROMISE_MS
        c.one(b"after failover", 2, True)


def test_a_quiesced_leader_cut_off_steps_down() -> None:
    """Check-quorum still works on the quiesced window: an isolated quiet leader stops leading."""
    with Cluster(3, 124, quiesce=True) as c:
        leader = _quiesced_leader(c)
        c.partition((leader,))
        c.run_for(4 * QUIESCED_ELECTION_TICK * TICK_MS + 100)  # its quorum window is 2x: the 2nd one fails
        assert c.nodes[leader].core.role is not Role.LEADER  # type: ignore[union-attr]
        assert c.check_one_leader() != leader


@pytest.mark.parametrize("seed", [125, 126])
def test_a_quiesced_follower_cut_off_and_back_does_not_depose_the_leader(seed: int) -> None:
    with Cluster(5, seed, quiesce=True) as c:
        leader = _quiesced_leader(c)
        term = c.term_of(leader)
        follower = leader % 5 + 1
        c.disconnect(follower)
        c.run_for(10 * RAFT_ELECTION_TIMEOUT)
        c.connect(follower)
        c.run_for(3 * RAFT_ELECTION_TIMEOUT)
        assert c.check_one_leader() == leader and c.term_of(leader) == term
        c.one(b"2", 5, True)


@pytest.mark.parametrize("seed", [127, 128, 129])
def test_figure8_unreliable_quiesced(seed: int) -> None:
    """The safety checks hold with quiescence too, across crashes, drops and reordering."""
    with Cluster(5, seed, unreliable=True, snapshot_every=7 if seed % 2 else 0, quiesce=True) as c:
        _figure8_unreliable(c, random.Random(seed), iters=300)


@pytest.mark.parametrize("seed", [143, 144])
def test_figure8_quiesced(seed: int) -> None:
    with Cluster(5, seed, quiesce=True) as c:
        _figure8(c, random.Random(seed), iters=300)


@pytest.mark.parametrize("seed", [145, 146])
def test_churn_quiesced(seed: int) -> None:
    with Cluster(5, seed, unreliable=seed % 2 == 1, snapshot_every=10, quiesce=True) as c:
        _churn(c, random.Random(seed), iters=20)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4000, 4020))
def test_figure8_unreliable_quiesced_nightly(seed: int) -> None:
    with Cluster(5, seed, unreliable=True, snapshot_every=7 if seed % 2 else 0, quiesce=True) as c:
        _figure8_unreliable(c, random.Random(seed), iters=1000)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4100, 4120))
def test_churn_quiesced_nightly(seed: int) -> None:
    with Cluster(5, seed, unreliable=seed % 2 == 1, snapshot_every=10 if seed % 3 == 0 else 0, quiesce=True) as c:
        _churn(c, random.Random(seed), iters=60)
