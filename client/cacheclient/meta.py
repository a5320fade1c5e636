"""`MetaClient`: the Python client of the metadata shard.

Give it the addresses of any of the shard's nodes. It sends each call to
the node it believes leads; a node that does not lead answers with a leader
hint, which the client follows, and a node that is down or mid-election is
skipped for the next one, until the call's overall deadline. Every write
carries a request id, kept across retries, so a write whose reply was lost is
applied once however often it is retried.

Reads are linearizable (the node confirms it is current through a Raft
ReadIndex round) unless `stale=True`.

The placement map (which cache node holds which key) is cached in the
client: `locate(key)` is a hash and two list look-ups, refreshed from the
shard at most every `placement_ttl` seconds.

Fork safety: channels are a `ProcessLocal`, created lazily in each process
and dropped in a child after `fork`; the client pickles without them. This
module never imports `cachesvc`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cacheclient.errors import (
    CacheClientError,
    DeadlineError,
    InvalidRequestError,
    UnavailableError,
    from_rpc_error,
)
from cacheclient.process_local import ProcessLocal, keep_grpc_initialised
from cacheclient.wire import (
    LEADER_ADDRESS_METADATA,
    LIMIT_METADATA,
    META_MAX_MESSAGE_BYTES,
    bearer_metadata,
    meta_pb2_grpc,
    node_state_name,
    node_state_value,
)
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.placement import PlacementMap

__all__ = [
    "CacheNode",
    "CommandRefusedError",
    "Manifest",
    "ManifestItem",
    "MetaClient",
    "NamespaceEntry",
    "NamespaceTable",
    "NoLeaderError",
    "PlacementMap",
    "TenantEntry",
]

# Worth another node or another try: the node is down, busy, or between leaders.
_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)

_CHANNEL_OPTIONS = [
    # A large manifest or node list comes back in one message.
    ("grpc.max_receive_message_length", META_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", META_MAX_MESSAGE_BYTES),
    # A channel of its own in each process (see `CacheClient`).
    ("grpc.use_local_subchannel_pool", 1),
    # A metadata node that restarted (or a shard rebuilt on the same ports) is reached again within 2 s:
    # gRPC's reconnect backoff otherwise grows to 120 s, and a cache server's heartbeats and placement
    # fetches would wait it out.
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class _Channels:
    """One process's channels and stubs, by node address."""

    def __init__(self, tls_ca: bytes | None = None) -> None:
        self._credentials = grpc.ssl_channel_credentials(tls_ca) if tls_ca is not None else None
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Any] = {}

    def stub(self, address: str) -> Any:
        stub = self._stubs.get(address)
        if stub is None:
            with self._lock:
                stub = self._stubs.get(address)
                if stub is None:
                    keep_grpc_initialised()
                    channel = (
                        grpc.secure_channel(address, self._credentials, _CHANNEL_OPTIONS)
                        if self._credentials is not None
                        else grpc.insecure_channel(address, _CHANNEL_OPTIONS)
                    )
                    self._channels[address] = channel
                    stub = self._stubs[address] = meta_pb2_grpc.MetaServiceStub(channel)
        return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()


class NoLeaderError(UnavailableError):
    """No node of the shard could serve the call before its deadline (no leader, or none reachable)."""


class CommandRefusedError(CacheClientError):
    """The shard applied the command as a no-op and said why (an unknown node, a bad state...)."""


@dataclass(frozen=True, slots=True)
class ManifestItem:
    """One object of a dataset: its key, size in bytes and xxh3-64 checksum."""

    key: str
    size: int = 0
    checksum: int = 0


@dataclass(frozen=True, slots=True)
class Manifest:
    """A dataset: objects under an S3 prefix and/or an explicit item list.

    Attributes:
        name: The dataset's name.
        s3_prefix: Objects under this prefix belong to it ("" if none).
        items: Explicit objects.
        revision: Log index of the write that stored this version.
    """

    name: str
    s3_prefix: str = ""
    items: tuple[ManifestItem, ...] = ()
    revision: int = 0


@dataclass(frozen=True, slots=True)
class CacheNode:
    """A cache server as the shard knows it.

    Attributes:
        address: Its host:port.
        capacity_bytes: What it offers; placement is weighted by this.
        state: "joining", "up", "draining" or "down".
        lease_expiry_ms: When it goes down without another heartbeat (ms since the epoch).
        used_bytes: As last reported by heartbeat.
        holding: Whether it may hold write-back values object storage lacks.
    """

    address: str
    capacity_bytes: int
    state: str
    lease_expiry_ms: int
    used_bytes: int
    holding: bool = False


