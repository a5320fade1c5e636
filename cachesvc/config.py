"""The typed configuration of cachesvc's services.

One dataclass tree per service: `ServerConfig` for a cache server
(`cachesvc serve`, `load_config`) and `MetaNodeConfig` for a metadata-shard
node (`cachesvc meta`, `load_meta_node_config`), from which `node_config()`
derives the `NodeConfig` a metadata node runs with. The two are filled by one
loader, in this order, each step overriding the last: embedded defaults, a
TOML file (`--config FILE`), environment variables, then command-line flags.
A variable is the service's prefix and the field's path in upper case joined
by "_": `CACHESVC_L1_BYTES`, `CACHESVC_S3_ENDPOINT`, `CACHESVC_LRU_K_K` for a
cache server, `CACHESVC_META_NODE_ID`, `CACHESVC_META_NODE_PEERS` for a
metadata node. An unknown key in the file, or a `CACHESVC_*` variable that
names no key of any service, is an error that names it. Byte sizes accept
plain integers or strings with a unit ("512MiB", "2GB"). `validate()` runs on
every load.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

__all__ = [
    "ConfigError",
    "L1Config",
    "L2Config",
    "LRUKConfig",
    "MetaConfig",
    "MetaNodeConfig",
    "MetaSecurityConfig",
    "NamespaceConfig",
    "NodeConfig",
    "S3Config",
    "SecurityConfig",
    "ServerConfig",
    "env_names",
    "load_config",
    "load_meta_node_config",
    "parse_peers",
    "parse_size",
]

ENV_PREFIX = "CACHESVC_"
NON_CONFIG_ENV = frozenset({"CACHESVC_FAILPOINT"})
"""`CACHESVC_*` variables that are not config keys (crash points for tests, see `cachesvc.meta.failpoint`)."""


class ConfigError(ValueError):
    """A configuration value or key is not acceptable; the message names it."""


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string such as "64MiB" or "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a byte size: {value!r} (use e.g. 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_peers(text: str) -> dict[int, str]:
    """`1=host:port,2=host:port` -> {1: "host:port", 2: "host:port"}.

    Raises:
        ValueError: malformed list, a non-positive or repeated id.
    """
    peers: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        ident, sep, address = item.partition("=")
        if not sep or not address or ":" not in address:
            raise ValueError(f"bad peer {item!r}: expected ID=HOST:PORT")
        node_id = int(ident)
        if node_id <= 0 or node_id in peers:
            raise ValueError(f"bad peer {item!r}: ids must be positive and distinct")
        peers[node_id] = address
    if not peers:
        raise ValueError("no peers given")
    return peers


def _check_listen(name: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{name}: expected HOST:PORT, got {address!r}")


@dataclass
class L1Config:
    """Memory tier. `bytes = 0` disables it."""

    bytes: int = 1 << 30
    device: str = "cpu"
    """"cpu" for host memory, or "cuda"/"cuda:N" for GPU memory."""
    shared: bool = False
    """Host-memory L1 in a shared-memory arena that clients on this machine read without a round trip (their
    token checked over `socket`); false: a private dict. On a cluster node, each tenant's values in an arena of
    their own, the only one its token is handed (docs/security.md). Off by default: a gRPC read of a large value
    costs one more copy from the arena (`cachesvc up` turns it on). Ignored for GPU memory."""
    socket: str = ""
    """The Unix socket co-located clients get the arena from; "": `l1-PID.sock` in $XDG_RUNTIME_DIR, else in
    a directory of this user's under the temporary directory (mode 0700); a server starting there removes the
    sockets nothing listens on (those of servers killed before they could)."""


@dataclass
class L2Config:
    """Local-disk (LMDB) tier. `bytes = 0` disables it."""

    path: str = ""
    bytes: int = 0
    fill_on_read: bool = True
    """Values filled from object storage go into L2 as well as L1."""
    fill_behind_bytes: int = 64 << 20
    """Bytes of those L2 writes that may wait, on one thread, behind the reads whose values are already in L1
    (a SIGKILL loses the waiting ones from L2 only: object storage has them); 0: a read waits for its own."""
    fill_idle_seconds: float = 1.0
    """While L1 is shared (`l1.shared`: co-located clients read it, not L2) and at most half full, those L2
    writes wait until the server has filled and served nothing for this long, then copy from L1 (passes over
    data that fits in L1 do not pay for them on the cores they run on; a SIGKILL before then loses them from
    L2 only, and a clean stop keeps L1 in L2); past half full they go at once, taking the waiting ones, so
    L1's victims are on disk already; 0: never wait."""
    file_from: int = 1 << 20
    """Values of this many bytes or more are files of their own beside the LMDB file, which indexes them
    (written once, by the server or straight by a co-located client); smaller ones are LMDB records; 0: none."""


