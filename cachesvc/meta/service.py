"""The gRPC face of a metadata node: `MetaService` for clients, `RaftTransport` for peers.

The servicer is thin: it decodes, hands the request to the `MetaNode`, waits
for the answer and encodes it. One function (`_status_of`) maps the node's
errors to kinds of failure, whose status codes come from the wire contract's
table (`cacheclient.wire.status`). A node that does not lead refuses writes with
FAILED_PRECONDITION and puts the leader it knows in the trailing metadata
(``leader-id``, ``leader-address``), so clients go there; reads are served
by any node through ReadIndex.

`create_server(node, address)` binds both services (tests pass port 0);
`serve(cfg, listen)` runs a node until SIGTERM or Ctrl-C, handing
leadership to a peer before it exits.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NoReturn, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Histogram

from cacheclient.meta import TenantEntry
from cacheclient.wire import (
    AUTH_METADATA,
    LEADER_ADDRESS_METADATA,
    LEADER_ID_METADATA,
    LIMIT_METADATA,
    META_MAX_MESSAGE_BYTES,
    ErrorKind,
    bearer_metadata,
    meta_pb2_grpc,
    status_code,
)
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.scopes import PROPOSE_OP_SCOPES, Scope
from cachesvc.config import MetaNodeConfig, MetaSecurityConfig, NodeConfig
from cachesvc.meta.metrics import MetaNodeCollector, proposal_histogram
from cachesvc.meta.node import MetaNode, OutcomeUnknownError, OverloadedError
from cachesvc.meta.raft import NotLeaderError, ProposalDroppedError
from cachesvc.meta.state import MetaState, placement_slots
from cachesvc.meta.tenants import guard as tenant_guard
from cachesvc.meta.transport import RaftTransportServicer
from cachesvc.metrics import MetricsServer, RpcMetrics, new_registry, serve_metrics
from cachesvc.rpc import StopSignals, TokenAuth, bind_and_start, new_server, run_until_signalled
from cachesvc.tenancy import TenantTokens

__all__ = ["MetaServicer", "create_server", "serve"]

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_NAME = "cachesvc.v1.MetaService"
RAFT_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RaftTransport"].full_name
_MAX_WAIT = 10.0
_CLIENT_OPS = frozenset(PROPOSE_OP_SCOPES)


@functools.lru_cache(maxsize=8)
def _placement(members: tuple[tuple[str, int], ...]) -> list[int]:
    # Computed here, on a handler thread, not on the Raft thread.
    return placement_slots(members)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, NotLeaderError):
        return status_code(ErrorKind.FAILED_PRECONDITION), str(exc)
    if isinstance(exc, OverloadedError):
        return status_code(ErrorKind.LIMIT_EXCEEDED), str(exc)
    if isinstance(exc, OutcomeUnknownError | ProposalDroppedError | TimeoutError):
        return status_code(ErrorKind.UNAVAILABLE), str(exc) or "no answer in time; the outcome is unknown"
    if isinstance(exc, ValueError):
        return status_code(ErrorKind.INVALID_REQUEST), str(exc)
    return status_code(ErrorKind.INTERNAL), f"{type(exc).__name__}: {exc}"


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    """Client requests to one metadata node.

    Args:
        node: the node.
        proposal_seconds: observes how long each client write took from its
            arrival to its commit and apply (`cachesvc.meta.metrics.proposal_histogram`).
        max_proposal_bytes: a larger Propose request is refused with
            RESOURCE_EXHAUSTED naming the limit; it never reaches the log.
        admin_token: the shard's admin token ("": none). Tenants need one:
            without it a tenant command is refused naming the setting; with
            it, GetNamespaces shows tenants' token hashes to its bearer only.
    """

    def __init__(
        self,
        node: MetaNode,
        proposal_seconds: Histogram | None = None,
        max_proposal_bytes: int = MetaNodeConfig.max_proposal_bytes,
        admin_token: str = "",
    ) -> None:
        self._node = node
        self._proposal_seconds = proposal_seconds
        self._max_proposal_bytes = max_proposal_bytes
        self._admin_header = dict(bearer_metadata(admin_token))[AUTH_METADATA] if admin_token else ""

    # -- plumbing ---------------------------------------------------------

    def _fail(self, context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
        if isinstance(exc, NotLeaderError):
            context.set_trailing_metadata(
                (
                    (LEADER_ID_METADATA, str(exc.leader or 0)),
                    (LEADER_ADDRESS_METADATA, self._node.address_of(exc.leader)),
                )
            )
        code, details = _status_of(exc)
        context.abort(code, details)
        raise AssertionError("context.abort returned")  # It raises; this tells the type checker.

    def _wait(self, context: grpc.ServicerContext, fut: Future[T]) -> T:
        remaining = context.time_remaining()
        timeout = _MAX_WAIT if remaining is None else max(0.0, min(_MAX_WAIT, remaining - 0.02))
        try:
            return fut.result(timeout=timeout)
        except Exception as exc:
            self._fail(context, exc)

    def _read(self, context: grpc.ServicerContext, options: pb.ReadOptions, fn: Callable[[MetaState], T]) -> T:
        try:
            fut = self._node.inspect(lambda node: fn(node.state)) if options.stale else self._node.read(fn)
        except Exception as exc:
            self._fail(context, exc)
        return self._wait(context, fut)

    # -- writes -----------------------------------------------------------

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        size = request.ByteSize()
        if size > self._max_proposal_bytes:
            context.set_trailing_metadata(((LIMIT_METADATA, "max_proposal_bytes"),))
            context.abort(
                status_code(ErrorKind.LIMIT_EXCEEDED),
                f"proposal of {size} bytes is over the limit of {self._max_proposal_bytes} bytes (max_proposal_bytes)",
            )
        for cmd in request.commands:
            op = cmd.WhichOneof("op")
            if op not in _CLIENT_OPS:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a client command: {op}")
            if op == "put_tenant" and not self._admin_header:
                # Not FAILED_PRECONDITION: clients take that for "not the leader" and go on asking.
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "tenants need an admin token: without one the data token reads every tenant's keys; set "
                    "CACHESVC_SECURITY_ADMIN_TOKEN (security.admin_token) on the metadata nodes and cache servers",
                )
        if not request.commands:
            return pb.ProposeResponse()
        began = time.perf_counter()
        try:
            fut = self._node.propose(list(request.commands))
        except Exception as exc:
            self._fail(context, exc)
        results = self._wait(context, fut)
        if self._proposal_seconds is not None:
            self._proposal_seconds.observe(time.perf_counter() - began)
        return pb.ProposeResponse(results=results)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        try:
            lease_ms = self._node.heartbeat(request.beats)
        except Exception as exc:
            self._fail(context, exc)
        return pb.HeartbeatResponse(lease_ms=lease_ms)

    # -- linearizable reads -------------------------------------------------

    def GetManifest(self, request: pb.GetManifestRequest, context: grpc.ServicerContext) -> pb.GetManifestResponse:
        def fn(state: MetaState) -> pb.GetManifestResponse:
            m = state.manifests.get(request.name)
            if m is None:
                return pb.GetManifestResponse(found=False, applied_index=state.applied_index)
            return pb.GetManifestResponse(found=True, manifest=m, applied_index=state.applied_index)

        return self._read(context, request.options, fn)

    def ListManifests(
        self, request: pb.ListManifestsRequest, context: grpc.ServicerContext
    ) -> pb.ListManifestsResponse:
        return self._read(context, request.options, lambda s: pb.ListManifestsResponse(names=sorted(s.manifests)))

    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        def fn(state: MetaState) -> pb.ListNodesResponse:
            nodes = [state.nodes[a].to_proto() for a in sorted(state.nodes)]
            return pb.ListNodesResponse(nodes=nodes, time_ms=state.time_ms)

        return self._read(context, request.options, fn)

    def GetPlacement(self, request: pb.GetPlacementRequest, context: grpc.ServicerContext) -> pb.GetPlacementResponse:
        version, epoch, members, (holders, absent), (layout, before) = self._read(
            context,
            request.options,
            lambda s: (s.placement_version, s.epoch, s.placement_members, s.placement_holders, s.placement_layouts),
        )
        # Read after the map: a table that changed in between is fetched on the next answer.
        namespaces_version = self._node.state.namespaces_version
        if request.known_version == version and request.known_epoch == epoch:
            return pb.GetPlacementResponse(
                version=version, epoch=epoch, unchanged=True, namespaces_version=namespaces_version
            )
        return pb.GetPlacementResponse(
            namespaces_version=namespaces_version,
            version=version,
            epoch=epoch,
            nodes=[a for a, _ in members],
            slots=_placement(members),
            capacities=[c for _, c in members],
            holders=holders,
            absent=[a for a, _ in absent],
            absent_capacities=[c for _, c in absent],
            layout_version=layout,
            layout_before=before,
        )

    def GetNamespaces(
        self, request: pb.GetNamespacesRequest, context: grpc.ServicerContext
    ) -> pb.GetNamespacesResponse:
        admin = bool(self._admin_header) and hmac.compare_digest(
            str(dict(context.invocation_metadata() or ()).get(AUTH_METADATA, "")), self._admin_header
        )

        def fn(state: MetaState) -> pb.GetNamespacesResponse:
            response = pb.GetNamespacesResponse(
                version=state.namespaces_version,
                namespaces=[state.namespaces[p] for p in sorted(state.namespaces)],
                tenants=[state.tenants[n] for n in sorted(state.tenants)],
            )
            if not admin:
                for tenant in response.tenants:
                    tenant.ClearField("token_sha256")
            return response

        return self._read(context, request.options, fn)

    # -- local views ------------------------------------------------------

    def Leader(self, request: pb.LeaderRequest, context: grpc.ServicerContext) -> pb.LeaderResponse:
        info = self._node.info
        return pb.LeaderResponse(
            leader_id=info.leader or 0,
            leader_address=self._node.address_of(info.leader),
            term=info.term,
            node_id=info.id,
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        def fn(node: MetaNode) -> pb.StatusResponse:
            info = node.info
            return pb.StatusResponse(
                node_id=info.id,
                role=info.role.value,
                term=info.term,
                leader_id=info.leader or 0,
                commit=info.commit,
                applied=info.applied,
                last_index=info.last_index,
                snapshot_index=info.snapshot_index,
                state_digest=node.state.digest() if request.state_digest else b"",
                members=[pb.MemberStatus(id=i, address=a) for i, a in sorted(node.cfg.peers.items())],
                commands_proposed=node.stats["commands_proposed"],
                entries_proposed=node.stats["entries_proposed"],
                persists=node.stats["persists"],
            )

        try:
            fut = self._node.inspect(fn)
        except Exception as exc:
            self._fail(context, exc)
        return self._wait(context, fut)

    def CommittedEntries(
        self, request: pb.CommittedEntriesRequest, context: grpc.ServicerContext
    ) -> pb.CommittedEntriesResponse:
        try:
            fut = self._node.inspect(lambda node: node.committed_entries(request.lo, request.hi))
        except Exception as exc:
            self._fail(context, exc)
        entries = self._wait(context, fut)
        return pb.CommittedEntriesResponse(
            entries=[
                pb.EntryDigest(index=i, term=t, digest=hashlib.blake2b(d, digest_size=16).digest())
                for i, t, d in entries
            ]
        )


class _ShardTenants:
    """The tenants of the shard's state by their tokens' hashes, rebuilt when the table's version moves."""

    def __init__(self, node: MetaNode) -> None:
        self._node = node
        self._version = -1
        self._tokens = TenantTokens()

    def of_header(self, header: str) -> TenantEntry | None:
        state = self._node.state
        version = state.namespaces_version
        if version != self._version:
            try:
                tenants = [TenantEntry.from_proto(t) for t in list(state.tenants.values())]
            except RuntimeError:  # changed while copied (the Raft thread applies): the next call reads it again
                return None
            self._tokens.replace(tenants)
            self._version = version
        return self._tokens.of_header(header)