@dataclass(frozen=True, slots=True)
class NamespaceEntry:
    """A key namespace in the shard's table (`cachectl namespace add`).

    Attributes:
        prefix: Keys starting with it belong to it (the longest prefix wins).
        write_mode: "write-through", "write-back" or "cache-only".
        lease_seconds: Default lease of its puts (0: none).
        ttl_seconds: Default time to live of its puts (0: none).
        replicas: How many nodes hold each of its keys.
    """

    prefix: str
    write_mode: str = "write-through"
    lease_seconds: float = 0.0
    ttl_seconds: float = 0.0
    replicas: int = 1

    def to_proto(self) -> pb.Namespace:
        return pb.Namespace(
            prefix=self.prefix,
            write_mode=self.write_mode,
            lease_seconds=self.lease_seconds,
            ttl_seconds=self.ttl_seconds,
            replicas=self.replicas,
        )

    @classmethod
    def from_proto(cls, ns: pb.Namespace) -> NamespaceEntry:
        return cls(ns.prefix, ns.write_mode, ns.lease_seconds, ns.ttl_seconds, ns.replicas)


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """A tenant in the shard (`cachectl tenant add`).

    Attributes:
        name: Its name, said in refusals of its token.
        prefixes: The namespaces it owns: its token reads and writes keys under them only.
        l1_bytes: Its quota of L1 bytes per node (0: none).
        l2_bytes: Its quota of L2 bytes per node (0: none).
        priority: "high", "normal" or "low".
        token_sha256: The hash of its token (empty unless read with the admin token).
    """

    name: str
    prefixes: tuple[str, ...]
    l1_bytes: int = 0
    l2_bytes: int = 0
    priority: str = "normal"
    token_sha256: bytes = b""

    def to_proto(self) -> pb.Tenant:
        return pb.Tenant(
            name=self.name,
            prefixes=self.prefixes,
            l1_bytes=self.l1_bytes,
            l2_bytes=self.l2_bytes,
            priority=self.priority,
            token_sha256=self.token_sha256,
        )

    @classmethod
    def from_proto(cls, t: pb.Tenant) -> TenantEntry:
        return cls(t.name, tuple(t.prefixes), t.l1_bytes, t.l2_bytes, t.priority, t.token_sha256)


@dataclass(frozen=True, slots=True)
class NamespaceTable:
    """The shard's namespace table and tenants at one version (the log index of their last change; 0: none)."""

    version: int
    namespaces: tuple[NamespaceEntry, ...] = ()
    tenants: tuple[TenantEntry, ...] = ()