@dataclass
class S3Config:
    """Object storage. No bucket: no L3."""

    endpoint: str = ""
    bucket: str = ""
    prefix: str = ""
    region: str = "us-east-1"
    access_key: str = ""
    secret_key: str = ""
    connect_timeout: float = 2.0
    read_timeout: float = 30.0
    max_attempts: int = 3
    breaker_seconds: float = 2.0
    """After a request fails without an answer (or with a 5xx after its retries), object storage is not
    tried again for this long: misses fail at once instead of each waiting out the timeouts."""
    revalidate_seconds: float = 0.0
    """A hit on a value last known to match its object longer ago than this checks the object (a HEAD)
    and reads it again if it changed; 0: never (objects are not replaced in place). See docs/reliability.md."""
    vouch_listings: int = 4
    """Listings in flight while the copies a node finds at start-up (or takes back after a move) are checked
    against object storage in bulk, a page of up to 1,000 at a time; 0: each copy is checked alone at its
    first read (one HEAD). See docs/cluster.md, "What a reader gets"."""


@dataclass
class LRUKConfig:
    k: int = 2
    correlated_period: float = 0.5
    """Seconds (chosen by bench/eviction.py); 0 gives the paper's plain LRU-K."""
    retained_history: int = -1
    """Evicted keys whose history is kept (Retained Information Period, by count):
    -1 (default) as many as there are resident keys; 0 forgets a key when it is evicted."""


@dataclass
class NamespaceConfig:
    prefix: str = ""
    write_mode: str = "write-through"
    lease_seconds: float = 0.0
    """Default lease of puts in the namespace (pinned until read with release, or until it ends)."""
    ttl_seconds: float = 0.0
    """Default time to live of puts in the namespace; 0: none."""
    replicas: int = 1
    """In a cluster, how many nodes hold each key (the first of its rendezvous candidates); clients say the same."""
    immutable: bool = False
    """Keys are written once and never rewritten in place: a put over a key that exists is refused
    (FAILED_PRECONDITION), and cached copies need no check against object storage after a restart. Not with
    write-back (a value that exists only in one node's cache cannot be checked for by the others)."""


@dataclass
class MetaConfig:
    """The metadata shard this server registers with and heartbeats to."""

    addresses: str = ""
    """Comma-separated HOST:PORT of the shard's nodes; empty: no shard."""
    advertise: str = ""
    """The address other hosts reach this server at; empty: `listen`."""
    heartbeat_seconds: float = 2.0
    """Seconds between heartbeats (and placement checks); keep well under the shard's lease."""
    token: str = ""
    """Bearer token presented to the shard; empty: `security.admin_token`, else `security.token` (one set of
    tokens for every server). Registering and heartbeating change membership: with a shard admin token, this
    must be it."""
    tls_ca: str = ""
    """PEM file of the CA that signed the shard's TLS certificates; empty: plaintext to the shard."""
    peer_fill: bool = True
    """After the placement moves a key here, read it from its previous owner before object storage
    (`cachesvc.server.peers`)."""
    handover_bytes: int = 256 << 20
    """After the placement moves keys away from this server, it offers each new owner the write-through keys
    it caches that moved (in name order, or L1's first when they do not all fit), which the new owner fills
    ahead of its clients, up to this many bytes per new owner (`cachesvc.server.handover`); 0: none."""


