"""Durable Raft storage: real LMDB files in a temp dir, compared with MemoryStorage,
and Raft nodes restarted from it."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.meta.raft.messages import Entry, EntryKind, HardState, Snapshot, SnapshotMetadata
from cachesvc.meta.raft.storage import LmdbStorage, MemoryStorage, Storage

from raft_sim import Cluster


def ents(lo: int, hi: int, term: int, tag: bytes = b"") -> list[Entry]:
    return [Entry(term, i, tag + str(i).encode()) for i in range(lo, hi + 1)]


def snap(index: int, term: int, data: bytes = b"state", voters: tuple[int, ...] = (1, 2, 3)) -> Snapshot:
    return Snapshot(SnapshotMetadata(index, term, voters), data)


def test_hard_state_and_log_survive_reopen(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    assert s.load() == (HardState(), None, [])
    s.save(HardState(3, 2, 4), [*ents(1, 5, 3), Entry(3, 6, b"cc", EntryKind.CONF_CHANGE)])
    s.close()
    hs, sn, log = LmdbStorage(tmp_path).load()
    assert hs == HardState(3, 2, 4)
    assert sn is None
    assert log == [*ents(1, 5, 3), Entry(3, 6, b"cc", EntryKind.CONF_CHANGE)]


def test_append_replaces_the_conflicting_suffix(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.save(HardState(1, 1, 0), ents(1, 8, 1))
    s.save(HardState(2, None, 2), ents(3, 4, 2, b"new"))
    assert s.load() == (HardState(2, None, 2), None, ents(1, 2, 1) + ents(3, 4, 2, b"new"))


def test_received_snapshot_replaces_the_log(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.save(HardState(1, 1, 2), ents(1, 6, 1))
    s.save(HardState(4, None, 20), [], snap(20, 4, b"leader's state", (1, 2, 3, 4)))
    s.save(None, ents(21, 22, 4))
    s.close()
    hs, sn, log = LmdbStorage(tmp_path).load()
    assert hs == HardState(4, None, 20)
    assert sn == snap(20, 4, b"leader's state", (1, 2, 3, 4))
    assert log == ents(21, 22, 4)


def test_compact_keeps_one_snapshot_and_the_entries_after_it(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.save(HardState(2, 1, 10), ents(1, 10, 2))
    s.compact(snap(4, 2, b"four"))
    s.compact(snap(7, 2, b"seven"))
    s.compact(snap(5, 2, b"stale"))  # Older than what is stored: ignored.
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == [f"{7:020d}-{2:020d}.snap"]
    s.close()
    _, sn, log = LmdbStorage(tmp_path).load()
    assert sn == snap(7, 2, b"seven")
    assert log == ents(8, 10, 2)


def test_crash_between_snapshot_file_and_log_trim(tmp_path: Path) -> None:
    # A local compaction: the log agrees with the snapshot, entries after it stay.
    local = LmdbStorage(tmp_path / "local")
    local.save(HardState(2, 1, 10), ents(1, 10, 2))
    local._write_snapshot(snap(6, 2))  # The crash came before the LMDB transaction.
    local.close()
    s = LmdbStorage(tmp_path / "local")
    assert s.load() == (HardState(2, 1, 10), snap(6, 2), ents(7, 10, 2))
    assert s.load() == (HardState(2, 1, 10), snap(6, 2), ents(7, 10, 2))  # Repaired for good.
    # A snapshot from the leader: the old log disagrees with it and must go.
    remote = LmdbStorage(tmp_path / "remote")
    remote.save(HardState(2, 1, 3), ents(1, 10, 2))
    remote._write_snapshot(snap(12, 5))
    remote.close()
    assert LmdbStorage(tmp_path / "remote").load()[1:] == (snap(12, 5), [])


def test_interrupted_snapshot_write_is_ignored(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.save(HardState(1, 1, 3), ents(1, 3, 1))
    s.compact(snap(2, 1))
    s.close()
    torn = tmp_path / "snapshots" / f"{9:020d}-{1:020d}.tmp"
    torn.write_bytes(b"half a snapsh")
    assert LmdbStorage(tmp_path).load() == (HardState(1, 1, 3), snap(2, 1), ents(3, 3, 1))
    assert not torn.exists()


# ---------------------------------------------------------------------- against the in-memory reference

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 4), st.integers(1, 5)),
        st.tuples(st.just("hard"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("compact"), st.integers(0, 6)),
        st.tuples(st.just("install"), st.integers(1, 5)),
        st.tuples(st.just("reopen")),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_lmdb_storage_matches_memory_storage(program: list[tuple]) -> None:
    """Any sequence of Raft-shaped saves leaves LMDB holding what the reference holds."""
    with tempfile.TemporaryDirectory() as d:
        mem = MemoryStorage()
        disk: Storage = LmdbStorage(d)
        term = 1
        for op in program:
            _, sn, log = mem.load()
            base = sn.metadata.index if sn else 0
            last = log[-1].index if log else base
            if op[0] == "append":
                term += 1
                start = max(base + 1, last + 1 - op[1])
                batch = ents(start, start + op[2] - 1, term)
                mem.save(None, batch)
                disk.save(None, batch)
            elif op[0] == "hard":
                hs = HardState(term + op[1], op[2] or None, base)
                mem.save(hs, [])
                disk.save(hs, [])
            elif op[0] == "compact" and log:
                index = min(last, base + op[1])
                if index > base:
                    s = snap(index, next(e.term for e in log if e.index == index), b"at %d" % index)
                    mem.compact(s)
                    disk.compact(s)
            elif op[0] == "install":
                term += 1
                s = snap(last + op[1], term, b"from leader")
                mem.save(None, [], s)
                disk.save(None, [], s)
            elif op[0] == "reopen":
                disk.close()
                disk = LmdbStorage(d)
            assert disk.load() == mem.load()
        disk.close()


# ---------------------------------------------------------------------- Raft nodes on LMDB


def test_cluster_on_lmdb_survives_full_restart(tmp_path: Path) -> None:
    seed = 7
    rng = random.Random(seed)
    with Cluster(3, seed, snapshot_every=10, open_storage=lambda i: LmdbStorage(tmp_path / f"n{i}")) as c:
        for _k in range(25):
            c.one(str(rng.random()).encode(), 3, True)
        before = {i: (n.core.hard_state, n.core.log.last_index()) for i, n in c.nodes.items()}  # type: ignore[union-attr]
        committed = dict(c.committed)
        for i in c.nodes:
            c.crash(i)
        for i in c.nodes:
            hs, sn, log = LmdbStorage(tmp_path / f"n{i}").load()
            # Each node recovers its term, vote and log, and a snapshot bounds the log.
            assert (hs.term, hs.vote) == (before[i][0].term, before[i][0].vote)
            assert sn is not None and sn.metadata.voters == (1, 2, 3)
            assert (log[-1].index if log else sn.metadata.index) == before[i][1]
            assert all(committed[e.index] == (e.term, e.data) for e in log if e.index in committed)
        for i in c.nodes:
            c.restart(i)
        last = c.one(b"after restart", 3, True)
        assert last > max(committed)
        # Restarted state machines (snapshot plus replay) agree with the pre-crash digests.
        assert all(n.sm.digest == c.digest_at[n.sm.index] for n in c.nodes.values())