def create_server(
    node: MetaNode,
    address: str,
    workers: int = 32,
    registry: CollectorRegistry | None = None,
    *,
    security: MetaSecurityConfig | None = None,
    max_proposal_bytes: int = MetaNodeConfig.max_proposal_bytes,
    max_raft_message_bytes: int = MetaNodeConfig.max_raft_message_bytes,
) -> tuple[grpc.Server, int]:
    """A started gRPC server with both services of `node`, bound to `address`, and its port.

    Every call is counted and timed, and the node's Raft state exported,
    into `registry` (a private one when None). With `security.token`,
    MetaService calls need a bearer token of their scope
    (`cacheclient.wire.scopes`: with `security.admin_token`, membership
    changes, heartbeats, Status and CommittedEntries need that one; a
    tenant's token reaches the routing view and its own manifests,
    `cachesvc.meta.tenants`); with
    `security.peer_token`, RaftTransport calls need that one (a client
    token cannot append entries); health and reflection stay open. With
    `security.tls_cert` and `tls_key`, both services speak TLS.

    Raises:
        OSError: `address` cannot be bound.
    """
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(MetaNodeCollector(node))
    security = security if security is not None else MetaSecurityConfig()
    # First: it also counts the calls a wrong token gets refused.
    interceptors: list[grpc.ServerInterceptor] = [RpcMetrics(registry)]
    if security.token or security.admin_token or security.peer_token:
        interceptors.append(
            TokenAuth(
                {Scope.DATA: security.token, Scope.ADMIN: security.admin_token, Scope.PEER: security.peer_token},
                tenants=_ShardTenants(node).of_header,
                guard=tenant_guard,
            )
        )
    server = new_server(workers, META_MAX_MESSAGE_BYTES, thread_name_prefix="meta-rpc", interceptors=interceptors)
    meta_pb2_grpc.add_MetaServiceServicer_to_server(
        MetaServicer(node, proposal_histogram(registry), max_proposal_bytes, security.admin_token), server
    )
    meta_pb2_grpc.add_RaftTransportServicer_to_server(
        RaftTransportServicer(node.deliver, max_raft_message_bytes), server
    )
    port = bind_and_start(
        server,
        address,
        service_names=[SERVICE_NAME, RAFT_SERVICE_NAME],
        tls_cert=security.tls_cert,
        tls_key=security.tls_key,
    )
    return server, port


