"""The metadata shard's state machine, placement, heartbeat batching and wire format, in one process."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from cacheclient.meta import PlacementMap
from cacheclient.wire import meta_pb2 as pb
from cachesvc.meta.raft import Entry, EntryKind, Message, MessageType, Snapshot, SnapshotMetadata
from cachesvc.meta.state import (
    HeartbeatBatcher,
    MetaState,
    encode_batch,
    placement_slots,
)
from cachesvc.meta.transport import message_from_proto, message_to_proto

GiB = 1 << 30


def owners(nodes: list[tuple[str, int]], keys: list[bytes]) -> list[str]:
    pm = PlacementMap(1, tuple(a for a, _ in nodes), tuple(placement_slots(nodes)))
    return [pm.locate(k) or "" for k in keys]


KEYS = [f"dataset/shard-{i:06d}".encode() for i in range(50_000)]


def test_each_node_owns_a_share_of_keys_proportional_to_its_capacity() -> None:
    nodes = [("a:1", 100 * GiB), ("b:1", 200 * GiB), ("c:1", 300 * GiB), ("d:1", 400 * GiB)]
    placed = owners(nodes, KEYS)
    total = sum(c for _, c in nodes)
    for address, capacity in nodes:
        share = placed.count(address) / len(KEYS)
        assert share == pytest.approx(capacity / total, abs=0.03), address


def test_adding_a_node_of_capacity_c_moves_about_c_over_total_of_keys_all_to_it() -> None:
    nodes = [("a:1", 100 * GiB), ("b:1", 200 * GiB), ("c:1", 300 * GiB), ("d:1", 100 * GiB)]
    before = owners(nodes, KEYS)
    added = ("e:1", 200 * GiB)
    after = owners([*nodes, added], KEYS)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    total = sum(c for _, c in nodes) + added[1]
    assert len(moved) / len(KEYS) == pytest.approx(added[1] / total, abs=0.03)
    assert all(a == added[0] for _, a in moved), "a key moved between two old nodes"


def test_removing_a_node_moves_only_its_keys() -> None:
    nodes = [("a:1", 100 * GiB), ("b:1", 200 * GiB), ("c:1", 300 * GiB)]
    before = owners(nodes, KEYS)
    after = owners(nodes[:2], KEYS)
    for b, a in zip(before, after, strict=True):
        if b != "c:1":
            assert a == b


def test_placement_map_lookup_agrees_with_the_documented_formula() -> None:
    nodes = [("a:1", 1), ("b:1", 3)]
    slots = placement_slots(nodes)
    pm = PlacementMap(7, ("a:1", "b:1"), tuple(slots))
    for k in KEYS[:1000]:
        assert pm.locate(k) == pm.nodes[slots[xxhash.xxh3_64_intdigest(k) % len(slots)]]
    assert PlacementMap(0, (), ()).locate(b"x") is None


# ---------------------------------------------------------------------- the state machine


class Log:
    """Feeds a MetaState entries the way the node does, one index at a time."""

    def __init__(self) -> None:
        self.state = MetaState()
        self.index = 0

    def apply(self, time_ms: int, *commands: pb.Command) -> list[pb.CommandResult]:
        self.index += 1
        return self.state.apply(self.index, encode_batch(time_ms, list(commands)))


def register(address: str, capacity: int) -> pb.Command:
    return pb.Command(request_id=os.urandom(8), register_node=pb.RegisterNode(address=address, capacity_bytes=capacity))


def beats(lease_ms: int, *addresses: str) -> pb.Command:
    return pb.Command(
        heartbeats=pb.Heartbeats(
            beats=[pb.NodeHeartbeat(address=a, used_bytes=1) for a in addresses], lease_ms=lease_ms
        )
    )


def test_node_lifecycle_joining_up_down_and_back() -> None:
    log = Log()
    log.apply(1000, register("a:1", 10))
    assert log.state.nodes["a:1"].state == pb.NODE_STATE_JOINING
    assert log.state.placement()[1] == []
    log.apply(1100, beats(500, "a:1"))
    assert log.state.nodes["a:1"].state == pb.NODE_STATE_UP
    assert log.state.nodes["a:1"].lease_expiry_ms == 1600
    version_up = log.state.placement_version
    assert log.state.placement()[1] == ["a:1"]
    assert log.state.expired_nodes(1500) == [] and log.state.expired_nodes(1700) == ["a:1"]
    log.apply(1700, beats(500))  # The leader's empty batch once the lease ran out.
    assert log.state.nodes["a:1"].state == pb.NODE_STATE_DOWN
    assert log.state.placement_version == version_up + 1
    assert log.state.placement()[1] == []
    log.apply(1800, beats(500, "a:1"))
    assert log.state.nodes["a:1"].state == pb.NODE_STATE_UP


def test_draining_nodes_take_no_placements() -> None:
    log = Log()
    log.apply(1, register("a:1", 10), register("b:1", 10), beats(10_000, "a:1", "b:1"))
    assert log.state.placement()[1] == ["a:1", "b:1"]
    v = log.state.placement_version
    log.apply(2, pb.Command(set_node_state=pb.SetNodeState(address="b:1", state=pb.NODE_STATE_DRAINING)))
    assert log.state.placement()[1] == ["a:1"] and log.state.placement_version == v + 1
    (refused,) = log.apply(3, pb.Command(set_node_state=pb.SetNodeState(address="zz:1", state=pb.NODE_STATE_UP)))
    assert not refused.ok and "unknown node" in refused.error


def test_a_holding_node_is_named_in_the_map_and_as_absent_while_it_is_down() -> None:
    log = Log()
    log.apply(1000, register("a:1", 10), register("b:1", 20), beats(500, "a:1", "b:1"))
    v = log.state.placement_version
    (ok,) = log.apply(1100, pb.Command(set_holding=pb.SetHolding(address="a:1", holding=True)))
    assert ok.ok and log.state.placement_holders == (("a:1",), ())
    assert log.state.placement_version == v + 1  # a map that names the holder: clients and servers refetch
    log.apply(1700, beats(500, "b:1"))  # a's lease ran out
    assert log.state.placement_holders == (("a:1",), (("a:1", 10),))
    snapshot = log.state.snapshot()
    restored = MetaState()
    restored.restore(snapshot)
    assert restored.placement_holders == log.state.placement_holders and restored.digest() == log.state.digest()
    log.apply(1800, beats(500, "a:1"))  # back up: a holder, not absent
    assert log.state.placement_holders == (("a:1",), ())
    log.apply(1900, pb.Command(set_holding=pb.SetHolding(address="a:1", holding=False)))
    assert log.state.placement_holders == ((), ())
    (refused,) = log.apply(2000, pb.Command(set_holding=pb.SetHolding(address="zz:1", holding=True)))
    assert not refused.ok and "unknown node" in refused.error


def test_the_map_says_when_its_layout_last_changed_so_a_node_can_tell_a_layout_it_missed() -> None:
    # A node that held version v and fetches a later map must know whether a layout it never saw came between
    # (its keys may have moved away and back): holder changes alone bump the version and move nothing.
    log = Log()
    log.apply(1000, register("a:1", 10), register("b:1", 20), beats(500, "a:1", "b:1"))
    held = log.state.placement_version
    first = log.state.placement_layouts
    assert first[0] == held
    log.apply(1100, pb.Command(set_holding=pb.SetHolding(address="a:1", holding=True)))
    log.apply(1200, pb.Command(set_holding=pb.SetHolding(address="b:1", holding=True)))
    assert log.state.placement_version == held + 2 and log.state.placement_layouts == first

    def fetched(state: MetaState) -> PlacementMap:
        version, nodes, slots = state.placement()
        return PlacementMap(version, tuple(nodes), tuple(slots), layouts=state.placement_layouts)

    before = PlacementMap(held, *(tuple(x) for x in log.state.placement()[1:]), layouts=first)
    assert not fetched(log.state).skips(before)  # two versions skipped, both holders only
    log.apply(1300, pb.Command(set_node_state=pb.SetNodeState(address="a:1", state=pb.NODE_STATE_DRAINING)))
    one = fetched(log.state)
    assert one.layouts == (log.state.placement_version, held) and not one.skips(before)  # one layout: the diff
    log.apply(1400, pb.Command(set_node_state=pb.SetNodeState(address="a:1", state=pb.NODE_STATE_UP)))
    back = fetched(log.state)
    assert (back.nodes, back.slots) == (before.nodes, before.slots)
    assert back.skips(before) and not back.skips(one)  # a's drain came and went unseen by a node at `held`
    restored = MetaState()
    restored.restore(log.state.snapshot())
    assert restored.placement_layouts == back.layouts
    assert restored.digest() == log.state.digest()


def test_a_retried_command_is_applied_once() -> None:
    log = Log()
    put = pb.Command(request_id=b"r1", put_manifest=pb.PutManifest(manifest=pb.Manifest(name="ds", s3_prefix="v1")))
    (first,) = log.apply(1, put)
    log.apply(2, pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest(name="ds", s3_prefix="v2"))))
    (again,) = log.apply(3, put)  # The retry of a write whose reply was lost.
    assert again == first
    assert log.state.manifests["ds"].s3_prefix == "v2"


def test_request_ids_are_forgotten_after_the_window() -> None:
    from cachesvc.meta.state import DEDUP_MS

    log = Log()
    put = pb.Command(request_id=b"r1", put_manifest=pb.PutManifest(manifest=pb.Manifest(name="ds", s3_prefix="v1")))
    log.apply(1000, put)
    log.apply(1000 + DEDUP_MS + 1)
    (again,) = log.apply(1000 + DEDUP_MS + 2, put)
    assert again.index == 3, "an id older than the window was still remembered"


def test_manifests_put_replace_delete() -> None:
    log = Log()
    items = [pb.ManifestItem(key=f"k{i}", size=i, checksum=i * 7) for i in range(3)]
    log.apply(1, pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest(name="ds", items=items))))
    assert [i.key for i in log.state.manifests["ds"].items] == ["k0", "k1", "k2"]
    assert log.state.manifests["ds"].revision == 1
    (bad,) = log.apply(2, pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest())))
    assert not bad.ok
    (ok,) = log.apply(3, pb.Command(delete_manifest=pb.DeleteManifest(name="ds")))
    (missing,) = log.apply(4, pb.Command(delete_manifest=pb.DeleteManifest(name="ds")))
    assert ok.ok and not missing.ok and "ds" not in log.state.manifests


def random_commands(rng: random.Random, n: int) -> list[pb.Command]:
    cmds = []
    for _ in range(n):
        a = f"n{rng.randrange(5)}:1"
        kind = rng.randrange(5)
        if kind == 0:
            cmds.append(register(a, rng.randrange(1, 100) * GiB))
        elif kind == 1:
            cmds.append(beats(rng.randrange(1, 50), a))
        elif kind == 2:
            cmds.append(pb.Command(set_node_state=pb.SetNodeState(address=a, state=rng.randrange(1, 5))))  # type: ignore[arg-type]
        elif kind == 3:
            m = pb.Manifest(name=f"m{rng.randrange(4)}", s3_prefix=str(rng.random()))
            cmds.append(pb.Command(request_id=os.urandom(4), put_manifest=pb.PutManifest(manifest=m)))
        else:
            cmds.append(pb.Command(delete_manifest=pb.DeleteManifest(name=f"m{rng.randrange(4)}")))
    return cmds


def test_apply_is_deterministic_and_snapshots_round_trip() -> None:
    rng = random.Random(4)
    entries = [encode_batch(t * 10, random_commands(rng, rng.randrange(0, 6))) for t in range(300)]
    a, b = MetaState(), MetaState()
    for i, data in enumerate(entries[:150], start=1):
        assert a.apply(i, data) == b.apply(i, data)
    assert a.snapshot() == b.snapshot()
    c = MetaState()
    c.restore(a.snapshot())
    assert c.snapshot() == a.snapshot() and c.digest() == a.digest()
    for i, data in enumerate(entries[150:], start=151):
        assert a.apply(i, data) == c.apply(i, data)
    assert a.digest() == c.digest() and a.placement() == c.placement()


def test_the_shard_s_epoch_is_fixed_by_its_first_entry_and_a_shard_rebuilt_from_empty_has_another() -> None:
    log = Log()
    assert log.state.epoch == 0
    log.state.apply(1, b"")  # a leader's no-op: no identity yet
    assert log.state.epoch == 0
    log.index = 1
    log.apply(1000, register("a:1", GiB), beats(10_000, "a:1"))
    epoch = log.state.epoch
    assert epoch > 0
    for t in range(2000, 2010):  # fixed from then on, whatever the placement does
        log.apply(t, register(f"n{t}:1", GiB), beats(10_000, f"n{t}:1"))
    assert log.state.epoch == epoch and log.state.placement_version > 2
    restored = MetaState()
    restored.restore(log.state.snapshot())  # snapshots carry it
    assert restored.epoch == epoch
    # Rebuilt from empty: the same commands, as a new shard's clients send them (new request ids), start
    # the versions at 1 again under another identity.
    rebuilt = Log()
    rebuilt.apply(1000, register("a:1", GiB), beats(10_000, "a:1"))
    assert rebuilt.state.placement_version == 1 and rebuilt.state.epoch not in (0, epoch)


def test_no_op_entries_only_advance_the_applied_index() -> None:
    s = MetaState()
    before = s.snapshot()
    assert s.apply(1, b"") == []
    assert s.applied_index == 1 and s.snapshot() != before
    s2 = MetaState()
    s2.apply(1, b"")
    assert s.digest() == s2.digest()


# ---------------------------------------------------------------------- heartbeats


def test_heartbeats_are_coalesced_into_one_command_per_flush() -> None:
    batcher = HeartbeatBatcher(lease_ms=5000)
    for round_ in range(100):
        for n in range(10):
            batcher.add(f"node{n}:1", used_bytes=round_ * 10 + n)
    assert batcher.received == 1000 and len(batcher) == 10
    cmd = batcher.flush()
    assert cmd is not None
    assert [(b.address, b.used_bytes) for b in cmd.heartbeats.beats] == [(f"node{n}:1", 990 + n) for n in range(10)]
    assert cmd.heartbeats.lease_ms == 5000
    assert batcher.flush() is None
    # One log entry carries them all.
    log = Log()
    log.apply(1, *[register(f"node{n}:1", GiB) for n in range(10)])
    log.apply(2, cmd)
    assert all(n.state == pb.NODE_STATE_UP and n.used_bytes >= 990 for n in log.state.nodes.values())


# ---------------------------------------------------------------------- wire format


def test_raft_messages_survive_the_wire_format() -> None:
    entries = (Entry(3, 10, b"abc"), Entry(3, 11, b"", EntryKind.CONF_CHANGE))
    snap = Snapshot(SnapshotMetadata(9, 2, (1, 2, 3)), b"state")
    for m in (
        Message(MessageType.APPEND, 1, 2, term=3, log_term=2, index=9, entries=entries, commit=8),
        Message(MessageType.APPEND_RESP, 2, 1, term=3, index=9, reject=True, reject_hint=5, log_term=1),
        Message(MessageType.SNAPSHOT, 1, 3, term=3, snapshot=snap),
        Message(MessageType.HEARTBEAT, 1, 3, term=3, commit=4, context=b"1/7"),
        Message(MessageType.HEARTBEAT, 1, 3, term=3, commit=4, quiesce=True),
        Message(MessageType.APPEND_RESP, 2, 1, term=3, index=9, reject=True),
        Message(MessageType.VOTE, 2, 3, term=4, index=11, log_term=3, context=b"transfer"),
    ):
        wire = message_to_proto(m).SerializeToString()
        assert message_from_proto(pb.RaftMessage.FromString(wire)) == m


def test_unknown_failpoint_names_are_refused() -> None:
    from cachesvc.meta.failpoint import _parse

    assert _parse("after-vote:3") == ("after-vote", 3)
    assert _parse("") is None
    with pytest.raises(ValueError, match="unknown point"):
        _parse("before-lunch")


def test_peer_lists_are_parsed_and_bad_ones_refused() -> None:
    from cachesvc.config import parse_peers

    assert parse_peers("1=127.0.0.1:7081, 2=h:7082") == {1: "127.0.0.1:7081", 2: "h:7082"}
    for bad in ("", "1=", "x=h:1", "0=h:1", "1=h:1,1=h:2", "1=hostonly"):
        with pytest.raises(ValueError):
            parse_peers(bad)
