"""`cachectl`: the admin command of a cache cluster.

`get`, `put`, `rm`, `stats`, `warm` and `checkpoints` talk to one cache server (`--cache
HOST:PORT`, or `CACHECTL_CACHE`), or, given only the metadata shard (`--meta`
before the subcommand, or `CACHECTL_META`), to the whole cluster, each key
routed to its owner; with neither, to 127.0.0.1:7070. `CACHECTL_TOKEN`
supplies a bearer token. `leader`, `nodes` and `drain` ask the metadata shard
(`--meta ADDR[,ADDR...]`, any of its nodes, before or after the subcommand;
or `CACHECTL_META`, default 127.0.0.1:7080). Exit codes: 0 ok, 1 the key is
not there (get, rm), 2 bad usage or input, 3 the server, the shard's leader
or object storage is unreachable, 4 any other server error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cacheclient import (
    CacheClient,
    CacheClientError,
    InvalidRequestError,
    LimitExceededError,
    UnavailableError,
)
from cacheclient.meta import CommandRefusedError, MetaClient, PlacementMap
from cachesvc.commands import checkpoints
from cachesvc.units import human_bytes

__all__ = ["build_parser", "main"]

EXIT_MISSING, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_ERROR = 1, 2, 3, 4
DEFAULT_META = "127.0.0.1:7080"
DEFAULT_CACHE = "127.0.0.1:7070"


def client_of(args: argparse.Namespace) -> CacheClient:
    """The client the data commands use: `--cache` (one server), else `--meta` (the cluster), else the default."""
    token = os.environ.get("CACHECTL_TOKEN") or None
    cache = args.cache or os.environ.get("CACHECTL_CACHE")
    meta = getattr(args, "meta", None) or os.environ.get("CACHECTL_META")
    if cache is None and meta:
        return CacheClient(meta=meta, timeout=args.timeout, token=token)
    return CacheClient(cache or DEFAULT_CACHE, timeout=args.timeout, token=token)


_client = client_of


def _key(text: str) -> bytes:
    if text.startswith("hex:"):
        try:
            return bytes.fromhex(text[4:])
        except ValueError:
            raise InvalidRequestError(f"not a hex key: {text!r}") from None
    return text.encode("utf-8")


def cmd_get(args: argparse.Namespace) -> int:
    value = _client(args).get(_key(args.key))
    if value is None:
        print(f"cachectl: key {args.key!r} not found", file=sys.stderr)
        return EXIT_MISSING
    if args.output and args.output != "-":
        Path(args.output).write_bytes(value)
    else:
        sys.stdout.buffer.write(value)
        sys.stdout.flush()
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    if args.value is not None:
        value = args.value.encode("utf-8")
    elif args.file == "-" or args.file is None:
        value = sys.stdin.buffer.read()
    else:
        try:
            value = Path(args.file).read_bytes()
        except OSError as exc:
            print(f"cachectl: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
    _client(args).put(_key(args.key), value)
    print(f"stored {len(value)} bytes under {args.key!r}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    existed = _client(args).delete(_key(args.key))
    if not existed:
        print(f"cachectl: key {args.key!r} not found", file=sys.stderr)
        return EXIT_MISSING
    print(f"removed {args.key!r}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _client(args).stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(f"{'tier':<5} {'policy':<7} {'entries':>9} {'used':>11} {'capacity':>11} {'hits':>10} {'evictions':>10}")
    for tier in stats["tiers"]:
        capacity = human_bytes(tier["capacity_bytes"]) if tier["capacity_bytes"] else "-"
        print(
            f"{tier['name']:<5} {tier['policy'] or '-':<7} {tier['entries']:>9} {human_bytes(tier['used_bytes']):>11} "
            f"{capacity:>11} {tier['hits']:>10} {tier['evictions']:>10}"
        )
    for name, value in sorted(stats["counters"].items()):
        print(f"{name:<22} {value}")
    return 0


def _meta_client(args: argparse.Namespace) -> MetaClient:
    addresses = getattr(args, "meta", None) or os.environ.get("CACHECTL_META") or DEFAULT_META
    return MetaClient(addresses, timeout=args.wait, attempt_timeout=min(1.0, args.wait))


def cmd_leader(args: argparse.Namespace) -> int:
    with _meta_client(args) as client:
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
    with _meta_client(args) as client:
        try:
            nodes = client.nodes(stale=args.stale)
        except UnavailableError as exc:
            print(f"cachectl: unavailable: {exc}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        except CacheClientError as exc:
            print(f"cachectl: {exc}", file=sys.stderr)
            return EXIT_ERROR
        members = _shard_members(client) if args.shard else []
        shares = _slot_shares(client.placement(refresh=True))
    if args.json:
        doc: dict[str, Any] = {
            "cache_nodes": [{**_node_dict(n), "slot_share": shares.get(n.address, 0.0)} for n in nodes]
        }
        if args.shard:
            doc["meta_nodes"] = [{k: v for k, v in m.items() if k != "members"} for m in members]
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    now_ms = time.time() * 1000
    print(f"{'address':<24} {'state':<9} {'capacity':>11} {'used':>11} {'lease':>8} {'slots':>7}")
    for n in nodes:
        lease = f"{(n.lease_expiry_ms - now_ms) / 1000:.1f}s" if n.lease_expiry_ms else "-"
        capacity, used = human_bytes(n.capacity_bytes), human_bytes(n.used_bytes)
        share = f"{shares.get(n.address, 0.0) * 100:.1f}%"
        print(f"{n.address:<24} {n.state:<9} {capacity:>11} {used:>11} {lease:>8} {share:>7}")
    if args.shard:
        print()
        print(f"{'meta node':<24} {'id':>3} {'role':<11} {'term':>6} {'commit':>9} {'applied':>9}")
        for m in members:
            print(
                f"{m['address']:<24} {m.get('id', '-'):>3} {m['role']:<11} {m.get('term', '-'):>6} "
                f"{m.get('commit', '-'):>9} {m.get('applied', '-'):>9}"
            )
    return 0


def _slot_shares(placement: PlacementMap) -> dict[str, float]:
    """Each node's share of the placement's slots (0..1)."""
    counts = Counter(placement.slots)
    return {address: counts[i] / max(1, len(placement.slots)) for i, address in enumerate(placement.nodes)}


def cmd_drain(args: argparse.Namespace) -> int:
    """Takes a cache node out of the placement ("draining"), or puts it back (`--cancel`)."""
    with _meta_client(args) as client:
        try:
            client.set_node_state(args.node, "up" if args.cancel else "draining")
            if args.cancel:
                print(f"{args.node}: up (takes placements again)")
                return 0
            deadline = time.monotonic() + args.wait
            while args.node in client.placement(refresh=True).nodes:
                if time.monotonic() > deadline:
                    print(f"cachectl: {args.node} still owns slots after {args.wait:g}s", file=sys.stderr)
                    return EXIT_ERROR
                time.sleep(0.1)
        except CommandRefusedError as exc:
            print(f"cachectl: {exc}", file=sys.stderr)
            return EXIT_USAGE
    print(f"{args.node}: draining; it owns no slots now (its keys are read from their new owners)")
    return 0


def _node_dict(n: Any) -> dict[str, Any]:
    return {
        "address": n.address,
        "state": n.state,
        "capacity_bytes": n.capacity_bytes,
        "used_bytes": n.used_bytes,
        "lease_expiry_ms": n.lease_expiry_ms,
    }


def _add_meta_options(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a --meta given before the subcommand is not overwritten.
    parser.add_argument(
        "--meta",
        default=argparse.SUPPRESS,
        help=f"metadata nodes ADDR[,ADDR...] (default $CACHECTL_META or {DEFAULT_META})",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds to look for a leader (default 5)")


def build_parser() -> argparse.ArgumentParser:
    """The `cachectl` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="cachectl", description="Administer a cachesvc cluster.")
    parser.add_argument(
        "--cache", default=None, help=f"one cache server (default $CACHECTL_CACHE, else --meta, else {DEFAULT_CACHE})"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each call, seconds")
    parser.add_argument(
        "--meta", default=None, help="metadata nodes ADDR[,ADDR...]: leader, nodes, drain; the cluster without --cache"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    key_help = "the key (UTF-8), or hex:... for binary keys"

    get = commands.add_parser("get", help="print a value (or write it to -o FILE)")
    get.add_argument("key", help=key_help)
    get.add_argument("-o", "--output", help="file to write the value to")
    get.set_defaults(func=cmd_get)

    put = commands.add_parser("put", help="store a value from --value, a file, or stdin")
    put.add_argument("key", help=key_help)
    put.add_argument("file", nargs="?", help="file with the value; - or absent: stdin")
    put.add_argument("--value", help="the value as a string")
    put.set_defaults(func=cmd_put)

    rm = commands.add_parser("rm", help="delete a key from every tier")
    rm.add_argument("key", help=key_help)
    rm.set_defaults(func=cmd_rm)

    stats = commands.add_parser("stats", help="tier usage and counters")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=cmd_stats)

    warm = commands.add_parser(
        "warm",
        help="load every object under s3://bucket/prefix into the cache (resumable)",
        description=(
            "Load every object under an S3 prefix into the cache, with a progress bar. The bucket must be the "
            "one the cache server is configured with; the prefix is relative to its S3 prefix. Objects already "
            "cached are skipped, so running it again resumes an interrupted warm."
        ),
    )
    warm.add_argument("uri", help="s3://bucket/prefix")
    warm.add_argument(
        "--window", default=None, help="most bytes loaded at once by this warm (default: everything); e.g. 8GiB"
    )
    warm.add_argument("--no-progress", action="store_true", help="no progress bar (one summary line)")
    warm.set_defaults(func=_warm)

    leader = commands.add_parser("leader", help="print the metadata shard's leader: id and address")
    _add_meta_options(leader)
    leader.set_defaults(func=cmd_leader)

    nodes = commands.add_parser("nodes", help="list cache nodes (and, with --shard, the metadata nodes)")
    _add_meta_options(nodes)
    nodes.add_argument("--shard", action="store_true", help="also show each metadata node's role and indexes")
    nodes.add_argument("--stale", action="store_true", help="read without a consensus round")
    nodes.set_defaults(func=cmd_nodes)

    drain = commands.add_parser(
        "drain",
        help="take a cache node out of the placement (its keys move to their next owners)",
        description=(
            "Set a cache node to draining: it leaves the placement map, its keys are read from and written to "
            "their next owners (which fill them from object storage), and it serves reads of what it still "
            "holds to clients that have not yet seen the new map. --cancel puts it back."
        ),
    )
    drain.add_argument("node", help="the cache node's address, as `cachectl nodes` shows it")
    drain.add_argument("--cancel", action="store_true", help="take placements again")
    _add_meta_options(drain)
    drain.set_defaults(func=cmd_drain)

    checkpoints.add_parser(commands, _client)
    return parser


def _warm(args: argparse.Namespace) -> int:
    from cachesvc.commands.warm import cmd_warm

    return cmd_warm(args)


def main(argv: list[str] | None = None) -> int:
    """Runs `cachectl ARGS`; returns the exit status."""
    args: Any = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except (InvalidRequestError, LimitExceededError) as exc:
        print(f"cachectl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnavailableError as exc:
        print(f"cachectl: unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except CacheClientError as exc:
        print(f"cachectl: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