def serve(
    cfg: NodeConfig,
    listen: str,
    ready: Callable[[int], None] | None = None,
    grace: float = 2.0,
    metrics_listen: str = "",
    *,
    metrics_open: bool = False,
    security: MetaSecurityConfig | None = None,
    max_proposal_bytes: int = MetaNodeConfig.max_proposal_bytes,
    max_raft_message_bytes: int = MetaNodeConfig.max_raft_message_bytes,
) -> None:
    """Runs a metadata node until SIGTERM/SIGINT, then hands over leadership and stops.

    With `metrics_listen` (HOST:PORT), serves Prometheus metrics at /metrics
    there, to scrapes that present the admin token when `security` has a
    token (unless `metrics_open`). `security` and the limits are as in
    `create_server`.
    """
    signals = StopSignals()  # before the port opens: a SIGTERM from then on stops cleanly
    node = MetaNode(cfg)
    node.start()
    registry = new_registry()
    metrics: MetricsServer | None = None
    try:
        if metrics_listen:  # before the gRPC port opens: whoever sees it open can scrape
            guard = "" if metrics_open or security is None else security.admin_token or security.token
            metrics = serve_metrics(metrics_listen, registry, token=guard)
        server, port = create_server(
            node,
            listen,
            registry=registry,
            security=security,
            max_proposal_bytes=max_proposal_bytes,
            max_raft_message_bytes=max_raft_message_bytes,
        )
    except BaseException:
        if metrics is not None:
            metrics.close()
        node.stop()
        raise
    log.info("meta node %d serving on %s (port %d)", cfg.id, listen, port)

    def check() -> None:
        if node.failed is not None:
            raise SystemExit(f"meta node {cfg.id}: raft thread died: {node.failed!r}")

    run_until_signalled(
        server,
        grace=grace,
        signals=signals,
        ready=None if ready is None else lambda: ready(port),
        check=check,
        before_stop=[lambda: node.hand_over_leadership(wait=1.0)],
        close=[*([metrics.close] if metrics else []), node.stop],
    )
