"""Which token each RPC needs: the one table of scopes, for both services and the Raft transport.

Three scopes:

- ``data``: read and write values (and dataset manifests), route by the
  placement map. The data token (`security.token`) grants it.
- ``admin``: also change membership (register, heartbeat, drain, remove
  nodes), evict from the cache tiers (``cachectl evict`` and ``evict
  --prefix`` are `Evict` calls, one per key), and see config and internals
  (tier stats, a metadata node's members and log). The admin token
  (`security.admin_token`) grants admin and data; without one, the data
  token grants both (one token for everything, as before scopes).
- ``peer``: the Raft transport between metadata nodes; only the shard's
  peer secret (`security.peer_token`) grants it, and it grants nothing else.

`Info` stays ``data`` although it shows settings: routing clients learn a
namespace's replicas from it and co-located clients find the server's L2
directory through it (it never carries credentials). `Propose` needs, on
top of its method's scope, the scope of each command it carries
(`PROPOSE_OP_SCOPES`): registering, changing the state of, removing a cache node or saying what it holds
cache node is ``admin``; so is changing the namespace table or the tenants; writing a manifest is ``data``.

Every method of every service has an entry in `METHOD_SCOPES`; a server
refuses a method it does not find here (tests check the table against the
service descriptors).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from types import MappingProxyType

from cacheclient._proto import cache_pb2, meta_pb2

__all__ = ["METHOD_SCOPES", "PROPOSE_METHOD", "PROPOSE_OP_SCOPES", "Scope", "propose_scope", "token_sha256"]


class Scope(enum.Enum):
    """What a token lets its bearer do."""

    DATA = "data"
    ADMIN = "admin"
    PEER = "peer"


_CACHE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
_META = meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name
_RAFT = meta_pb2.DESCRIPTOR.services_by_name["RaftTransport"].full_name

_D, _A, _P = Scope.DATA, Scope.ADMIN, Scope.PEER
_TABLE = {
    _CACHE: {
        "Get": _D,
        "GetMany": _D,
        "GetStream": _D,
        "GetManyStream": _D,
        "Put": _D,
        "PutMany": _D,
        "PutStream": _D,
        "Delete": _D,
        "Contains": _D,
        "ContainsMany": _D,
        "List": _D,
        "Prefetch": _D,
        "KeyDigest": _D,
        # Routing and co-located clients need it; it shows no credentials (see above).
        "Info": _D,
        # Tier budgets, policies and engine counters: an operator's view.
        "Stats": _A,
        # Drops a key others are reading from the fast tiers; `evict --prefix` is many of these.
        "Evict": _A,
        # Between cache servers: makes a server refuse calls routed by older maps (cachesvc.server.fences).
        "Fence": _A,
    },
    _META: {
        # And each command's scope (PROPOSE_OP_SCOPES).
        "Propose": _D,
        # Keeps a cache node up (in the placement): membership.
        "Heartbeat": _A,
        "GetManifest": _D,
        "ListManifests": _D,
        "ListNodes": _D,
        "GetPlacement": _D,
        # The namespace table and tenants (their token hashes only to the admin scope: the servicer checks).
        "GetNamespaces": _D,
        "Leader": _D,
        # The shard's members and log position: config and internals.
        "Status": _A,
        "CommittedEntries": _A,
    },
    _RAFT: {"Send": _P},
}

METHOD_SCOPES: Mapping[str, Scope] = MappingProxyType(
    {f"/{service}/{method}": scope for service, methods in _TABLE.items() for method, scope in methods.items()}
)
"""Full method name ("/cachesvc.v1.CacheService/Get") -> the scope its caller needs."""

PROPOSE_METHOD = f"/{_META}/Propose"

PROPOSE_OP_SCOPES: Mapping[str, Scope] = MappingProxyType(
    {
        "register_node": _A,
        "set_node_state": _A,
        "remove_node": _A,
        "set_holding": _A,
        "put_manifest": _D,
        "delete_manifest": _D,
        # The namespace table and the tenants: what every node applies, and who may read what.
        "put_namespace": _A,
        "delete_namespace": _A,
        "put_tenant": _A,
        "delete_tenant": _A,
    }
)
"""A client command's op (`Command.op`) -> its scope; the only ops a client may propose."""


def propose_scope(request: meta_pb2.ProposeRequest) -> Scope:
    """The scope a Propose needs: admin when any of its commands is (an unknown op is the servicer's to refuse)."""
    ops = {cmd.WhichOneof("op") for cmd in request.commands}
    return _A if any(PROPOSE_OP_SCOPES.get(op or "") is _A for op in ops) else _D


def token_sha256(token: str) -> bytes:
    """What the shard keeps of a tenant's token, and what a server compares a presented token's hash with."""
    return hashlib.sha256(token.encode()).digest()
