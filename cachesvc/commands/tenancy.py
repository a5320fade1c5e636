"""`cachectl namespace add|set|rm|ls` and `cachectl tenant add|set|rm|ls|token`: the shard's namespace table
and its tenants.

Both live in the metadata shard (`--meta`, else $CACHECTL_META): every cache
node and routing client follows them within a heartbeat. Changing them
needs the admin scope (CACHECTL_ADMIN_TOKEN). A tenant's token is made
here, printed once as the last line of stdout, and kept in the shard only
as its SHA-256; the shard refuses tenants when it has no admin token.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any

from cacheclient.meta import CommandRefusedError, NamespaceEntry, TenantEntry
from cacheclient.wire.scopes import token_sha256
from cachesvc.commands import views
from cachesvc.commands.common import EXIT_MISSING, EXIT_USAGE, meta_client
from cachesvc.config import ConfigError, parse_size
from cachesvc.units import human_bytes

__all__ = ["add_parsers"]

WRITE_MODES = ("write-through", "write-back", "cache-only")
PRIORITIES = ("high", "normal", "low")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except (ConfigError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _refused(exc: CommandRefusedError) -> int:
    print(f"cachectl: refused: {exc}", file=sys.stderr)
    return EXIT_MISSING if str(exc).startswith("no ") else EXIT_USAGE


# ---------------------------------------------------------------- namespaces


def cmd_namespace(args: argparse.Namespace) -> int:
    with meta_client(args) as client:
        if args.namespace_command == "ls":
            table = client.namespaces()
            owners = {p: t.name for t in table.tenants for p in t.prefixes}
            rows = [
                {
                    "prefix": ns.prefix,
                    "write_mode": ns.write_mode,
                    "lease_seconds": ns.lease_seconds,
                    "ttl_seconds": ns.ttl_seconds,
                    "replicas": ns.replicas,
                    "tenant": owners.get(ns.prefix, ""),
                }
                for ns in table.namespaces
            ]
            if args.json:
                print(json.dumps({"version": table.version, "namespaces": rows}, indent=2, sort_keys=True))
                return 0
            print(f"{'prefix':<24} {'write mode':<14} {'lease':>7} {'ttl':>7} {'replicas':>8} tenant")
            for r in rows:
                print(
                    f"{r['prefix']:<24} {r['write_mode']:<14} {r['lease_seconds']:>7g} {r['ttl_seconds']:>7g} "
                    f"{r['replicas']:>8} {r['tenant'] or '-'}"
                )
            note = "" if table.version else ": none set, nodes follow their config files"
            print(f"(table version {table.version}{note})")
            return 0
        try:
            if args.namespace_command == "rm":
                version = client.delete_namespace(args.prefix)
                print(f"namespace {args.prefix!r} removed (table version {version})")
                return 0
            current = {ns.prefix: ns for ns in client.namespaces().namespaces}
            replace = args.namespace_command == "set"
            base = current.get(args.prefix, NamespaceEntry(args.prefix)) if replace else NamespaceEntry(args.prefix)
            entry = NamespaceEntry(
                args.prefix,
                args.write_mode if args.write_mode is not None else base.write_mode,
                args.lease if args.lease is not None else base.lease_seconds,
                args.ttl if args.ttl is not None else base.ttl_seconds,
                args.replicas if args.replicas is not None else base.replicas,
            )
            version = client.put_namespace(entry, replace=replace)
        except CommandRefusedError as exc:
            return _refused(exc)
    verb = "set" if replace else "added"
    print(f"namespace {entry.prefix!r} {verb}: {entry.write_mode}, replicas {entry.replicas} (table version {version})")
    return 0


# ---------------------------------------------------------------- tenants


def _tenant_row(t: TenantEntry) -> dict[str, Any]:
    return {
        "name": t.name,
        "prefixes": list(t.prefixes),
        "l1_bytes": t.l1_bytes,
        "l2_bytes": t.l2_bytes,
        "priority": t.priority,
    }


def _usage(used: int, quota: int) -> str:
    return f"{human_bytes(used)} / {human_bytes(quota) if quota else '-'}"


def cmd_tenant(args: argparse.Namespace) -> int:
    with meta_client(args) as client:
        if args.tenant_command == "ls":
            table = client.namespaces()
            # Usage from every cache node's Stats (admin): the nodes' bytes summed, against the cluster's quota.
            used = views.tenant_figures(views.gather(args, probe=False).nodes)
            rows = [{**_tenant_row(t), "used": used.get(t.name, {})} for t in table.tenants]
            if args.json:
                print(json.dumps({"version": table.version, "tenants": rows}, indent=2, sort_keys=True))
                return 0
            print(f"{'tenant':<16} {'priority':<8} {'l1 used/quota':>22} {'l2 used/quota':>22} {'hit%':>6} prefixes")
            for r in rows:
                u = r["used"]
                reads = u.get("l1_hits", 0) + u.get("l2_hits", 0) + u.get("misses", 0)
                hit = f"{100 * (u.get('l1_hits', 0) + u.get('l2_hits', 0)) / reads:.1f}" if reads else "-"
                print(
                    f"{r['name']:<16} {r['priority']:<8} {_usage(u.get('l1_bytes', 0), r['l1_bytes']):>22} "
                    f"{_usage(u.get('l2_bytes', 0), r['l2_bytes']):>22} {hit:>6} {' '.join(r['prefixes'])}"
                )
            return 0
        try:
            if args.tenant_command == "rm":
                version = client.delete_tenant(args.name)
                print(f"tenant {args.name!r} removed; its token is refused (table version {version})")
                return 0
            current = {t.name: t for t in client.namespaces().tenants}
            if args.tenant_command == "add":
                token = secrets.token_urlsafe(32)
                tenant = TenantEntry(
                    args.name,
                    tuple(args.prefix),
                    args.l1 or 0,
                    args.l2 or 0,
                    args.priority or "normal",
                    token_sha256(token),
                )
                version = client.put_tenant(tenant)
                print(f"tenant {tenant.name!r} added (table version {version}): prefixes {' '.join(tenant.prefixes)}")
                print("its token (shown once; the shard keeps only its hash):")
                print(token)
                return 0
            old = current.get(args.name)
            if old is None:
                print(f"cachectl: no tenant {args.name!r} (see `cachectl tenant ls`)", file=sys.stderr)
                return EXIT_MISSING
            if args.tenant_command == "token":
                token = secrets.token_urlsafe(32)
                tenant = TenantEntry(
                    old.name, old.prefixes, old.l1_bytes, old.l2_bytes, old.priority, token_sha256(token)
                )
                version = client.put_tenant(tenant, replace=True)
                print(f"tenant {old.name!r}: new token (table version {version}); the old one is refused from now on:")
                print(token)
                return 0
            tenant = TenantEntry(
                old.name,
                tuple(args.prefix) if args.prefix else old.prefixes,
                args.l1 if args.l1 is not None else old.l1_bytes,
                args.l2 if args.l2 is not None else old.l2_bytes,
                args.priority or old.priority,
            )
            version = client.put_tenant(tenant, replace=True)
        except CommandRefusedError as exc:
            return _refused(exc)
    print(f"tenant {tenant.name!r} set (table version {version})")
    return 0


def add_parsers(commands: Any, meta_options: Any) -> None:
    """Adds `namespace` and `tenant` to cachectl's `commands`; `meta_options(parser)` adds --meta."""
    namespace = commands.add_parser(
        "namespace",
        help="the shard's namespace table: prefix, write mode, lease, TTL, replicas (add|set|rm|ls)",
        description="Edit and show the namespace table the metadata shard keeps; every cache node and routing "
        "client follows it within a heartbeat (a node's config file [[namespaces]] count only while the shard "
        "has no table).",
    )
    sub = namespace.add_subparsers(dest="namespace_command", required=True)
    for name, help_text in (("add", "add a namespace"), ("set", "change a namespace (unset fields keep their value)")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("prefix", help="the key prefix")
        p.add_argument("--write-mode", choices=WRITE_MODES, default=None, help="default write-through")
        p.add_argument("--lease", type=float, default=None, metavar="SECONDS", help="default lease of its puts")
        p.add_argument("--ttl", type=float, default=None, metavar="SECONDS", help="default TTL of its puts")
        p.add_argument("--replicas", type=int, default=None, help="nodes that hold each key (default 1)")
        meta_options(p)
    rm = sub.add_parser("rm", help="remove a namespace (its keys become write-through, one replica)")
    rm.add_argument("prefix")
    meta_options(rm)
    ls = sub.add_parser("ls", help="list the namespaces")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    meta_options(ls)
    namespace.set_defaults(func=cmd_namespace)

    tenant = commands.add_parser(
        "tenant",
        help="tenants: their namespaces, tokens, byte quotas and priority (add|set|rm|ls|token)",
        description="A tenant owns namespaces (prefixes); its token reads and writes keys under them only. "
        "`add` and `token --rotate` print the token as the last line of stdout (the shard keeps its hash). "
        "Tenants need an admin token on the cluster (CACHESVC_SECURITY_ADMIN_TOKEN).",
    )
    sub = tenant.add_subparsers(dest="tenant_command", required=True)
    for name, help_text in (("add", "add a tenant and print its token"), ("set", "change a tenant")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("name")
        p.add_argument(
            "--prefix", action="append", default=[], required=name == "add", help="a namespace it owns (repeat)"
        )
        share = "each node: its share of the placement"
        p.add_argument("--l1", type=_size, default=None, metavar="BYTES", help=f"L1 bytes in the cluster; {share}")
        p.add_argument("--l2", type=_size, default=None, metavar="BYTES", help=f"L2 bytes in the cluster; {share}")
        p.add_argument("--priority", choices=PRIORITIES, default=None, help="default normal")
        meta_options(p)
    rm = sub.add_parser("rm", help="remove a tenant; its token is refused")
    rm.add_argument("name")
    meta_options(rm)
    ls = sub.add_parser("ls", help="list the tenants: quotas, priority, and each one's use (bytes of all nodes)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    meta_options(ls)
    token = sub.add_parser("token", help="make a new token for a tenant (the old one is refused)")
    token.add_argument("name")
    token.add_argument("--rotate", action="store_true", required=True, help="replace the token")
    meta_options(token)
    tenant.set_defaults(func=cmd_tenant)
