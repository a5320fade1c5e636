"""Building and running a cache server.

`build_engine(cfg, reads)` turns a config into tiers and an engine that
publishes its demand reads to `reads`; `build_prefetcher(cfg, engine, reads)`
the prefetcher that follows them (given one `PlannedReads`, the tiers evict
by what the open plans will read: `cachesvc.policy.planned`);
`create_server(cfg, engine, address, prefetcher=...)` binds a gRPC server
and returns it with its port (tests pass port 0); `serve(cfg)` runs one until SIGTERM or Ctrl-C, then stops
gracefully: prefetch plans end, in-flight RPCs get a grace period, and the
engine drains its write-back queue before the process exits.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from cacheclient._malloc import MAX_MMAP_BYTES, tune_malloc
from cacheclient.meta import MetaClient
from cacheclient.wire import (
    MAX_MESSAGE_BYTES,
    cache_pb2,
    cache_pb2_grpc,
)
from cacheclient.wire.limits import MAX_PLAN_KEYS
from cacheclient.wire.placement import PlacementMap, slot_of
from cacheclient.wire.scopes import Scope
from cachesvc.config import ServerConfig
from cachesvc.engine import Engine, Namespace, WriteMode
from cachesvc.engine.events import ReadFeed
from cachesvc.engine.fillchain import FillSource
from cachesvc.engine.keyindex import KeyIndex
from cachesvc.metrics import CacheServerCollector, MetricsServer, RpcMetrics, new_registry, serve_metrics
from cachesvc.policy import make_policy
from cachesvc.policy.planned import PlanAware
from cachesvc.policy.tenants import TenantPolicy, TenantReads, TenantShares, node_share, tenant_counters
from cachesvc.prefetch import PlannedReads, Prefetcher
from cachesvc.rpc import (
    OPEN_METHOD_PREFIXES,
    Admission,
    Health,
    StopSignals,
    TokenAuth,
    bind_and_start,
    new_server,
    run_until_signalled,
)
from cachesvc.server.arena_socket import ArenaSocket, default_socket_path, remove_stale_sockets
from cachesvc.server.fences import Fences
from cachesvc.server.handover import HandedOver, Handover
from cachesvc.server.holding import WriteBackHolding
from cachesvc.server.membership import Membership
from cachesvc.server.ownership import Ownership
from cachesvc.server.peers import PeerFill
from cachesvc.server.service import CacheServicer
from cachesvc.server.staging import StagingSessions
from cachesvc.server.table import FollowedTable
from cachesvc.server.tenants import guard as tenant_guard
from cachesvc.tenancy import TenantTokens
from cachesvc.tiers import LMDBTier, MemoryTier, S3Tier
from cachesvc.tiers.arena import ArenaTier
from cachesvc.tiers.base import Tier
from cachesvc.tiers.tenant_arenas import TenantArenas

__all__ = ["build_engine", "build_prefetcher", "create_server", "direct_reads_as_owner", "follow_placement", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = "cachesvc.v1.CacheService"

UNLIMITED = ("Stats", "Info", "Prefetch")
"""CacheService methods outside the in-flight limit (`max_inflight_calls`): status calls that must answer
while the data calls are saturated, and prefetch plans (their own limit, `max_prefetch_plans`, and threads)."""

SPARE_THREADS = 4
"""Handler threads beyond `workers` and the plans': health checks, status calls and the quick RESOURCE_EXHAUSTED
answers of calls over the limit always find one."""


def build_engine(
    cfg: ServerConfig,
    reads: ReadFeed | None = None,
    ownership: Ownership | None = None,
    planned: PlannedReads | None = None,
    shares: TenantShares | None = None,
    vouch_gate: Callable[[float], bool] | None = None,
) -> Engine:
    """The tiers and engine a config describes; the engine publishes its demand reads to `reads`.

    With `shares` (a cluster node: tenants come with the shard's table), each tier's policy is wrapped in
    `TenantPolicy`: tenants' quotas and priorities (`cachesvc.policy.tenants`), and a shared L1 keeps each
    tenant's values in an arena of its own (`TenantArenas`; the caller has it follow the table's tenants).

    With `ownership` (a cluster node), a miss asks the key's previous owners
    before object storage (`PeerFill`). With `planned`, each tier's policy
    is wrapped in `PlanAware` (L1, or L2 without L1, counts prefetched
    values evicted before use). `vouch_gate` is what a listing that vouches for
    cached copies waits for (a cluster node's fences, `Fences.before_listing`).
    """
    l1: Any = None
    if cfg.l1.bytes:
        if cfg.l1.device == "cpu":
            if not cfg.l1.shared:
                l1 = MemoryTier(cfg.l1.bytes)
            elif shares is not None:  # a cluster node: tenants may come, each gets an arena of its own
                l1 = TenantArenas(cfg.l1.bytes)
            else:
                l1 = ArenaTier(cfg.l1.bytes)
        else:
            from cachesvc.tiers.cuda import CudaMemoryTier

            l1 = CudaMemoryTier(cfg.l1.bytes, device=cfg.l1.device)
    l2 = LMDBTier(Path(cfg.l2.path), cfg.l2.bytes, file_from=cfg.l2.file_from) if cfg.l2.bytes else None
    l3: Tier | None = None
    peers: list[FillSource] = []
    if cfg.s3.bucket:
        l3 = S3Tier(
            endpoint=cfg.s3.endpoint or None,
            bucket=cfg.s3.bucket,
            prefix=cfg.s3.prefix,
            region=cfg.s3.region,
            access_key=cfg.s3.access_key or None,
            secret_key=cfg.s3.secret_key or None,
            connect_timeout=cfg.s3.connect_timeout,
            read_timeout=cfg.s3.read_timeout,
            max_attempts=cfg.s3.max_attempts,
            breaker_seconds=cfg.s3.breaker_seconds,
            max_value_bytes=cfg.max_value_bytes,
        )
        if ownership is not None:
            # What previous owners hand over after a move first (no request at all), then asking them.
            peers.append(HandedOver(max(cfg.meta.handover_bytes, 1 << 20)))
            peers.append(PeerFill(ownership, token=cfg.security.token, tls_ca=_peer_roots(cfg)))

    def policy_factory(tier: str) -> Any:
        if shares is not None:
            return TenantPolicy(lambda: configured_policy(tier), tier, shares)
        return configured_policy(tier)

    def configured_policy(tier: str) -> Any:
        if cfg.policy == "lru-k":
            policy = make_policy(
                "lru-k",
                k=cfg.lru_k.k,
                correlated_period=cfg.lru_k.correlated_period,
                retained_history=None if cfg.lru_k.retained_history < 0 else cfg.lru_k.retained_history,
            )
        else:
            policy = make_policy(cfg.policy)
        if planned is None:
            return policy
        return PlanAware(policy, planned, reports_evictions=tier == (l1.name if l1 is not None else "l2"))

    return Engine(
        l1=l1,
        l2=l2,
        l3=l3,
        fill_sources=peers,
        policy_factory=policy_factory,
        namespaces=[
            Namespace(ns.prefix.encode(), WriteMode(ns.write_mode), ns.lease_seconds, ns.ttl_seconds, ns.immutable)
            for ns in cfg.namespaces
        ],
        max_value_bytes=cfg.max_value_bytes,
        writeback_capacity=cfg.writeback_queue,
        io_timeout=cfg.io_timeout,
        fill_concurrency=cfg.fill_concurrency,
        max_lease_seconds=cfg.max_lease_seconds,
        fill_l2=cfg.l2.fill_on_read,
        fill_behind_bytes=cfg.l2.fill_behind_bytes,
        fill_idle_seconds=cfg.l2.fill_idle_seconds,
        reads=reads,
        key_index=KeyIndex([prefix.encode() for prefix in cfg.kv_index_prefixes], cfg.kv_index_changes),
        revalidate_seconds=cfg.s3.revalidate_seconds,
        vouch_listings=cfg.s3.vouch_listings,
        vouch_gate=vouch_gate,
    )


def _peer_roots(cfg: ServerConfig) -> bytes | None:
    """The roots a node trusts for its peers' TLS: `security.tls_ca`, else its own certificate (one
    certificate, or one CA's chain, for every node, as `deploy/gen-certs.sh` makes); None without TLS."""
    if not cfg.security.tls_cert:
        return None
    return Path(cfg.security.tls_ca or cfg.security.tls_cert).read_bytes()


def build_prefetcher(
    cfg: ServerConfig, engine: Engine, reads: ReadFeed, planned: PlannedReads | None = None
) -> Prefetcher:
    """The prefetcher of `engine`, following the demand reads `engine` publishes to `reads`;
    its open plans are shown to the tiers' policies through `planned`."""
    prefetcher = Prefetcher(engine, cfg.prefetch_concurrency, cfg.max_prefetch_plans, MAX_PLAN_KEYS, planned)
    reads.subscribe(prefetcher.on_read)
    return prefetcher


def _add_cache_service(server: grpc.Server, servicer: CacheServicer) -> None:
    """Registers the generated handlers, except that Get, GetStream and GetManyStream send bytes they encode themselves.

    A 1 MiB value through protobuf is copied into the message and again into
    the serialized bytes; `CacheServicer.GetEncoded` and the streams
    (`codec.encoded_value_chunks`) write the same wire format with one copy
    (bench/tiers.py: 1 MiB gets went from 0.6x to about the bare gRPC echo's
    throughput).
    """
    handlers: dict[str, Any] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, generic: Any) -> None:
            del generic

        def add_registered_method_handlers(self, service: str, methods: dict[str, Any]) -> None:
            handlers.update(methods)

    cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, _Capture())
    handlers["Get"] = grpc.unary_unary_rpc_method_handler(
        servicer.GetEncoded, request_deserializer=cache_pb2.GetRequest.FromString
    )
    handlers["GetStream"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetStream, request_deserializer=cache_pb2.GetRequest.FromString
    )
    handlers["GetManyStream"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetManyStream, request_deserializer=cache_pb2.GetManyRequest.FromString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def create_server(
    cfg: ServerConfig,
    engine: Engine,
    address: str | None = None,
    *,
    prefetcher: Prefetcher,
    ownership: Ownership | None = None,
    fences: Fences | None = None,
    arena: ArenaSocket | None = None,
    registry: CollectorRegistry | None = None,
    health: Health | None = None,
    table: FollowedTable | None = None,
    tenant_figures: Callable[[], Mapping[str, int]] | None = None,
) -> tuple[grpc.Server, int]:
    """A started gRPC server for `engine` and its `prefetcher` bound to `address` (default `cfg.listen`), and its port.

    With `ownership`, calls of routing clients for keys this server does not
    own are refused (`cachesvc.server.ownership`); with `fences`, a moved
    key's earlier owners are fenced before its first write here
    (`cachesvc.server.fences`). `arena` is where co-located clients get the
    shared L1 (`cachesvc.server.arena_socket`), told by Info, and start the
    sessions their writes go through (`cachesvc.server.staging`). Every call is counted and
    timed, and the server's metrics go into `registry` (a private one when
    None; `serve` serves its registry at /metrics when `metrics_listen` is
    set). Health checks are answered by `health` (`cachesvc.rpc.Health`:
    liveness under "", readiness under the service's name). Info reports
    the namespaces of `table` (default: the config file's), whose tenants'
    tokens reach their own keys only (`cachesvc.server.tenants`), and Stats
    adds `tenant_figures` (per-tenant bytes, hits, misses, evictions). The caller
    closes the prefetcher, then the engine, once the server has stopped.
    """
    registry = registry if registry is not None else CollectorRegistry()
    rpc_metrics = RpcMetrics(registry)
    # First: it also counts the calls a wrong token or an overload gets refused.
    interceptors: list[grpc.ServerInterceptor] = [rpc_metrics]
    if cfg.security.token or cfg.security.admin_token:
        # Tenants' tokens: those of the table the server follows, each reaching its own keys only.
        tenant_tokens = TenantTokens()
        if table is not None:
            tenant_tokens.replace(table.tenants)
            table.on_tenants.append(tenant_tokens.replace)
        interceptors.append(
            TokenAuth(
                {Scope.DATA: cfg.security.token, Scope.ADMIN: cfg.security.admin_token},
                tenants=tenant_tokens.of_header,
                guard=tenant_guard,
            )
        )
    admission = Admission(
        cfg.max_inflight_calls or cfg.workers,
        exempt=[*OPEN_METHOD_PREFIXES, *(f"/{SERVICE_NAME}/{m}" for m in UNLIMITED)],
    )
    interceptors.append(admission)
    # Each open prefetch plan holds a handler thread; the prefetcher refuses
    # more than max_plans, and admission at most `workers` data calls, so
    # the spare threads are always left for health, status and refusals.
    server = new_server(
        cfg.workers,
        MAX_MESSAGE_BYTES,
        thread_name_prefix="rpc",
        interceptors=interceptors,
        long_lived_rpcs=prefetcher.max_plans,
        spare_threads=SPARE_THREADS,
    )

    def totals() -> dict[str, int]:
        return {
            **rpc_metrics.totals(),
            **admission.counters(),
            **(tenant_figures() if tenant_figures is not None else {}),
        }

    servicer = CacheServicer(engine, prefetcher, cfg, ownership=ownership, rpc_totals=totals, fences=fences)
    if table is not None:
        servicer.table = table
    if arena is not None:
        servicer.arena_socket = str(arena.path)
        l2 = engine.l2.tier if engine.l2 is not None else None
        servicer.staging = arena.staging = StagingSessions(
            servicer.put_staged,
            engine.check_size,
            places=l2.incoming if isinstance(l2, LMDBTier) else None,
            file_from=l2.file_from if isinstance(l2, LMDBTier) else 0,
        )
        engine.hold_uploads_while(servicer.staging.writing)  # a co-located save's uploads wait for its end
    registry.register(CacheServerCollector(servicer.stats))
    _add_cache_service(server, servicer)
    port = bind_and_start(
        server,
        address or cfg.listen,
        service_names=[SERVICE_NAME],
        tls_cert=cfg.security.tls_cert,
        tls_key=cfg.security.tls_key,
        health_service=health,
    )
    return server, port


def direct_reads_as_owner(engine: Engine, ownership: Ownership) -> None:
    """Co-located clients of a cluster node read directly (its shared L1, its L2 file) only the keys it owns
    and does not withhold, and nothing while its lease is in doubt or a peer fenced it with a map it has not
    followed yet: following a map marks the copies of the keys that moved, and can outlast the peer's wait
    for its fence, after which the peer takes writes of them (`cachesvc.server.fences`)."""

    def served_as_owner(key: bytes) -> bool:
        if ownership.in_doubt():
            return False  # the shard may have given the key to another node: no direct reads
        placement = ownership.placement
        if placement is None or not ownership.owns(placement, key):
            return False
        return not ownership.withheld(key, lambda k: engine.write_mode(k) is WriteMode.WRITE_BACK)

    engine.direct_reads = served_as_owner
    # Not a test in `served_as_owner`: L2 writes under the hold would be marked for good (nothing unmarks them).
    ownership.on_floor = lambda: engine.hold_direct_reads(True)  # released by `follow_placement`


def follow_placement(
    placement: PlacementMap,
    ownership: Ownership,
    health: Health,
    engine: Engine | None = None,
    handover: Handover | None = None,
) -> None:
    """Follows the shard's map `placement`: the copies of keys that moved are unvouched, then the map is adopted,
    and (with `handover`) the keys that left this node are offered to their new owners."""
    with ownership.adopting():  # a listing that vouches for copies waits for the whole of it (`Fences.before_listing`)
        current = ownership.placement
        _follow(placement, ownership, health, engine)
    if (
        handover is not None
        and current is not None
        and placement.supersedes(current)
        and placement.epoch == current.epoch
        and (current.nodes, current.slots) != (placement.nodes, placement.slots)
    ):
        handover.moved(current, placement)


def _follow(placement: PlacementMap, ownership: Ownership, health: Health, engine: Engine | None) -> None:
    current = ownership.placement
    if engine is not None and current is not None and placement.supersedes(current):  # a rebuilt shard's too
        # Keys that move to or from this node: others write them while they are away, so what is cached
        # of them here is checked against object storage before it is served again (before the map is used).
        # By replica count: a second replica's slots move with the ranking, not only with the owners.
        moved: dict[int, set[int]] = {}

        def changed(key: bytes) -> bool:
            if not placement.slots:
                return True  # a rebuilt shard's map before any node registered: nothing is this node's
            replicas = ownership.replicas(key)
            if replicas not in moved:
                moved[replicas] = _moved_slots(current, placement, ownership.address, replicas)
            return slot_of(key, len(placement.slots)) in moved[replicas]

        layout = (current.nodes, current.capacities, current.slots)
        if placement.skips(current):
            # Layouts this node never saw may have given its keys to others and back (a drain put back within
            # one fetch): every copy it holds is checked before it is served again.
            log.warning(
                "placement version %d follows version %d: this node missed the maps between, whose layouts may "
                "have moved its keys away and back; it checks every cached copy before serving it and fences its "
                "peers again",
                placement.version,
                current.version,
            )
            engine.unvouch_cached()
        elif layout != (placement.nodes, placement.capacities, placement.slots):
            engine.unvouch_cached(changed)
        if placement.absent != current.absent:
            # A holder of write-back values went down or came back: which keys are withheld changed, and a
            # co-located reader must not read one from this node's shared L1 (published again when served).
            engine.conceal_direct_reads()
    ownership.update(placement)
    if engine is not None and current is not None and placement.supersedes(current):
        engine.mark_unreadable()  # copies of keys now another node's, or withheld, out of L2-file reads
    if engine is not None and not ownership.below_floor():
        engine.hold_direct_reads(False)  # caught up with a peer's fence: the copies that moved are marked
    health.set_ready(
        ownership.address in placement.nodes, "not in the placement map: draining, down, or not yet up in the shard"
    )


def _moved_slots(old: PlacementMap, new: PlacementMap, address: str, replicas: int = 1) -> set[int]:
    """The slots whose first `replicas` candidates include `address` by exactly one of `old` and `new`
    (every slot when their slot counts differ). With one replica: the slots it owns by one map only."""
    if len(old.slots) != len(new.slots):
        return set(range(len(new.slots)))
    if replicas == 1:  # the owners alone, without ranking every slot
        return {
            slot
            for slot, (a, b) in enumerate(zip(old.slots, new.slots, strict=True))
            if (old.nodes[a] == address) != (new.nodes[b] == address)
        }
    return {
        slot
        for slot in range(len(new.slots))
        if (address in old.slot_candidates(slot)[:replicas]) != (address in new.slot_candidates(slot)[:replicas])
    }


def serve(cfg: ServerConfig, ready: Callable[[int], None] | None = None, grace: float = 5.0) -> None:
    """Runs a cache server until SIGTERM/SIGINT, then shuts down gracefully."""
    signals = StopSignals()  # before the port opens: a SIGTERM from then on stops cleanly
    tune_malloc(mmap_bytes=MAX_MMAP_BYTES)  # shard parts and their records from the heap (`cacheclient._malloc`)
    reads = ReadFeed()
    # In a cluster the server learns its placement from the membership loop;
    # its address is known once the port is bound.
    table = FollowedTable(cfg.namespaces)
    ownership = Ownership("", table.replicas)
    planned = PlannedReads()
    shares = TenantShares() if cfg.meta.addresses else None
    fences: Fences | None = None
    if cfg.meta.addresses:
        # Before the engine: the copies it reads back from L2 are vouched for by listings from the start, each
        # once this node's peers are fenced (`Fences.before_listing`). Moves (which stamp) come after it exists.
        fences = Fences(
            ownership,
            lambda: engine.versions.next(),
            token=cfg.security.admin_token or cfg.security.token,
            tls_ca=_peer_roots(cfg),
        )
    engine = build_engine(
        cfg,
        reads,
        ownership if cfg.meta.addresses and cfg.meta.peer_fill else None,
        planned,
        shares,
        vouch_gate=fences.before_listing if fences is not None else None,
    )
    table.bind(engine)
    if isinstance(engine.shared_l1, TenantArenas):
        table.on_tenants.append(engine.shared_l1.retable)  # each tenant's values in an arena of its own
    if not cfg.security.token:
        table.on_tenants.append(_warn_open_to_tenants)
    tenant_figures: Callable[[], Mapping[str, int]] | None = None
    if shares is not None:
        by_tenant = TenantReads(shares)
        reads.subscribe(by_tenant.on_read)
        tiered = [(level.name, level.policy) for level in (engine.l1, engine.l2) if level is not None]
        policies = [(name, policy) for name, policy in tiered if isinstance(policy, TenantPolicy)]
        tenant_figures = functools.partial(tenant_counters, policies, by_tenant)
        table.on_tenants.append(
            lambda tenants: shares.replace(
                [(t.name, t.prefixes, t.priority, {"l1": t.l1_bytes, "l2": t.l2_bytes}) for t in tenants]
            )
        )
    prefetcher = build_prefetcher(cfg, engine, reads, planned)
    registry = new_registry()
    health = Health()
    if fences is not None:
        engine.upload_order = fences  # an upload by the key's sole writer skips the object's version check
        # Copies of keys that moved away are not listed at each move: they wait for their first read, if they
        # come back (the walk asks once the map it waited for is adopted; with none yet, a restart's: all).
        engine.vouch_walks = lambda key: (held := ownership.placement) is None or ownership.owns(held, key)

        direct_reads_as_owner(engine, ownership)
    arena: ArenaSocket | None = None
    shared = engine.shared_l1
    if isinstance(shared, (ArenaTier, TenantArenas)):
        try:
            if cfg.l1.socket:
                socket_path = Path(cfg.l1.socket)
            else:  # the directory of every server's default socket: those of killed ones go
                socket_path = default_socket_path(str(os.getpid()))
                remove_stale_sockets(socket_path.parent)
            arena = ArenaSocket(
                shared,
                socket_path,
                (cfg.security.token, cfg.security.admin_token),
                sweep=engine.note_direct_hits,
            ).start()
        except BaseException:
            prefetcher.close()
            engine.close()
            raise
        # In a cluster a node is ready once the placement gives it keys, and
        # not while it is draining (or down, as the shard sees it).
        health.set_ready(False, "not in the placement map yet")
    # The metrics endpoint listens before the gRPC port does: whoever sees the port open can scrape
    # (what create_server registers shows up as it registers it).
    metrics: MetricsServer | None = None
    try:
        if cfg.metrics_listen:
            # The metrics show what the admin-scoped Stats does: the admin token guards them (docs/security.md).
            guard = "" if cfg.metrics_open else cfg.security.admin_token or cfg.security.token
            metrics = serve_metrics(cfg.metrics_listen, registry, token=guard)
        server, port = create_server(
            cfg,
            engine,
            prefetcher=prefetcher,
            ownership=ownership if cfg.meta.addresses else None,
            fences=fences,
            arena=arena,
            registry=registry,
            health=health,
            table=table,
            tenant_figures=tenant_figures,
        )
    except BaseException:
        if metrics is not None:
            metrics.close()
        if arena is not None:
            arena.close()
        prefetcher.close()
        engine.close()
        raise
    host = cfg.listen.rpartition(":")[0]
    log.info("cachesvc serving on %s:%d", host, port)
    before_stop: list[Callable[[], object]] = [health.stopping]
    after_close: list[Callable[[], object]] = []
    holding: WriteBackHolding | None = None
    if cfg.meta.addresses:
        ownership.address = cfg.meta.advertise or f"{host}:{port}"
        meta_addresses = [a.strip() for a in cfg.meta.addresses.split(",") if a.strip()]
        meta_token = cfg.meta.token or cfg.security.admin_token or cfg.security.token
        # With object storage: the shard's table may make a namespace write-back at any time.
        if cfg.s3.bucket:
            holding, holding_client = _write_back_holding(
                MetaClient(meta_addresses, timeout=2.0, token=meta_token or None, tls_ca=cfg.meta.tls_ca or None),
                ownership.address,
                engine,
            )
            after_close += [holding.close, holding_client.close]
        handover = (
            Handover(
                lambda: ownership.address,
                engine.cached_keys,
                engine.clean_copy,
                ownership.replicas,
                fences.fence,
                engine.count,
                engine.cached_bytes,
                token=cfg.security.admin_token or cfg.security.token,
                tls_ca=_peer_roots(cfg),
                window_bytes=cfg.meta.handover_bytes,
            )
            if fences is not None and cfg.meta.handover_bytes > 0 and engine.l3 is not None
            else None
        )
        if handover is not None:
            after_close.append(handover.close)
        table_client = MetaClient(meta_addresses, timeout=2.0, token=meta_token or None, tls_ca=cfg.meta.tls_ca or None)
        table.bind(engine, table_client)
        after_close.append(table_client.close)

        def on_placement(placement: PlacementMap) -> None:
            table.follow(placement.namespaces_version)  # first: the replicas it sets decide what moved
            follow_placement(placement, ownership, health, engine, handover)
            share = node_share(placement, ownership.address) if shares is not None else None
            if shares is not None and share is not None:
                shares.set_share(share)  # tenants' quotas here: the cluster's times this node's weight

        capacity = sum(t["capacity_bytes"] for t in engine.stats()["tiers"])
        membership = Membership(
            meta_addresses,
            ownership.address,
            capacity,
            lambda: sum(t["used_bytes"] for t in engine.stats()["tiers"]),
            interval=cfg.meta.heartbeat_seconds,
            on_placement=on_placement,
            # Back after losing its lease: others may have written its keys meanwhile (and a shard
            # rebuilt from empty does not know what this node holds).
            on_rejoin=_in_turn(ownership.rejoined, engine.suspect_cached, *([holding.forget] if holding else [])),
            # Registering and heartbeating change membership: the admin scope.
            token=meta_token,
            tls_ca=cfg.meta.tls_ca or None,
            # Cut off for half its lease: co-located clients stop reading its shared L1 and L2 file (served_as_owner).
            on_doubt=engine.doubt_direct_reads,
        )
        ownership.in_doubt = lambda: membership.in_doubt
        ownership.fetch = membership.fetch_placement  # a client ahead of this server: the shard's map decides
        membership.start()
        # Out of the placement while the port still answers: clients move at once, not after the lease.
        before_stop.append(membership.leave)
    # Open plans would hold the graceful stop for its whole grace period.
    before_stop.append(prefetcher.close)
    run_until_signalled(
        server,
        grace=grace,
        signals=signals,
        ready=None if ready is None else lambda: ready(port),
        before_stop=before_stop,
        # Things to close once no RPC runs, in order (the prefetcher again,
        # for a stop that skipped the steps above).
        close=[
            *([metrics.close] if metrics else []),
            *([arena.close] if arena else []),
            prefetcher.close,
            engine.close,
            *after_close,
            *([fences.close] if fences else []),
        ],
    )


def _write_back_holding(client: MetaClient, address: str, engine: Engine) -> tuple[WriteBackHolding, MetaClient]:
    """The gate every write-back value passes in a cluster (`cachesvc.server.holding`), started."""
    holding = WriteBackHolding(
        lambda holds: client.set_holding(address, holds, timeout=2.0),
        engine.dirty_count,
    )
    engine.write_back_gate = holding
    holding.start()
    return holding, client


def _warn_open_to_tenants(tenants: Sequence[object]) -> None:
    if tenants:
        log.error(
            "the shard's table has tenants but this server has no token: any client reads and writes every key, "
            "a tenant's token too; set CACHESVC_SECURITY_TOKEN and CACHESVC_SECURITY_ADMIN_TOKEN (docs/security.md)"
        )


def _in_turn(*calls: Callable[[], object]) -> Callable[[], None]:
    def in_turn() -> None:
        for call in calls:
            call()

    return in_turn
