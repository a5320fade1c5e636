"""What every `cachectl` command shares: where it connects, with which token and CA, and how it fails.

The addresses (`--cache`, `--meta`, their variables and defaults: `target`),
the bearer token (`token`: the admin one for `ADMIN_COMMANDS`), the CA of
TLS servers (`tls_ca`), the clients made from them (`client_of`,
`meta_client`), the shard's members and slot shares that `nodes`, `leader`,
`status` and `top` show, and the exit statuses (`EXIT_CODES`). The
subcommand modules (`views`, `warm`, `checkpoints`) stand on this one, and
`cachectl`, the parser, on all of them: none imports the one above it.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cacheclient import CacheClient, CacheClientError, connect
from cacheclient.meta import MetaClient
from cacheclient.wire.placement import PlacementMap

__all__ = [
    "ADMIN_COMMANDS",
    "DEFAULT_CACHE",
    "DEFAULT_META",
    "EXIT_AUTH",
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_MISSING",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "UsageError",
    "addresses",
    "client_of",
    "meta_client",
    "one_line",
    "shard_members",
    "slot_shares",
    "target",
    "tls_ca",
    "token",
]

EXIT_MISSING, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_ERROR, EXIT_AUTH = 1, 2, 3, 4, 5
EXIT_CODES = {
    0: "ok",
    EXIT_MISSING: "not found: the key, node or checkpoint is not there (get, rm, evict, checkpoints show|rm)",
    EXIT_USAGE: "bad usage or input (a malformed address, key or size; a value over a limit)",
    EXIT_UNAVAILABLE: "unreachable: a cache server, the shard or its leader, or object storage does not answer",
    EXIT_ERROR: "the server answered with another error",
    EXIT_AUTH: "refused: a missing or wrong token (CACHECTL_TOKEN), or not the admin one (CACHECTL_ADMIN_TOKEN)",
}
DEFAULT_META = "127.0.0.1:7080"
DEFAULT_CACHE = "127.0.0.1:7070"


class UsageError(Exception):
    """Bad input found before any call: exit EXIT_USAGE with the message."""


def addresses(text: str, flag: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` as a list.

    Raises:
        UsageError: an entry is not HOST:PORT (the message names it and the flag).
    """
    found = [a.strip() for a in text.split(",") if a.strip()]
    for address in found or [text]:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{flag} {address!r}: expected HOST:PORT, e.g. {DEFAULT_CACHE}")
    return found


ADMIN_COMMANDS = frozenset({"evict", "drain", "stats", "status", "top", "nodes", "namespace", "tenant"})
"""Commands that make admin calls (`cacheclient.wire.scopes`): Evict, Stats, membership changes, a shard's Status."""


def token(args: argparse.Namespace | None = None) -> str | None:
    """The bearer token: CACHECTL_ADMIN_TOKEN for an admin command (`ADMIN_COMMANDS`), else CACHECTL_TOKEN."""
    if args is not None and getattr(args, "command", None) in ADMIN_COMMANDS:
        admin = os.environ.get("CACHECTL_ADMIN_TOKEN")
        if admin:
            return admin
    return os.environ.get("CACHECTL_TOKEN") or None


def tls_ca(args: argparse.Namespace) -> str | None:
    """The CA file for TLS cache servers: `--tls-ca`, else $CACHECTL_TLS_CA; None for plaintext.

    Raises:
        UsageError: the file cannot be read (named with the flag or variable).
    """
    path = getattr(args, "tls_ca", None)
    source = "--tls-ca"
    if not path:
        path, source = os.environ.get("CACHECTL_TLS_CA") or None, "CACHECTL_TLS_CA"
    if path is None:
        return None
    if not os.access(path, os.R_OK) or not os.path.isfile(path):
        raise UsageError(f"{source} {path!r}: no readable CA file (PEM) there")
    return str(path)


def target(args: argparse.Namespace) -> tuple[str, str]:
    """("cache", ADDRESS) or ("meta", ADDRESSES): what the data commands talk to.

    Flags before variables: `--cache`, then `--meta`, then $CACHECTL_CACHE,
    then $CACHECTL_META, then the default cache server.
    """
    for kind, value in (
        ("cache", args.cache),
        ("meta", getattr(args, "meta", None)),
        ("cache", os.environ.get("CACHECTL_CACHE")),
        ("meta", os.environ.get("CACHECTL_META")),
    ):
        if value:
            return kind, value
    return "cache", DEFAULT_CACHE


def client_of(args: argparse.Namespace) -> CacheClient:
    """The client the data commands use: one cache server, or the cluster behind the shard (`target`)."""
    kind, value = target(args)
    if kind == "meta":
        return CacheClient(
            meta=addresses(value, "--meta"), timeout=args.timeout, token=token(args), tls_ca=tls_ca(args)
        )
    return connect(addresses(value, "--cache")[0], timeout=args.timeout, token=token(args), tls_ca=tls_ca(args))


def meta_client(args: argparse.Namespace) -> MetaClient:
    """The client of the metadata shard: `--meta`, else $CACHECTL_META, else the default address."""
    meta = getattr(args, "meta", None) or os.environ.get("CACHECTL_META") or DEFAULT_META
    return MetaClient(
        addresses(meta, "--meta"),
        timeout=args.wait,
        attempt_timeout=min(1.0, args.wait),
        token=token(args),
        tls_ca=tls_ca(args),
    )


def shard_members(client: MetaClient, timeout: float = 1.0) -> list[dict[str, Any]]:
    """Each metadata node's own status: those given, and every member any of them names.

    A node that does not answer has role "unreachable".
    """
    found: dict[str, dict[str, Any]] = {}
    pending = list(client.addresses)
    while pending:
        wave = [a for a in dict.fromkeys(pending) if a not in found]
        pending = []
        with ThreadPoolExecutor(max(1, len(wave))) as pool:
            statuses = list(pool.map(lambda a: _member_status(client, a, timeout), wave))
        for address, status in zip(wave, statuses, strict=True):
            found[address] = status
            pending.extend(a for a in status.get("members", {}).values() if a not in found)
    return list(found.values())


def _member_status(client: MetaClient, address: str, timeout: float) -> dict[str, Any]:
    try:
        status = client.status(address, timeout=timeout)
    except CacheClientError:
        return {"address": address, "role": "unreachable"}
    status["address"] = address
    return status


def slot_shares(placement: PlacementMap) -> dict[str, float]:
    """Each node's share of the placement's slots (0..1)."""
    counts = Counter(placement.slots)
    return {address: counts[i] / max(1, len(placement.slots)) for i, address in enumerate(placement.nodes)}


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none): what a command prints."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