class MetaClient:
    """A client of the metadata shard; see the module docstring.

    Args:
        addresses: "host:port" of one or more nodes, as a list or a comma-separated string.
        timeout: Default overall deadline of a call, retries included, in seconds.
        attempt_timeout: Deadline of one try against one node.
        placement_ttl: How long `locate` trusts its cached placement map.
        token: bearer token, when the shard requires one (a missing or wrong
            one fails every call with `AuthError`; so does a data token on
            an admin call, `cacheclient.wire.scopes`).
        tls_ca: PEM bytes or a path of the CA that signed the nodes'
            certificates, when the shard speaks TLS (without it, a TLS node
            does not answer: `UnavailableError`).
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout: float = 10.0,
        attempt_timeout: float = 1.0,
        placement_ttl: float = 5.0,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise InvalidRequestError("MetaClient needs at least one address")
        self.addresses = list(addresses)
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.placement_ttl = placement_ttl
        self._metadata: tuple[tuple[str, str], ...] = bearer_metadata(token) if token else ()
        self._leader: str | None = None
        self._next = 0
        if isinstance(tls_ca, str):
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        self._tls = tls_ca is not None
        self._channels = ProcessLocal(functools.partial(_Channels, tls_ca), _Channels.close)
        self._placement: PlacementMap | None = None
        self._placement_expiry = 0.0

    def __repr__(self) -> str:
        return f"MetaClient({self.addresses!r})"

    # -- channels ---------------------------------------------------------

    def _stub(self, address: str) -> Any:
        return self._channels.get().stub(address)

    def close(self) -> None:
        """Close every channel; the client reconnects if used again."""
        self._channels.close()

    def __enter__(self) -> MetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry loop -----------------------------------------------------

    def _target(self) -> str:
        leader = self._leader
        if leader is not None:
            return leader
        return self.addresses[self._next % len(self.addresses)]

    def _skip(self, address: str) -> None:
        if self._leader == address:
            self._leader = None
        if self.addresses[self._next % len(self.addresses)] == address:
            self._next += 1

    def _tls_hint(self, error: grpc.RpcError) -> str:
        """Why a TLS mismatch looks like an unreachable shard, when that is likely."""
        text = (error.details() or "").lower()
        if not self._tls and "socket closed" in text:
            return " (does the shard speak TLS? give the CA that signed its certificates: tls_ca=)"
        if self._tls and any(word in text for word in ("ssl", "handshake", "certificate", "tls")):
            return " (TLS: does the shard speak TLS, and did this tls_ca sign its certificates?)"
        return ""

    def _call(self, method: str, request: Any, timeout: float | None, address: str | None = None) -> Any:
        """Call `method`, following leader hints and skipping dead nodes until the deadline."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        last: grpc.RpcError | None = None
        tries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last is not None and last.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    raise NoLeaderError(f"{method}: no leader found before the deadline")
                if last is not None and last.code() in _RETRYABLE:
                    raise NoLeaderError(
                        f"{method}: no node answered: {last.code().name}: {last.details()}{self._tls_hint(last)}"
                    )
                raise DeadlineError(f"{method}: deadline exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)
            target = address or self._target()
            try:
                response = getattr(self._stub(target), method)(
                    request, timeout=min(self.attempt_timeout, remaining), metadata=self._metadata
                )
            except grpc.RpcError as exc:
                last = exc
                tries += 1
                code = exc.code()
                if code is grpc.StatusCode.FAILED_PRECONDITION and address is None:
                    hint = dict(exc.trailing_metadata() or ()).get(LEADER_ADDRESS_METADATA, "")
                    if hint and hint != target:
                        self._leader = hint
                        continue
                    self._skip(target)
                elif LIMIT_METADATA in dict(exc.trailing_metadata() or ()):
                    raise from_rpc_error(exc, target) from None  # too large for any node: retrying cannot help
                elif code in _RETRYABLE and address is None:
                    self._skip(target)
                elif code not in _RETRYABLE:
                    raise from_rpc_error(exc, target) from None
                # Between leaders: back off a little, growing, with jitter.
                time.sleep(min(0.1, 0.005 * tries) * (0.5 + random.random()))
                continue
            if address is None:
                self._leader = target
            return response

    # -- writes -------------------------------------------------------------

    def propose(self, commands: Sequence[pb.Command], *, timeout: float | None = None) -> list[pb.CommandResult]:
        """Apply raw commands in order (one request, one round of replication).

        Commands without a request id get a fresh one, kept across retries.
        """
        for cmd in commands:
            if not cmd.request_id:
                cmd.request_id = os.urandom(16)
        response = self._call("Propose", pb.ProposeRequest(commands=commands), timeout)
        return list(response.results)

    def _one(self, cmd: pb.Command, timeout: float | None) -> pb.CommandResult:
        result = self.propose([cmd], timeout=timeout)[0]
        if not result.ok:
            raise CommandRefusedError(result.error)
        return result

    def register_node(self, address: str, capacity_bytes: int, *, timeout: float | None = None) -> None:
        """Add a cache node (state "joining" until its first heartbeat), or update its capacity."""
        self._one(pb.Command(register_node=pb.RegisterNode(address=address, capacity_bytes=capacity_bytes)), timeout)

    def set_node_state(self, address: str, state: str, *, timeout: float | None = None) -> None:
        """Set a cache node's state: "joining", "up", "draining" or "down".

        Raises:
            InvalidRequestError: not a state name.
            CommandRefusedError: no such node.
        """
        try:
            value = node_state_value(state)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        cmd = pb.Command(set_node_state=pb.SetNodeState(address=address, state=value))
        self._one(cmd, timeout)

    def remove_node(self, address: str, *, timeout: float | None = None) -> None:
        """Forget a cache node.

        Raises:
            CommandRefusedError: no such node.
        """
        self._one(pb.Command(remove_node=pb.RemoveNode(address=address)), timeout)

    def set_holding(self, address: str, holding: bool, *, timeout: float | None = None) -> None:
        """Say whether cache node `address` may hold write-back values object storage lacks (see
        `PlacementMap.withheld`): a node does so before it acknowledges one, and once all are uploaded.

        Raises:
            CommandRefusedError: no such node.
        """
        self._one(pb.Command(set_holding=pb.SetHolding(address=address, holding=holding)), timeout)

    def put_manifest(
        self,
        name: str,
        *,
        s3_prefix: str = "",
        items: Sequence[ManifestItem] = (),
        timeout: float | None = None,
    ) -> int:
        """Store a dataset manifest (replacing one of the same name); returns its revision."""
        manifest = pb.Manifest(
            name=name,
            s3_prefix=s3_prefix,
            items=[pb.ManifestItem(key=i.key, size=i.size, checksum=i.checksum) for i in items],
        )
        return int(self._one(pb.Command(put_manifest=pb.PutManifest(manifest=manifest)), timeout).index)

    def delete_manifest(self, name: str, *, timeout: float | None = None) -> bool:
        """Delete a manifest; False if there was none of that name."""
        result = self.propose([pb.Command(delete_manifest=pb.DeleteManifest(name=name))], timeout=timeout)[0]
        return bool(result.ok)

    def put_namespace(self, namespace: NamespaceEntry, *, replace: bool = False, timeout: float | None = None) -> int:
        """Add a namespace to the shard's table, or with `replace` change one; returns the table's new version.

        Raises:
            CommandRefusedError: the prefix is taken (add) or unknown (replace), or a field is out of range.
        """
        command = pb.Command(put_namespace=pb.PutNamespace(namespace=namespace.to_proto(), replace=replace))
        return int(self._one(command, timeout).index)

    def delete_namespace(self, prefix: str, *, timeout: float | None = None) -> int:
        """Remove a namespace from the table; returns the table's new version.

        Raises:
            CommandRefusedError: no such namespace, or a tenant owns it.
        """
        return int(self._one(pb.Command(delete_namespace=pb.DeleteNamespace(prefix=prefix)), timeout).index)

    def put_tenant(self, tenant: TenantEntry, *, replace: bool = False, timeout: float | None = None) -> int:
        """Add a tenant (with its token's hash), or with `replace` change one (an empty hash keeps its token).

        Raises:
            CommandRefusedError: the name is taken (add) or unknown (replace), a prefix overlaps another
                tenant's, or a field is out of range.
            PermissionDeniedError: the shard has no admin token, or this client does not present it.
        """
        command = pb.Command(put_tenant=pb.PutTenant(tenant=tenant.to_proto(), replace=replace))
        return int(self._one(command, timeout).index)

    def delete_tenant(self, name: str, *, timeout: float | None = None) -> int:
        """Remove a tenant (its namespaces stay, owned by no one); returns the table's new version."""
        return int(self._one(pb.Command(delete_tenant=pb.DeleteTenant(name=name)), timeout).index)

    def namespaces(self, *, stale: bool = False, timeout: float | None = None) -> NamespaceTable:
        """The shard's namespace table and tenants (their token hashes only with the admin token)."""
        request = pb.GetNamespacesRequest(options=pb.ReadOptions(stale=stale))
        r = self._call("GetNamespaces", request, timeout)
        return NamespaceTable(
            r.version,
            tuple(NamespaceEntry.from_proto(ns) for ns in r.namespaces),
            tuple(TenantEntry.from_proto(t) for t in r.tenants),
        )

    def heartbeat(self, address: str, used_bytes: int = 0, *, timeout: float | None = None) -> float:
        """Report a cache node alive; returns the lease it buys, in seconds.

        The shard acknowledges at once and replicates heartbeats in coalesced
        batches: the lease starts when the batch is applied.
        """
        request = pb.HeartbeatRequest(beats=[pb.NodeHeartbeat(address=address, used_bytes=used_bytes)])
        return float(self._call("Heartbeat", request, timeout).lease_ms) / 1000.0

    # -- reads --------------------------------------------------------------

    def get_manifest(self, name: str, *, stale: bool = False, timeout: float | None = None) -> Manifest | None:
        """The manifest called `name`, or None."""
        request = pb.GetManifestRequest(name=name, options=pb.ReadOptions(stale=stale))
        response = self._call("GetManifest", request, timeout)
        if not response.found:
            return None
        m = response.manifest
        items = tuple(ManifestItem(i.key, i.size, i.checksum) for i in m.items)
        return Manifest(m.name, m.s3_prefix, items, m.revision)

    def list_manifests(self, *, stale: bool = False, timeout: float | None = None) -> list[str]:
        """Names of every manifest, sorted."""
        request = pb.ListManifestsRequest(options=pb.ReadOptions(stale=stale))
        return list(self._call("ListManifests", request, timeout).names)

    def nodes(self, *, stale: bool = False, timeout: float | None = None) -> list[CacheNode]:
        """Every cache node the shard knows, by address."""
        response = self._call("ListNodes", pb.ListNodesRequest(options=pb.ReadOptions(stale=stale)), timeout)
        return [
            CacheNode(n.address, n.capacity_bytes, node_state_name(n.state), n.lease_expiry_ms, n.used_bytes, n.holding)
            for n in response.nodes
        ]

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        """The placement map: the cached one unless `refresh` or its ttl ran out."""
        cached = self._placement
        if cached is not None and not refresh and time.monotonic() < self._placement_expiry:
            return cached
        known, epoch = (cached.version, cached.epoch) if cached is not None else (0, 0)
        request = pb.GetPlacementRequest(known_version=known, known_epoch=epoch)
        response = self._call("GetPlacement", request, timeout)
        if not (response.unchanged and cached is not None):
            cached = PlacementMap(
                response.version,
                tuple(response.nodes),
                tuple(response.slots),
                tuple(response.capacities),
                epoch=response.epoch,
                holders=frozenset(response.holders),
                absent=tuple(zip(response.absent, response.absent_capacities, strict=True)),
                layouts=(response.layout_version, response.layout_before),
                namespaces_version=response.namespaces_version,
            )
        elif cached.namespaces_version != response.namespaces_version:
            cached = dataclasses.replace(cached, namespaces_version=response.namespaces_version)
        self._placement = cached
        self._placement_expiry = time.monotonic() + self.placement_ttl
        return cached

    def locate(self, key: bytes | str) -> str | None:
        """The cache node that holds `key`, from the cached placement map (None: no node is up)."""
        cached = self._placement
        if cached is None or time.monotonic() >= self._placement_expiry:
            cached = self.placement()
        return cached.locate(key)

    # -- the shard itself ---------------------------------------------------

    def leader(self, *, timeout: float | None = None) -> tuple[int, str] | None:
        """(id, address) of the leader, as the nodes report it; None if none is known in time.

        Asks every node; trusts the report of the highest term, and a node
        that says it leads itself over one that only names a leader.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            best: tuple[int, int, int, str] | None = None
            for address in self.addresses:
                try:
                    r = self._stub(address).Leader(
                        pb.LeaderRequest(), timeout=min(self.attempt_timeout, 1.0), metadata=self._metadata
                    )
                except grpc.RpcError:
                    continue
                if r.leader_id:
                    rank = (r.term, int(r.leader_id == r.node_id), r.leader_id, r.leader_address)
                    best = rank if best is None or rank > best else best
            if best is not None:
                self._leader = best[3]
                return best[2], best[3]
            if time.monotonic() + 0.1 >= deadline:
                return None
            time.sleep(0.1)

    def status(self, address: str, *, state_digest: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """One node's own view: role, term, leader, commit/applied indexes, members.

        Args:
            state_digest: Also hash the node's whole state (hex in "state_digest", else "").
        """
        r = self._call("Status", pb.StatusRequest(state_digest=state_digest), timeout, address=address)
        return {
            "id": r.node_id,
            "role": r.role,
            "term": r.term,
            "leader": r.leader_id or None,
            "commit": r.commit,
            "applied": r.applied,
            "last_index": r.last_index,
            "snapshot_index": r.snapshot_index,
            "state_digest": r.state_digest.hex(),
            "members": {m.id: m.address for m in r.members},
            "commands_proposed": r.commands_proposed,
            "entries_proposed": r.entries_proposed,
            "persists": r.persists,
        }

    def committed_entries(
        self, address: str, lo: int = 1, hi: int = 2**63, *, timeout: float | None = None
    ) -> dict[int, tuple[int, bytes]]:
        """index -> (term, digest of data) of the committed entries one node still holds in [lo, hi]."""
        request = pb.CommittedEntriesRequest(lo=lo, hi=hi)
        r = self._call("CommittedEntries", request, timeout, address=address)
        return {e.index: (e.term, e.digest) for e in r.entries}