@dataclass
class SecurityConfig:
    token: str = ""
    """Bearer token every client must present (the data scope: read and write); empty: no authentication."""
    admin_token: str = ""
    """Bearer token of the admin scope (membership, drain, evict, stats and config views; data too); empty: the
    data token grants admin as well. Requires `token`; scopes per RPC: `cacheclient.wire.scopes`."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    """PEM file of the CA that signed the peers' certificates: a cache server verifies the nodes it fills from
    with it (peer fill), a metadata node its Raft peers; empty with `tls_cert`: `tls_cert` itself (one
    certificate, or one CA's chain, for every node)."""

    def check_tokens(self) -> None:
        """Raises ConfigError when the admin token is set without a data token, or equals it."""
        if self.admin_token and not self.token:
            raise ConfigError("security.admin_token: requires security.token (the data scope's token)")
        if self.admin_token and self.admin_token == self.token:
            raise ConfigError("security.admin_token: must differ from security.token (data is not admin)")


@dataclass
class MetaSecurityConfig(SecurityConfig):
    """A metadata node's `SecurityConfig`, plus the secret its peers present to each other."""

    peer_token: str = ""
    """Secret the shard's nodes present on the Raft transport; never a client token. Required with `token`."""


@dataclass
class ServerConfig:
    """A cache server (`cachesvc serve`); every key is shown in deploy/cachesvc.toml."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    listen: str = "127.0.0.1:7070"
    metrics_listen: str = ""
    """HOST:PORT to serve Prometheus metrics on (http://HOST:PORT/metrics); empty: none."""
    metrics_open: bool = False
    """Serve /metrics to anyone who reaches `metrics_listen`, token or not. By default, with a token
    configured a scrape must present the admin token (`security.admin_token`, else `security.token`) as
    `Authorization: Bearer TOKEN` (the metrics show what the admin-scoped Stats call does); docs/security.md."""
    max_value_bytes: int = 256 << 20
    processes: int = 1
    """Engine processes on this machine (0: one per core). With N > 1 (a cluster only: `meta.addresses`), process i
    listens on `listen`'s port + i, registers in the shard as a node of its own, owns the keys the placement
    gives it, and has 1/N of `l1.bytes` and `l2.bytes` (its L2 under `l2.path`/p<i>)."""
    workers: int = 16
    """gRPC handler threads for data calls; also bounds concurrent requests (`max_inflight_calls`)."""
    max_inflight_calls: int = 0
    """Data calls in their handlers at once (0: `workers`; at most `workers`); one more is answered
    RESOURCE_EXHAUSTED at once ("overloaded now, retry"), not queued. Health checks, Stats, Info and
    prefetch plans are not counted, and answer on spare threads while the data calls are saturated."""
    writeback_queue: int = 4096
    io_timeout: float = 60.0
    fill_concurrency: int = 32
    """Object-storage fetches all demand reads run at once; one GetMany takes at most half."""
    max_lease_seconds: float = 3600.0
    """The longest lease a put may ask for; longer ones are refused (no value is pinned forever)."""
    prefetch_concurrency: int = 32
    """Object-storage fetches all prefetch plans run at once."""
    max_prefetch_plans: int = 64
    handoff_bytes: int = 512 << 20
    """Bytes of read values held for the streams that follow streamed Get/GetMany answers; oldest dropped first."""
    handoff_seconds: float = 10.0
    """How long read values wait for their stream; a later stream reads them again."""
    policy: str = "lru-k"
    kv_index_prefixes: list[str] = field(default_factory=lambda: ["kv/"])
    """Key prefixes whose held keys clients' local KV indexes follow (the KeyDigest RPC); empty: none."""
    kv_index_changes: int = 65536
    """Changes to those keys each prefix remembers for incremental syncs; a client further behind gets a snapshot."""
    lru_k: LRUKConfig = field(default_factory=LRUKConfig)
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    s3: S3Config = field(default_factory=S3Config)
    namespaces: list[NamespaceConfig] = field(default_factory=list)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)

    def validate(self) -> None:
        """Raises ConfigError naming the first value that is not acceptable."""
        # Here, not at the top: a metadata node loads this module too, and needs neither the engine nor its tiers.
        from cachesvc.engine import WriteMode
        from cachesvc.policy import POLICY_NAMES

        _check_listen("listen", self.listen)
        if self.metrics_listen:
            _check_listen("metrics_listen", self.metrics_listen)
        for name, value in (
            ("max_value_bytes", self.max_value_bytes),
            ("workers", self.workers),
            ("writeback_queue", self.writeback_queue),
            ("fill_concurrency", self.fill_concurrency),
            ("max_lease_seconds", self.max_lease_seconds),
            ("prefetch_concurrency", self.prefetch_concurrency),
            ("max_prefetch_plans", self.max_prefetch_plans),
            ("handoff_bytes", self.handoff_bytes),
            ("handoff_seconds", self.handoff_seconds),
            ("kv_index_changes", self.kv_index_changes),
        ):
            if value <= 0:
                raise ConfigError(f"{name}: must be positive, got {value}")
        if self.processes < 0:
            raise ConfigError(f"processes: 0 (one per core) or more, got {self.processes}")
        if self.l2.file_from and self.l2.file_from <= 64 << 10:
            raise ConfigError(
                f"l2.file_from: must be 0 or over 65536 (the packed values' limit), got {self.l2.file_from}"
            )
        if self.l2.fill_idle_seconds < 0:
            raise ConfigError(f"l2.fill_idle_seconds: must be >= 0, got {self.l2.fill_idle_seconds}")
        if self.meta.handover_bytes < 0:
            raise ConfigError(f"meta.handover_bytes: must be >= 0, got {self.meta.handover_bytes}")
        if self.l2.fill_behind_bytes < 0:
            raise ConfigError(f"l2.fill_behind_bytes: must be >= 0, got {self.l2.fill_behind_bytes}")
        if self.process_count() > 1 and not self.meta.addresses:
            raise ConfigError(
                f"processes: {self.process_count()} processes need a metadata shard (meta.addresses): clients find "
                "each process's keys through the placement"
            )
        if not 0 <= self.max_inflight_calls <= self.workers:
            raise ConfigError(
                f"max_inflight_calls: 0 (workers) to workers={self.workers}, got {self.max_inflight_calls} "
                "(a call past the handler threads would wait in a queue)"
            )
        if self.l1.bytes < 0 or self.l2.bytes < 0:
            raise ConfigError("l1.bytes and l2.bytes must be >= 0")
        if self.l1.bytes == 0 and self.l2.bytes == 0:
            raise ConfigError("l1.bytes and l2.bytes are both 0: at least one cache tier is needed")
        if self.l2.bytes and not self.l2.path:
            raise ConfigError("l2.path: required when l2.bytes > 0")
        if self.l2.bytes and self.l2.bytes < 1 << 20:
            raise ConfigError(f"l2.bytes: at least 1MiB, got {self.l2.bytes}")
        if not (self.l1.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.l1.device)):
            raise ConfigError(f"l1.device: expected cpu, cuda or cuda:N, got {self.l1.device!r}")
        if self.s3.endpoint and not self.s3.bucket:
            raise ConfigError("s3.bucket: required when s3.endpoint is set")
        if self.s3.breaker_seconds < 0:
            raise ConfigError(f"s3.breaker_seconds: must be >= 0, got {self.s3.breaker_seconds}")
        if self.s3.revalidate_seconds < 0:
            raise ConfigError(f"s3.revalidate_seconds: must be >= 0, got {self.s3.revalidate_seconds}")
        if self.s3.vouch_listings < 0:
            raise ConfigError(f"s3.vouch_listings: must be >= 0, got {self.s3.vouch_listings}")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.lru_k.k < 1 or self.lru_k.correlated_period < 0 or self.lru_k.retained_history < -1:
            raise ConfigError("lru_k: k must be >= 1, correlated_period >= 0 and retained_history >= -1")
        for i, prefix in enumerate(self.kv_index_prefixes):
            if not prefix:
                raise ConfigError(f"kv_index_prefixes[{i}]: must not be empty")
        if len(set(self.kv_index_prefixes)) != len(self.kv_index_prefixes):
            raise ConfigError(f"kv_index_prefixes: listed twice: {self.kv_index_prefixes}")
        modes = [m.value for m in WriteMode]
        for i, ns in enumerate(self.namespaces):
            if ns.write_mode not in modes:
                raise ConfigError(
                    f"namespaces[{i}].write_mode: expected one of {', '.join(modes)}, got {ns.write_mode!r}"
                )
            if ns.lease_seconds < 0 or ns.ttl_seconds < 0:
                raise ConfigError(f"namespaces[{i}]: lease_seconds and ttl_seconds must be >= 0")
            if ns.replicas < 1:
                raise ConfigError(f"namespaces[{i}].replicas: must be >= 1, got {ns.replicas}")
            if ns.write_mode == "write-back" and not self.s3.bucket:
                raise ConfigError(f"namespaces[{i}]: write-back needs object storage (s3.bucket)")
            if ns.immutable and ns.write_mode == "write-back":
                raise ConfigError(f"namespaces[{i}]: immutable cannot be write-back (use write-through)")
        if self.meta.heartbeat_seconds <= 0:
            raise ConfigError(f"meta.heartbeat_seconds: must be positive, got {self.meta.heartbeat_seconds}")
        if bool(self.security.tls_cert) != bool(self.security.tls_key):
            raise ConfigError("security: tls_cert and tls_key go together")
        if self.security.tls_ca and not self.security.tls_cert:
            raise ConfigError("security.tls_ca: requires security.tls_cert and tls_key (the cluster's nodes speak TLS)")
        self.security.check_tokens()

    def process_count(self) -> int:
        """How many engine processes `processes` asks for on this machine."""
        return self.processes or os.cpu_count() or 1

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with secrets masked, safe to log."""
        data = dataclasses.asdict(self)
        for section, key in (
            ("s3", "secret_key"),
            ("s3", "access_key"),
            ("security", "token"),
            ("security", "admin_token"),
            ("meta", "token"),
        ):
            if data[section][key]:
                data[section][key] = "***"
        return data


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What one metadata node runs with: `MetaNodeConfig.node_config()` derives it (peers as a map, timing in ticks).

    Attributes:
        id: This node's Raft id (positive).
        peers: Every member's id -> "host:port", this node included.
        data_dir: Where the Raft log, hard state and snapshots live.
        tick_ms: Length of one Raft tick.
        election_tick: Election timeout in ticks (randomised up to twice this).
        heartbeat_tick: Ticks between the leader's heartbeats.
        snapshot_every: Take a snapshot and compact the log every this many
            applied entries.
        batching: Put many client commands in one log entry and one fsync.
            False proposes and persists one request at a time (the baseline
            the benchmark compares against).
        max_batch_commands: Most commands in one log entry.
        max_batch_bytes: Most bytes in one log entry (one request may exceed it).
        heartbeat_flush_ms: How often the leader replicates buffered heartbeats.
        lease_ms: How long a replicated heartbeat keeps a cache node up.
        queue_size: Bound of the event queue.
        read_timeout: Seconds a ReadIndex round may take before its reads fail.
        seed: Seed of the election-timeout jitter (None: from the OS).
        peer_token: Secret presented to peers on the Raft transport ("": none).
        log_map_bytes: Most bytes the Raft log may occupy on disk (its LMDB map).
        tls_ca: PEM file of the CA that signed the peers' certificates: the
            Raft transport speaks TLS and verifies peers with it ("": plaintext).
    """

    id: int
    peers: Mapping[int, str]
    data_dir: Path
    tick_ms: int = 10
    election_tick: int = 20
    heartbeat_tick: int = 3
    snapshot_every: int = 10_000
    batching: bool = True
    max_batch_commands: int = 4096
    max_batch_bytes: int = 1 << 20
    heartbeat_flush_ms: int = 500
    lease_ms: int = 10_000
    queue_size: int = 16_384
    read_timeout: float = 2.0
    seed: int | None = None
    peer_token: str = field(default="", repr=False)
    log_map_bytes: int = 1 << 30
    tls_ca: str = ""

    def validate(self) -> None:
        """Raise ValueError on nonsensical settings."""
        if self.id not in self.peers:
            raise ValueError(f"node id {self.id} is not among the peers {sorted(self.peers)}")
        if self.tick_ms <= 0 or self.snapshot_every <= 0 or self.max_batch_commands <= 0:
            raise ValueError("tick_ms, snapshot_every and max_batch_commands must be positive")
        # The Raft core checks this again when the node starts; here it fails at load, naming the setting.
        if not 0 < self.heartbeat_tick < self.election_tick:
            raise ValueError(
                f"heartbeat ticks ({self.heartbeat_tick}) must be positive and fewer than election ticks "
                f"({self.election_tick})"
            )


