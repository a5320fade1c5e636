"""The metadata shard's state machine: cache-node membership, placement, dataset manifests.

Deterministic: the state after applying a sequence of log entries depends on
those entries alone. Time comes from the entries (the leader stamps each
`CommandBatch` with its clock), never from the applying node's clock, and
the state serialises to bytes (`snapshot`) and back (`restore`) exactly.

What it holds:

* cache nodes by address: capacity, state (joining, up, draining, down), bytes
  used, lease expiry, and whether the node may hold write-back values object
  storage lacks (`holding`, which it sets before it acknowledges one and
  clears once all are uploaded; removing the node forgets them). A heartbeat makes a joining or down node up and
  extends its lease; a node whose lease has passed at the time of a later
  batch goes down.
* the shard's identity, `epoch`: a hash of its first log entry (the leader's
  clock and the clients' random request ids), fixed from then on and carried
  in snapshots. A shard rebuilt from empty gets another, and its placement
  versions start again at 1: clients and servers follow a map of another
  epoch whatever its version (`PlacementMap.newer_than`).
* the placement map, versioned: a fixed number of slots, each owned by the up
  node that wins capacity-weighted rendezvous hashing for it, so a node of
  capacity c owns about c/total of the slots, and adding it moves only the
  slots it wins (`placement_slots`, from the wire contract: clients and
  servers rank a slot's further candidates with the same function).
* dataset manifests by name.
* the namespace table (prefix, write mode, lease, TTL, replicas) and the
  tenants (the prefixes each owns, byte quotas per tier, priority, the hash
  of its token), with `namespaces_version`: the log index of their last
  change, 0 while the shard has none (nodes then follow their config files).
* the ids of recently applied client commands, so a retried command (same
  request id) is applied once and answered with its first result.

`HeartbeatBatcher` is the leader's side of non-critical updates: it coalesces
heartbeats by address between flushes so that many heartbeats become one
`Heartbeats` command in one log entry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cacheclient.wire import NODE_STATE_NAMES
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.placement import PLACEMENT_SLOTS, placement_slots

__all__ = [
    "PLACEMENT_SLOTS",
    "HeartbeatBatcher",
    "MetaState",
    "NodeRecord",
    "encode_batch",
    "placement_slots",
]

WRITE_MODES = ("write-through", "write-back", "cache-only")
PRIORITIES = ("high", "normal", "low")

DEDUP_MS = 60_000
"""How long (in the shard's clock) a request id is remembered for exactly-once retries."""
DEDUP_MAX = 200_000
"""Most request ids remembered; past it the oldest are forgotten early."""


@dataclass(slots=True)
class NodeRecord:
    """One cache node as the shard knows it."""

    address: str
    capacity_bytes: int
    state: int = pb.NODE_STATE_JOINING
    lease_expiry_ms: int = 0
    used_bytes: int = 0
    holding: bool = False
    """It may hold write-back values object storage lacks (it said so before acknowledging one)."""

    def to_proto(self) -> pb.CacheNode:
        return pb.CacheNode(
            address=self.address,
            capacity_bytes=self.capacity_bytes,
            state=self.state,  # type: ignore[arg-type]
            lease_expiry_ms=self.lease_expiry_ms,
            used_bytes=self.used_bytes,
            holding=self.holding,
        )


def _epoch_of(first_entry: bytes) -> int:
    """The shard's identity from its first entry with commands: 63 bits of its hash, never 0."""
    digest = int.from_bytes(hashlib.blake2b(first_entry, digest_size=8).digest(), "big") >> 1
    return digest or 1


def encode_batch(time_ms: int, commands: Sequence[pb.Command]) -> bytes:
    """The log-entry bytes for `commands`, stamped with the leader's clock."""
    return pb.CommandBatch(time_ms=time_ms, commands=commands).SerializeToString()


class MetaState:
    """The replicated state; see the module docstring.

    Only `apply` and `restore` change it, and both are deterministic.
    """

    def __init__(self) -> None:
        self.applied_index = 0
        self.time_ms = 0
        self.nodes: dict[str, NodeRecord] = {}
        self.manifests: dict[str, pb.Manifest] = {}
        self.namespaces: dict[str, pb.Namespace] = {}
        """The namespace table by prefix."""
        self.tenants: dict[str, pb.Tenant] = {}
        """The tenants by name."""
        self.namespaces_version = 0
        """The log index of the last change of `namespaces` or `tenants`; 0: never set."""
        self.epoch = 0
        """The shard's identity (see the module docstring); 0 until the first entry with commands."""
        self.placement_version = 0
        self.layout_version = 0
        """The placement version of the last change of the up members (so of the slots); 0: none yet."""
        self.layout_before = 0
        """The placement version of the change of the up members before that one (`PlacementMap.skips`)."""
        self._placement_key: tuple[tuple[str, int], ...] = ()
        self._holders_key: tuple[tuple[str, ...], tuple[tuple[str, int], ...]] = ((), ())
        self._placement_cache: tuple[int, list[str], list[int]] | None = None
        # request id -> what it got and when, oldest first.
        self._dedup: OrderedDict[bytes, pb.AppliedRequest] = OrderedDict()
        self._digest: tuple[int, bytes] | None = None

    # ------------------------------------------------------------------ applying

    def apply(self, index: int, data: bytes) -> list[pb.CommandResult]:
        """Apply one committed log entry; returns one result per command in it.

        Empty data (a leader's no-op) and membership-change entries apply nothing
        but still advance `applied_index`.
        """
        self.applied_index = index
        if not data:
            return []
        batch = pb.CommandBatch.FromString(data)
        if not self.epoch:
            self.epoch = _epoch_of(data)
        # The shard's clock never runs backwards, whichever leader stamped the batch.
        self.time_ms = max(self.time_ms, batch.time_ms)
        results = []
        for cmd in batch.commands:
            rid = cmd.request_id
            seen = self._dedup.get(rid) if rid else None
            if seen is not None:
                again = pb.CommandResult()
                again.CopyFrom(seen.result)
                results.append(again)
                continue
            result = self._apply_command(index, cmd)
            if rid:
                self._dedup[rid] = pb.AppliedRequest(request_id=rid, result=result, time_ms=self.time_ms)
            results.append(result)
        self._forget_request_ids()
        self._expire_leases()
        self._update_placement_version()
        for r in results:
            r.placement_version = self.placement_version
        return results

    def _apply_command(self, index: int, cmd: pb.Command) -> pb.CommandResult:
        op = cmd.WhichOneof("op")
        ok = pb.CommandResult(ok=True, index=index)
        if op == "register_node":
            r = cmd.register_node
            if not r.address:
                return pb.CommandResult(ok=False, error="empty address", index=index)
            node = self.nodes.get(r.address)
            if node is None:
                self.nodes[r.address] = NodeRecord(r.address, r.capacity_bytes)
            else:
                node.capacity_bytes = r.capacity_bytes
            return ok
        if op == "set_node_state":
            s = cmd.set_node_state
            node = self.nodes.get(s.address)
            if node is None:
                return pb.CommandResult(ok=False, error=f"unknown node {s.address}", index=index)
            if s.state not in NODE_STATE_NAMES:
                return pb.CommandResult(ok=False, error=f"bad state {s.state}", index=index)
            node.state = s.state
            return ok
        if op == "set_holding":
            h = cmd.set_holding
            node = self.nodes.get(h.address)
            if node is None:
                return pb.CommandResult(ok=False, error=f"unknown node {h.address}", index=index)
            node.holding = h.holding
            return ok
        if op == "remove_node":
            if self.nodes.pop(cmd.remove_node.address, None) is None:
                return pb.CommandResult(ok=False, error=f"unknown node {cmd.remove_node.address}", index=index)
            return ok
        if op == "put_manifest":
            m = pb.Manifest()
            m.CopyFrom(cmd.put_manifest.manifest)
            if not m.name:
                return pb.CommandResult(ok=False, error="manifest without a name", index=index)
            m.revision = index
            self.manifests[m.name] = m
            return ok
        if op == "delete_manifest":
            if self.manifests.pop(cmd.delete_manifest.name, None) is None:
                return pb.CommandResult(ok=False, error=f"no manifest {cmd.delete_manifest.name}", index=index)
            return ok
        if op in ("put_namespace", "delete_namespace", "put_tenant", "delete_tenant"):
            error = self._apply_table_command(cmd)
            if error:
                return pb.CommandResult(ok=False, error=error, index=index)
            self.namespaces_version = index
            return ok
        if op == "heartbeats":
            hb = cmd.heartbeats
            for beat in hb.beats:
                node = self.nodes.get(beat.address)
                if node is None:
                    continue  # Removed since; the next heartbeat is refused.
                node.used_bytes = beat.used_bytes
                node.lease_expiry_ms = self.time_ms + hb.lease_ms
                if node.state in (pb.NODE_STATE_JOINING, pb.NODE_STATE_DOWN):
                    node.state = pb.NODE_STATE_UP
            return ok
        return pb.CommandResult(ok=False, error="empty command", index=index)

    def _apply_table_command(self, cmd: pb.Command) -> str:
        """Applies a namespace or tenant command; "" when applied, else why it was refused."""
        op = cmd.WhichOneof("op")
        if op == "put_namespace":
            ns, replace = cmd.put_namespace.namespace, cmd.put_namespace.replace
            error = _namespace_error(ns)
            if error:
                return error
            if replace and ns.prefix not in self.namespaces:
                return f"no namespace {ns.prefix!r}"
            if not replace and ns.prefix in self.namespaces:
                return f"namespace {ns.prefix!r} exists (set changes it)"
            kept = pb.Namespace()
            kept.CopyFrom(ns)
            self.namespaces[ns.prefix] = kept
            return ""
        if op == "delete_namespace":
            prefix = cmd.delete_namespace.prefix
            if prefix not in self.namespaces:
                return f"no namespace {prefix!r}"
            owner = next((t.name for t in self.tenants.values() if prefix in t.prefixes), None)
            if owner is not None:
                return f"namespace {prefix!r} belongs to tenant {owner!r} (tenant set or rm first)"
            del self.namespaces[prefix]
            return ""
        if op == "put_tenant":
            tenant, replace = cmd.put_tenant.tenant, cmd.put_tenant.replace
            error = _tenant_error(tenant)
            if error:
                return error
            if replace and tenant.name not in self.tenants:
                return f"no tenant {tenant.name!r}"
            if not replace and tenant.name in self.tenants:
                return f"tenant {tenant.name!r} exists (set changes it)"
            if not replace and not tenant.token_sha256:
                return f"tenant {tenant.name!r}: a new tenant needs its token's hash"
            for other in self.tenants.values():
                if other.name == tenant.name:
                    continue
                for mine in tenant.prefixes:
                    for theirs in other.prefixes:
                        if mine.startswith(theirs) or theirs.startswith(mine):
                            return f"prefix {mine!r} overlaps {theirs!r} of tenant {other.name!r}"
            kept = pb.Tenant()
            kept.CopyFrom(tenant)
            if replace and not kept.token_sha256:
                kept.token_sha256 = self.tenants[tenant.name].token_sha256
            self.tenants[tenant.name] = kept
            for prefix in kept.prefixes:  # a tenant's prefixes are namespaces (write-through unless set)
                if prefix not in self.namespaces:
                    self.namespaces[prefix] = pb.Namespace(prefix=prefix, write_mode="write-through", replicas=1)
            return ""
        name = cmd.delete_tenant.name
        if self.tenants.pop(name, None) is None:
            return f"no tenant {name!r}"
        return ""

    def _forget_request_ids(self) -> None:
        # Clients give up on a request well within DEDUP_MS, so a retry never
        # arrives after its id is forgotten.
        horizon = self.time_ms - DEDUP_MS
        dedup = self._dedup
        while dedup:
            oldest = next(iter(dedup.values()))
            if oldest.time_ms >= horizon and len(dedup) <= DEDUP_MAX:
                break
            dedup.popitem(last=False)

    def _expire_leases(self) -> None:
        for node in self.nodes.values():
            if node.state != pb.NODE_STATE_DOWN and 0 < node.lease_expiry_ms < self.time_ms:
                node.state = pb.NODE_STATE_DOWN

    def expired_nodes(self, now_ms: int) -> list[str]:
        """Nodes not yet down whose lease has passed at `now_ms` (the leader's clock)."""
        return [
            n.address for n in self.nodes.values() if n.state != pb.NODE_STATE_DOWN and 0 < n.lease_expiry_ms < now_ms
        ]

    # ------------------------------------------------------------------ placement

    @property
    def placement_members(self) -> tuple[tuple[str, int], ...]:
        """(address, capacity) of the nodes that take placements (the up ones), by address."""
        return self._placement_key

    def _up_members(self) -> tuple[tuple[str, int], ...]:
        return tuple(
            (n.address, n.capacity_bytes)
            for n in sorted(self.nodes.values(), key=lambda n: n.address)
            if n.state == pb.NODE_STATE_UP
        )

    @property
    def placement_holders(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        """(the holding nodes' addresses, the down ones among them with their capacities), by address: what
        the placement map says of write-back values object storage may lack (`PlacementMap.withheld`)."""
        return self._holders_key

    @property
    def placement_layouts(self) -> tuple[int, int]:
        """(`layout_version`, `layout_before`): what the placement map says of its layout's changes."""
        return self.layout_version, self.layout_before

    def _holders(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        holding = sorted((n for n in self.nodes.values() if n.holding), key=lambda n: n.address)
        absent = tuple((n.address, n.capacity_bytes) for n in holding if n.state == pb.NODE_STATE_DOWN)
        return tuple(n.address for n in holding), absent

    def _update_placement_version(self) -> None:
        key, holders = self._up_members(), self._holders()
        if key != self._placement_key or holders != self._holders_key:
            if key != self._placement_key:
                self.layout_before, self.layout_version = self.layout_version, self.placement_version + 1
            self._placement_key, self._holders_key = key, holders
            self.placement_version += 1
            self._placement_cache = None

    def placement(self) -> tuple[int, list[str], list[int]]:
        """(version, node addresses, slot owners) of the current placement map."""
        if self._placement_cache is None or self._placement_cache[0] != self.placement_version:
            members = list(self._placement_key)
            self._placement_cache = (self.placement_version, [a for a, _ in members], placement_slots(members))
        return self._placement_cache

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> bytes:
        """The whole state as bytes (deterministic: equal states give equal bytes)."""
        snap = pb.MetaSnapshot(
            applied_index=self.applied_index,
            time_ms=self.time_ms,
            placement_version=self.placement_version,
            epoch=self.epoch,
            layout_version=self.layout_version,
            layout_before=self.layout_before,
            nodes=[self.nodes[a].to_proto() for a in sorted(self.nodes)],
        )
        # Copies done by protobuf in C: a large state snapshots in tens of ms, not
        # hundreds, and the Raft thread that takes it keeps its heartbeats going.
        snap.manifests.extend(self.manifests[name] for name in sorted(self.manifests))
        snap.requests.extend(self._dedup.values())
        snap.namespaces.extend(self.namespaces[p] for p in sorted(self.namespaces))
        snap.tenants.extend(self.tenants[n] for n in sorted(self.tenants))
        snap.namespaces_version = self.namespaces_version
        return snap.SerializeToString(deterministic=True)

    def restore(self, data: bytes) -> None:
        """Replace the whole state by a `snapshot`'s."""
        snap = pb.MetaSnapshot.FromString(data)
        self.applied_index = snap.applied_index
        self.time_ms = snap.time_ms
        self.nodes = {
            n.address: NodeRecord(n.address, n.capacity_bytes, n.state, n.lease_expiry_ms, n.used_bytes, n.holding)
            for n in snap.nodes
        }
        self.manifests = {m.name: m for m in snap.manifests}
        self.namespaces = {ns.prefix: ns for ns in snap.namespaces}
        self.tenants = {t.name: t for t in snap.tenants}
        self.namespaces_version = snap.namespaces_version
        self._dedup = OrderedDict((r.request_id, r) for r in snap.requests)
        self.placement_version = snap.placement_version
        self.epoch = snap.epoch
        self.layout_version, self.layout_before = snap.layout_version, snap.layout_before
        if not self.layout_version:  # a snapshot from before layouts were counted: say every layout may have moved
            self.layout_version = self.layout_before = self.placement_version
        self._placement_key, self._holders_key = self._up_members(), self._holders()
        self._placement_cache = None
        self._digest = None

    def digest(self) -> bytes:
        """A short hash of `snapshot()`: equal on two nodes iff their states are equal."""
        if self._digest is None or self._digest[0] != self.applied_index:
            self._digest = (self.applied_index, hashlib.blake2b(self.snapshot(), digest_size=16).digest())
        return self._digest[1]


def _namespace_error(ns: pb.Namespace) -> str:
    """Why `ns` cannot be in the table ("" when it can)."""
    if not ns.prefix:
        return "a namespace needs a prefix"
    if ns.write_mode not in WRITE_MODES:
        return f"namespace {ns.prefix!r}: write mode must be one of {', '.join(WRITE_MODES)}, got {ns.write_mode!r}"
    if ns.lease_seconds < 0 or ns.ttl_seconds < 0:
        return f"namespace {ns.prefix!r}: lease and TTL must be >= 0"
    if ns.replicas < 1:
        return f"namespace {ns.prefix!r}: replicas must be >= 1, got {ns.replicas}"
    return ""


def _tenant_error(tenant: pb.Tenant) -> str:
    """Why `tenant` cannot be kept ("" when it can)."""
    if not tenant.name:
        return "a tenant needs a name"
    if not tenant.prefixes or not all(tenant.prefixes):
        return f"tenant {tenant.name!r}: needs at least one non-empty prefix"
    if tenant.priority not in PRIORITIES:
        return f"tenant {tenant.name!r}: priority must be one of {', '.join(PRIORITIES)}, got {tenant.priority!r}"
    if len(tenant.token_sha256) not in (0, 32):
        return f"tenant {tenant.name!r}: token_sha256 must be 32 bytes"
    return ""


class HeartbeatBatcher:
    """The leader's buffer of cache-node heartbeats, coalesced by address.

    Heartbeats are non-critical: losing the buffer with a leader only delays a
    lease extension by one heartbeat interval. So they are acknowledged when
    buffered, and `flush` turns everything buffered into one command.
    """

    def __init__(self, lease_ms: int) -> None:
        """Args:
        lease_ms: The lease a replicated heartbeat grants.
        """
        self.lease_ms = lease_ms
        self._beats: dict[str, int] = {}
        self.received = 0

    def add(self, address: str, used_bytes: int) -> None:
        """Buffer one heartbeat; a later one from the same node replaces it."""
        self._beats[address] = used_bytes
        self.received += 1

    def __len__(self) -> int:
        return len(self._beats)

    def flush(self) -> pb.Command | None:
        """One command carrying every buffered heartbeat, or None if there are none."""
        if not self._beats:
            return None
        beats = [pb.NodeHeartbeat(address=a, used_bytes=u) for a, u in sorted(self._beats.items())]
        self._beats = {}
        return pb.Command(heartbeats=pb.Heartbeats(beats=beats, lease_ms=self.lease_ms))

    def discard(self, address: str) -> None:
        """Drop `address`'s buffered beat (its state is being set: the beat came before)."""
        self._beats.pop(address, None)

    def clear(self) -> None:
        """Drop everything buffered (this node stopped leading)."""
        self._beats = {}
