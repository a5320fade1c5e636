"""Who a tenant's token belongs to, and which keys it may touch: the piece cache servers and metadata nodes share.

A tenant's token is never stored: the shard keeps its SHA-256
(`cacheclient.wire.scopes.token_sha256`), every node keeps the tenants of
the table it follows by that hash (`TenantTokens`, replaced whole when the
table changes, so a rotated or removed token is refused from the next
table on), and a call's bearer token that is none of the node's own
tokens is looked up here (`cachesvc.rpc.TokenAuth`'s `tenants`). A tenant
is granted the data scope on the keys under its prefixes only (`owns`).

It stands beside `cachesvc.rpc` and imports neither the server nor the shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheclient.meta import TenantEntry
from cacheclient.wire.scopes import token_sha256

__all__ = ["TenantTokens", "owns", "prefixes_of", "refusal"]

_BEARER = "Bearer "


_MAX_SEEN = 1024
"""Headers of tenants' calls remembered with their tenant, so a token is hashed once, not on every call."""


class TenantTokens:
    """The tenants a node knows, by the hash of their token."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, TenantEntry] = {}
        self._seen: dict[str, TenantEntry] = {}

    def replace(self, tenants: Sequence[TenantEntry]) -> None:
        """The tenants of a new table: tokens not among them are refused from now on."""
        self._seen = {}
        self._by_hash = {t.token_sha256: t for t in tenants if t.token_sha256}

    def __len__(self) -> int:
        return len(self._by_hash)

    def of_header(self, header: str) -> TenantEntry | None:
        """The tenant whose token an authorization header presents; None: no tenant's."""
        seen = self._seen  # this table's: `replace` starts a new one
        tenant = seen.get(header)
        if tenant is not None:
            return tenant
        by_hash = self._by_hash
        if not by_hash or not header.startswith(_BEARER):
            return None
        tenant = by_hash.get(token_sha256(header[len(_BEARER) :]))
        if tenant is not None:
            if len(seen) >= _MAX_SEEN:
                seen.clear()
            seen[header] = tenant
        return tenant


def owns(tenant: TenantEntry, key: bytes) -> bool:
    """Whether `key` is under one of `tenant`'s prefixes."""
    return key.startswith(prefixes_of(tenant))


def prefixes_of(tenant: TenantEntry) -> tuple[bytes, ...]:
    """`tenant`'s prefixes as key bytes (what `bytes.startswith` takes in one call)."""
    return tuple(prefix.encode() for prefix in tenant.prefixes)


def refusal(tenant: TenantEntry, what: str) -> str:
    """The PERMISSION_DENIED message of a tenant's call beyond its prefixes."""
    return f"tenant {tenant.name!r} may not {what}: its token reaches keys under {', '.join(tenant.prefixes)} only"