@dataclass
class MetaNodeConfig:
    """A metadata-shard node (`cachesvc meta`); every key is shown in deploy/meta.toml.

    Every node of a shard gets the same `peers` (itself included). The Raft
    log, vote and snapshots live under `data_dir`; restarting a node on the
    same directory recovers it.
    """

    env_prefix: ClassVar[str] = ENV_PREFIX + "META_NODE_"
    id: int = 0
    """This node's id: positive, unique in the shard. Required."""
    listen: str = ""
    """HOST:PORT for clients and peers; empty: this node's address in `peers`."""
    metrics_listen: str = ""
    """HOST:PORT to serve Prometheus metrics on (http://HOST:PORT/metrics); empty: none."""
    metrics_open: bool = False
    """Serve /metrics to anyone who reaches `metrics_listen`, token or not. By default, with a token
    configured a scrape must present the admin token (`security.admin_token`, else `security.token`) as
    `Authorization: Bearer TOKEN` (the metrics show what the admin-scoped Stats call does); docs/security.md."""
    peers: str = ""
    """Every member as "ID=HOST:PORT,...". Required."""
    data_dir: str = ""
    """Directory of the Raft log and snapshots. Required."""
    tick_ms: int = 10
    """Length of one Raft tick."""
    election_ticks: int = 20
    """Election timeout in ticks (randomised up to twice this)."""
    heartbeat_ticks: int = 3
    """Ticks between the leader's heartbeats."""
    snapshot_every: int = 10_000
    """Compact the log every this many applied entries."""
    lease_seconds: float = 10.0
    """How long a cache node's heartbeat keeps it up."""
    batching: bool = True
    """Many client requests per log entry and fsync; false: one each (the benchmarks' baseline)."""
    max_proposal_bytes: int = 16 << 20
    """Largest client proposal (a Propose request) accepted; larger ones are refused with RESOURCE_EXHAUSTED."""
    max_raft_message_bytes: int = 64 << 20
    """Largest batch of Raft messages accepted from a peer; larger ones are refused with RESOURCE_EXHAUSTED."""
    log_map_bytes: int = 1 << 30
    """Most the Raft log may occupy on disk; when full, proposals are refused and applied entries compacted."""
    security: MetaSecurityConfig = field(default_factory=MetaSecurityConfig)
    """Client bearer token, peer secret, TLS (`CACHESVC_META_NODE_SECURITY_TOKEN`, ..._PEER_TOKEN)."""

    def validate(self) -> None:
        """Raises ConfigError naming the first value that is not acceptable."""
        self.node_config()
        sec = self.security
        sec.check_tokens()
        if sec.token and not sec.peer_token:
            raise ConfigError("security.peer_token: required with security.token (peers must authenticate too)")
        if sec.peer_token and sec.peer_token in (sec.token, sec.admin_token):
            raise ConfigError(
                "security.peer_token: must differ from security.token and admin_token (a client is not a peer)"
            )
        if bool(sec.tls_cert) != bool(sec.tls_key):
            raise ConfigError("security: tls_cert and tls_key go together")
        if sec.tls_ca and not sec.tls_cert:
            # Peers verify each other's server certificates; a node without one could not be reached.
            raise ConfigError("security.tls_ca: requires security.tls_cert and tls_key (the whole shard speaks TLS)")
        for key in ("max_proposal_bytes", "max_raft_message_bytes", "log_map_bytes"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with secrets masked, safe to log."""
        data = dataclasses.asdict(self)
        for key in ("token", "admin_token", "peer_token"):
            if data["security"][key]:
                data["security"][key] = "***"
        return data

    def node_config(self) -> NodeConfig:
        """The settings the node runs with: peers as a map (this node added if absent), timing in ticks.

        Raises:
            ConfigError: a value is missing or not acceptable; the message names it.
        """
        if self.id <= 0:
            raise ConfigError(f"id: a positive node id is required (--id), got {self.id}")
        if not self.peers:
            raise ConfigError("peers: required (--peers ID=HOST:PORT,...)")
        try:
            peers = parse_peers(self.peers)
        except ValueError as exc:
            raise ConfigError(f"peers: {exc}") from None
        if not self.listen and self.id not in peers:
            raise ConfigError(f"listen: required (--listen) when peers does not name node {self.id}")
        if self.listen:
            _check_listen("listen", self.listen)
            peers.setdefault(self.id, self.listen)
        if self.metrics_listen:
            _check_listen("metrics_listen", self.metrics_listen)
        if not self.data_dir:
            raise ConfigError("data_dir: required (--data-dir)")
        if self.lease_seconds <= 0:
            raise ConfigError(f"lease_seconds: must be positive, got {self.lease_seconds}")
        node = NodeConfig(
            id=self.id,
            peers=peers,
            data_dir=Path(self.data_dir),
            tick_ms=self.tick_ms,
            election_tick=self.election_ticks,
            heartbeat_tick=self.heartbeat_ticks,
            snapshot_every=self.snapshot_every,
            batching=self.batching,
            lease_ms=int(self.lease_seconds * 1000),
            peer_token=self.security.peer_token,
            tls_ca=self.security.tls_ca or self.security.tls_cert,
            log_map_bytes=self.log_map_bytes,
        )
        try:
            node.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return node

    @property
    def address(self) -> str:
        """Where the node listens: `listen`, or its own entry in `peers`."""
        return self.listen or parse_peers(self.peers)[self.id]


_SCHEMAS: tuple[type[Any], ...] = (ServerConfig, MetaNodeConfig)


class _Schema(Protocol):
    env_prefix: ClassVar[str]

    def validate(self) -> None: ...


_C = TypeVar("_C", bound=_Schema)


def _env_paths(cls: type, prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            paths.update(_env_paths(typing.cast(type, hint), path))
        elif typing.get_origin(hint) is not list:
            paths["_".join(path).upper()] = path
    return paths


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return _build(typing.cast(type, hint), value, where)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        if hint is int:
            return parse_size(value) if where.endswith("bytes") else int(value)
        if hint is float:
            return float(value)
        return str(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(hint, '__name__', hint)}") from exc


def _build(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {where + '.' if where else ''}{key}")
    kwargs = {k: _coerce(v, hints[k], f"{where + '.' if where else ''}{k}") for k, v in data.items()}
    return cls(**kwargs)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Builds and validates a cache server's config: defaults, file, environment, then overrides.

    Args:
        path: a TOML file, or None.
        env: the environment to read `CACHESVC_*` from (default: os.environ).
        overrides: dotted paths to values, e.g. {"l1.bytes": "64MiB"}, from flags.

    Raises:
        ConfigError: an unknown key, an unreadable value or a failed validation.
    """
    return _load(ServerConfig, path, env, overrides)


def load_meta_node_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> MetaNodeConfig:
    """Builds and validates a metadata node's config, as `load_config` does (`CACHESVC_META_NODE_*`).

    A node with no token of its own in an environment that gives the cache
    servers one (`CACHESVC_SECURITY_TOKEN`) is refused: the user meant a
    closed shard, and the node would have run open.

    Raises:
        ConfigError: an unknown key, an unreadable value or a failed validation.
    """
    env = os.environ if env is None else env
    config = _load(MetaNodeConfig, path, env, overrides)
    server_token = ENV_PREFIX + "SECURITY_TOKEN"
    if env.get(server_token) and not config.security.token:
        raise ConfigError(
            f"{server_token} is set but is a cache server's token; a metadata node reads "
            f"{MetaNodeConfig.env_prefix}SECURITY_TOKEN (with {MetaNodeConfig.env_prefix}SECURITY_PEER_TOKEN, "
            f"the secret its peers share) or --token and --peer-token: set those, or unset {server_token} "
            "to run the shard without authentication"
        )
    return config


def env_names(schema: type[Any]) -> dict[str, tuple[str, ...]]:
    """Each environment variable of a config schema -> the path of its key."""
    return {schema.env_prefix + name: path for name, path in _env_paths(schema).items()}


def _load(
    schema: type[_C],
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    overrides: Mapping[str, Any] | None,
) -> _C:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            _merge(data, tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    own = env_names(schema)
    # Another service's variables are ignored, not refused: `cachesvc up` and
    # shells hand one environment to every process they start.
    known = set(NON_CONFIG_ENV).union(*(env_names(other) for other in _SCHEMAS))
    for name, value in sorted((env if env is not None else os.environ).items()):
        if name in own:
            _set(data, own[name], value)
        elif name.startswith(ENV_PREFIX) and name not in known:
            raise ConfigError(f"unknown config environment variable {name}")
    for dotted_name, value in (overrides or {}).items():
        _set(data, tuple(dotted_name.split(".")), value)
    config: _C = _build(schema, data)
    config.validate()
    return config


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
    data[path[-1]] = value
