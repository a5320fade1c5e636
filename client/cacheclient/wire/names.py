"""Names both ends agree on: node states, tier names, call metadata, and the host's boot id."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

from cacheclient._proto import cache_pb2, meta_pb2

__all__ = [
    "AUTH_METADATA",
    "LEADER_ADDRESS_METADATA",
    "LEADER_ID_METADATA",
    "LIMIT_METADATA",
    "MAX_REQUEST_ID_CHARS",
    "NODE_STATE_NAMES",
    "OWNER_METADATA",
    "PLACEMENT_VERSION_METADATA",
    "READ_METADATA",
    "READ_VERIFIED",
    "REQUEST_ID_METADATA",
    "RETRY_PUSHBACK_METADATA",
    "ROUTE_FALLBACK",
    "ROUTE_HANDOVER",
    "ROUTE_METADATA",
    "ROUTE_PEER",
    "TIER_NAMES",
    "TIER_OF_NAME",
    "bearer_metadata",
    "boot_id",
    "new_request_id",
    "node_state_name",
    "node_state_value",
]

NODE_STATE_NAMES: Mapping[meta_pb2.NodeState, str] = MappingProxyType(
    {
        meta_pb2.NODE_STATE_JOINING: "joining",
        meta_pb2.NODE_STATE_UP: "up",
        meta_pb2.NODE_STATE_DRAINING: "draining",
        meta_pb2.NODE_STATE_DOWN: "down",
    }
)
"""A cache node's `NodeState` values by the names people type and read."""
_NODE_STATE_OF_NAME = {name: value for value, name in NODE_STATE_NAMES.items()}

TIER_NAMES: Mapping[cache_pb2.Tier, str] = MappingProxyType(
    {cache_pb2.TIER_L1: "l1", cache_pb2.TIER_L2: "l2", cache_pb2.TIER_L3: "l3"}
)
"""The protocol's `Tier` values by the tier names in stats and configs."""
TIER_OF_NAME: Mapping[str, cache_pb2.Tier] = MappingProxyType({name: value for value, name in TIER_NAMES.items()})
"""`TIER_NAMES` inverted."""

AUTH_METADATA = "authorization"
"""Call metadata that carries the bearer token."""
LEADER_ID_METADATA = "leader-id"
"""Trailing metadata of a metadata node that does not lead: the leader's id, as it knows it."""
LEADER_ADDRESS_METADATA = "leader-address"
"""Trailing metadata of a metadata node that does not lead: the leader's address, as it knows it."""
LIMIT_METADATA = "limit-exceeded"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer that a retry cannot fix: the name of the limit the request
is over (for example "max_proposal_bytes"). Without it, RESOURCE_EXHAUSTED means "overloaded now, retry"."""
PLACEMENT_VERSION_METADATA = "placement-version"
"""Call metadata of a routing client: the version of the placement map it routed by.

Also the trailing metadata of a NOT_OWNER answer: the version of the server's
map. A call without it comes from a client of one server, which every server
serves whatever it owns.
"""
OWNER_METADATA = "placement-owner"
"""Trailing metadata of a NOT_OWNER answer: the address that owns the (first) refused key, by the server's map."""
ROUTE_METADATA = "placement-route"
"""Call metadata of a routing client that sends keys to a node that does not own them, on purpose."""
ROUTE_FALLBACK = "fallback"
"""`ROUTE_METADATA` value: the owners could not be reached; serve (and fill) the keys as if owned."""
ROUTE_PEER = "peer"
"""`ROUTE_METADATA` value: a cache node reads a key it now owns from its previous owner (peer fill):
answer from the cache tiers only, never from object storage."""
ROUTE_HANDOVER = "handover"
"""`ROUTE_METADATA` value of a PutMany: a key's previous owner hands its cached copies to the key's new owner
after a move (`cachesvc.server.handover`); each is cached as a fill of the key would cache it, once checked
against object storage, and never written anywhere."""
READ_METADATA = "x-cachesvc-read"
"""Call metadata of a read whose caller checks each value against its key (`READ_VERIFIED`)."""
READ_VERIFIED = "verified"
"""`READ_METADATA` value: the keys are content-addressed (their name is a digest of their bytes, as a checkpoint's
chunks are), so every stored value of one is the value: a write-back key a node withholds while a node that
may hold a newer value is down (`FAILED_PRECONDITION`) is served from what it has, or from object storage."""
RETRY_PUSHBACK_METADATA = "grpc-retry-pushback-ms"
"""gRPC's trailing metadata that tells a client's retry policy when to retry; "-1": never (a limit the
request itself is over, which a retry would meet again)."""
REQUEST_ID_METADATA = "x-request-id"
"""Call metadata: the id a client gives each call, which the server puts on every log line the call causes."""
MAX_REQUEST_ID_CHARS = 64
"""Longest request id a server logs; a longer one, or one with other than letters, digits, "-", "_" and ".",
is not logged (the call is still served)."""


def new_request_id() -> str:
    """A fresh request id: 16 hex digits."""
    return os.urandom(8).hex()


def node_state_name(state: int) -> str:
    """The name ("up", "down", ...) of a `NodeState` value; "unknown" for any other value."""
    return NODE_STATE_NAMES.get(state, "unknown")  # type: ignore[call-overload]


def node_state_value(name: str) -> meta_pb2.NodeState:
    """The `NodeState` value named "joining", "up", "draining" or "down".

    Raises:
        ValueError: not one of those names.
    """
    try:
        return _NODE_STATE_OF_NAME[name]
    except KeyError:
        raise ValueError(f"unknown node state {name!r}; one of {', '.join(_NODE_STATE_OF_NAME)}") from None


def bearer_metadata(token: str) -> tuple[tuple[str, str]]:
    """The call metadata that presents `token`."""
    return ((AUTH_METADATA, f"Bearer {token}"),)


def boot_id() -> str:
    """This host's boot id (Linux); "" where there is none.

    A client compares it, with the host name, to the server's, to learn that
    both run on one machine and it may read the server's L2 file directly.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
