"""What a tenant's call to the metadata shard may reach: the routing view, and manifests under its prefixes.

`guard(tenant, method, handler)` (`cachesvc.rpc.TokenAuth`'s guard) wraps
the handler of each shard method a tenant calls. A tenant's routing client
gets the placement map and the leader as anyone does, and the namespace
table less other tenants' part. Manifests are scoped by name: a tenant
reads, puts and deletes a manifest whose name lies under one of its
prefixes, and a put must also keep the manifest's `s3_prefix` (when set)
and every item's key under them; anything else answers PERMISSION_DENIED
naming the tenant, and `ListManifests` shows it only names under its
prefixes. A Propose carrying any other command (membership, the table,
tenants) is refused whole, before anything reaches the log. Methods of the
admin scope never reach here: `TokenAuth` refuses them for tenants.
"""

from __future__ import annotations

from typing import Any

import grpc

from cacheclient.meta import TenantEntry
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.scopes import PROPOSE_OP_SCOPES
from cachesvc.tenancy import owns, refusal

__all__ = ["guard"]

_ROUTING_METHODS = frozenset({"GetPlacement", "Leader"})
"""What a tenant's routing client asks the shard, besides its own part of the namespace table."""

_MANIFEST_OPS = frozenset({"put_manifest", "delete_manifest"})
"""The commands a tenant may propose (each checked against its prefixes)."""


def _owns_name(tenant: TenantEntry, name: str) -> bool:
    return owns(tenant, name.encode())


def _deny(context: grpc.ServicerContext, tenant: TenantEntry, what: str) -> None:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(tenant, what))


def _check_command(tenant: TenantEntry, command: pb.Command, context: grpc.ServicerContext) -> None:
    """Aborts unless `tenant` may propose `command`; an op that is no client's is left to the servicer."""
    op = command.WhichOneof("op")
    if op == "delete_manifest":
        name = command.delete_manifest.name
        if not _owns_name(tenant, name):
            _deny(context, tenant, f"delete manifest {name[:200]!r}")
    elif op == "put_manifest":
        manifest = command.put_manifest.manifest
        if not _owns_name(tenant, manifest.name):
            _deny(context, tenant, f"put manifest {manifest.name[:200]!r}")
        if manifest.s3_prefix and not _owns_name(tenant, manifest.s3_prefix):
            _deny(context, tenant, f"put manifest {manifest.name[:200]!r} with s3_prefix {manifest.s3_prefix[:200]!r}")
        for item in manifest.items:
            if not _owns_name(tenant, item.key):
                _deny(context, tenant, f"put manifest {manifest.name[:200]!r} naming key {item.key[:200]!r}")
    elif op in PROPOSE_OP_SCOPES:
        _deny(context, tenant, f"propose {op}: a tenant's token proposes manifests only")


def guard(tenant: TenantEntry, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler | None:
    """`handler` as `tenant` may call it; None for a method no tenant may call."""
    name = method.rpartition("/")[2]
    if name in _ROUTING_METHODS:
        return handler
    inner = handler.unary_unary
    if name == "GetNamespaces":

        def own_namespaces(request: pb.GetNamespacesRequest, context: grpc.ServicerContext) -> Any:
            answer: pb.GetNamespacesResponse = inner(request, context)
            others = {p for t in answer.tenants if t.name != tenant.name for p in t.prefixes}
            kept = [ns for ns in answer.namespaces if ns.prefix not in others]
            del answer.namespaces[:]
            answer.namespaces.extend(kept)
            mine = [t for t in answer.tenants if t.name == tenant.name]
            del answer.tenants[:]
            answer.tenants.extend(mine)
            return answer

        return _replace(handler, own_namespaces)
    if name == "GetManifest":

        def get_manifest(request: pb.GetManifestRequest, context: grpc.ServicerContext) -> Any:
            if not _owns_name(tenant, request.name):
                _deny(context, tenant, f"read manifest {request.name[:200]!r}")
            return inner(request, context)

        return _replace(handler, get_manifest)
    if name == "ListManifests":

        def list_manifests(request: pb.ListManifestsRequest, context: grpc.ServicerContext) -> Any:
            answer: pb.ListManifestsResponse = inner(request, context)
            kept = [n for n in answer.names if _owns_name(tenant, n)]
            del answer.names[:]
            answer.names.extend(kept)
            return answer

        return _replace(handler, list_manifests)
    if name == "Propose":

        def propose(request: pb.ProposeRequest, context: grpc.ServicerContext) -> Any:
            # Every command before any is proposed: one Propose is one log entry, applied whole or not at all.
            for command in request.commands:
                _check_command(tenant, command, context)
            return inner(request, context)

        return _replace(handler, propose)
    return None  # ListNodes: every node's address and usage, an operator's view


def _replace(handler: grpc.RpcMethodHandler, unary_unary: Any) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced; its (de)serializers kept."""
    return handler._replace(unary_unary=unary_unary)  # type: ignore[attr-defined, no-any-return]
