"""`cachectl leader` and `cachectl nodes`: the metadata shard from the admin command.

`add_meta_ctl_commands(subparsers)` adds both subcommands to `cachectl`.
They take `--meta ADDR[,ADDR...]` (any nodes of the shard; also accepted
before the subcommand when `cachectl` defines it, else `CACHECTL_META`,
default 127.0.0.1:7080).

Exit codes: 0 ok, 3 no leader or no node reachable, 4 any other error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from cacheclient import CacheClientError, UnavailableError
from cacheclient.meta import MetaClient
from cachesvc.units import human_bytes

__all__ = ["add_meta_ctl_commands", "main"]

DEFAULT_META = "127.0.0.1:7080"
EXIT_UNAVAILABLE, EXIT_ERROR = 3, 4


def _client(args: argparse.Namespace) -> MetaClient:
    addresses = getattr(args, "meta", None) or os.environ.get("CACHECTL_META") or DEFAULT_META
    return MetaClient(addresses, timeout=args.wait, attempt_timeout=min(1.0, args.wait))


def cmd_leader(args: argparse.Namespace) -> int:
    with _client(args) as client:
        found = client.leader(timeout=args.wait)
    if found is None:
        if args.json:
            print(json.dumps({"id": None, "address": None}))
        print("cachectl: the metadata shard has no leader (or no node answered)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    node_id, address = found
    if args.json:
        print(json.dumps({"id": node_id, "address": address}))
    else:
        print(f"{node_id} {address}")
    return 0


def _shard_members(client: MetaClient) -> list[dict[str, Any]]:
    members: list[dict[str, Any]] = []
    for address in client.addresses:
        try:
            status = client.status(address, timeout=1.0)
        except CacheClientError:
            members.append({"address": address, "role": "unreachable"})
            continue
        status["address"] = address
        members.append(status)
    return members


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            nodes = client.nodes(stale=args.stale)
        except UnavailableError as exc:
            print(f"cachectl: unavailable: {exc}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        except CacheClientError as exc:
            print(f"cachectl: {exc}", file=sys.stderr)
            return EXIT_ERROR
        members = _shard_members(client) if args.shard else []
    if args.json:
        doc: dict[str, Any] = {"cache_nodes": [_node_dict(n) for n in nodes]}
        if args.shard:
            doc["meta_nodes"] = [{k: v for k, v in m.items() if k != "members"} for m in members]
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    now_ms = time.time() * 1000
    print(f"{'address':<24} {'state':<9} {'capacity':>11} {'used':>11} {'lease':>8}")
    for n in nodes:
        lease = f"{(n.lease_expiry_ms - now_ms) / 1000:.1f}s" if n.lease_expiry_ms else "-"
        capacity, used = human_bytes(n.capacity_bytes), human_bytes(n.used_bytes)
        print(f"{n.address:<24} {n.state:<9} {capacity:>11} {used:>11} {lease:>8}")
    if args.shard:
        print()
        print(f"{'meta node':<24} {'id':>3} {'role':<11} {'term':>6} {'commit':>9} {'applied':>9}")
        for m in members:
            print(
                f"{m['address']:<24} {m.get('id', '-'):>3} {m['role']:<11} {m.get('term', '-'):>6} "
                f"{m.get('commit', '-'):>9} {m.get('applied', '-'):>9}"
            )
    return 0


def _node_dict(n: Any) -> dict[str, Any]:
    return {
        "address": n.address,
        "state": n.state,
        "capacity_bytes": n.capacity_bytes,
        "used_bytes": n.used_bytes,
        "lease_expiry_ms": n.lease_expiry_ms,
    }


def _add_common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a --meta given before the subcommand (a cachectl-wide option) is not overwritten.
    parser.add_argument(
        "--meta",
        default=argparse.SUPPRESS,
        help=f"metadata nodes ADDR[,ADDR...] (default $CACHECTL_META or {DEFAULT_META})",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds to look for a leader (default 5)")


def add_meta_ctl_commands(subparsers: Any) -> None:
    """Add `leader` and `nodes` to the subcommands of `cachectl`."""
    leader = subparsers.add_parser("leader", help="print the metadata shard's leader: id and address")
    _add_common(leader)
    leader.set_defaults(func=cmd_leader)

    nodes = subparsers.add_parser("nodes", help="list cache nodes (and, with --shard, the metadata nodes)")
    _add_common(nodes)
    nodes.add_argument("--shard", action="store_true", help="also show each metadata node's role and indexes")
    nodes.add_argument("--stale", action="store_true", help="read without a consensus round")
    nodes.set_defaults(func=cmd_nodes)


def main(argv: list[str] | None = None) -> int:
    """`python -m cachesvc.meta.ctl [--meta ADDRS] leader|nodes ...`, for use before `cachectl` wires these in."""
    parser = argparse.ArgumentParser(prog="cachectl")
    parser.add_argument("--meta", default=None, help="metadata nodes ADDR[,ADDR...]")
    add_meta_ctl_commands(parser.add_subparsers(dest="command", required=True))
    args: Any = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
