"""`cachectl`: the admin command of a cache cluster.

Data commands (`get`, `put`, `rm`, `ls`, `evict`, `stats`, `warm`,
`checkpoints`) talk to one cache server (`--cache HOST:PORT`, or
`CACHECTL_CACHE`), or, given the metadata shard instead (`--meta` before the
subcommand, or `CACHECTL_META`), to the whole cluster, each key routed to its
owner; with neither, to 127.0.0.1:7070 (flags before variables: `target`). `leader`, `nodes` and `drain` ask the
metadata shard (`--meta ADDR[,ADDR...]`, any of its nodes, before or after
the subcommand; or `CACHECTL_META`, default 127.0.0.1:7080), and so do `namespace` and `tenant`
(the shard's namespace table and tenants: `tenancy`). `status` and
`top` show the whole cluster when there is a shard, else the one server.
`CACHECTL_TOKEN` supplies a bearer token, and `CACHECTL_ADMIN_TOKEN` the
token of the admin scope for the commands that need it (`ADMIN_COMMANDS`;
they fall back to `CACHECTL_TOKEN`); `--tls-ca PATH` (or `CACHECTL_TLS_CA`)
the CA that signed TLS cache servers' and metadata nodes' certificates.
Every command that prints data takes `--json`.

A failure is one line on stderr, never a traceback, and the exit status says
what kind (`EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

# gRPC's C core reads this when it loads (the import below): without it, a failed TLS handshake is
# also logged at INFO on stderr, a second line beside cachectl's own one-line error.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from cacheclient import (
    AuthError,
    CacheClientError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    UnavailableError,
)
from cacheclient.meta import CommandRefusedError
from cachesvc.commands import checkpoints, tenancy, views
from cachesvc.commands.common import (
    ADMIN_COMMANDS,
    DEFAULT_CACHE,
    DEFAULT_META,
    EXIT_AUTH,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_MISSING,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    UsageError,
    client_of,
    meta_client,
    one_line,
    shard_members,
    slot_shares,
)
from cachesvc.commands.warm import cmd_warm
from cachesvc.units import human_bytes

__all__ = ["EXIT_CODES", "build_parser", "main"]


def _key(text: str) -> bytes:
    if text.startswith("hex:"):
        try:
            return bytes.fromhex(text[4:])
        except ValueError:
            raise InvalidRequestError(f"not a hex key: {text!r}") from None
    return text.encode("utf-8")


def cmd_get(args: argparse.Namespace) -> int:
    value = client_of(args).get(_key(args.key))
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
    client_of(args).put(_key(args.key), value)
    print(f"stored {len(value)} bytes under {args.key!r}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    existed = client_of(args).delete(_key(args.key))
    if not existed:
        print(f"cachectl: key {args.key!r} not found", file=sys.stderr)
        return EXIT_MISSING
    print(f"removed {args.key!r}")
    return 0


def _show_key(key: bytes) -> str:
    """A key as the commands accept it back: UTF-8 text, or hex:... when it is not printable text."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + key.hex()
    return text if text.isprintable() and not text.startswith("hex:") else "hex:" + key.hex()


def cmd_stats(args: argparse.Namespace) -> int:
    client = client_of(args)
    stats = client.stats()
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
    l2 = next((t for t in stats["tiers"] if t["name"] == "l2"), None)
    if l2 is not None and "nodes" not in stats:
        map_size = client.info().get("l2_map_size", 0)
        if map_size > l2["capacity_bytes"]:
            print(
                f"l2 capacity is {human_bytes(l2['capacity_bytes'])} of l2.bytes = {human_bytes(map_size)}: "
                "LMDB keeps the rest for its B-tree, free pages and holes, so the file never outgrows l2.bytes"
            )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """`ls PREFIX`: the keys object storage (or, `--cached`, the cache) holds under PREFIX, a page at a time."""
    if args.limit <= 0:
        raise UsageError("--limit must be positive")
    client = client_of(args)
    listing = client.list(
        _key(args.prefix) if args.prefix else b"",
        start_after=_key(args.start_after) if args.start_after else b"",
        page_size=min(args.limit + 1, 10_000),
        cached=args.cached,
    )
    page = list(islice(listing, args.limit + 1))
    more = len(page) > args.limit
    page = page[: args.limit]
    where = client.locate_many([key for key, _ in page], cached_only=True) if page else []
    rows: list[dict[str, Any]] = [
        {"key": _show_key(key), "size": size, "tier": location.tier if location else None}
        for (key, size), location in zip(page, where, strict=True)
    ]
    next_key = rows[-1]["key"] if more else None
    if args.json:
        print(json.dumps({"entries": rows, "next_start_after": next_key}, indent=2))
        return 0
    for row in rows:
        print(f"{human_bytes(row['size']):>10}  {row['tier'] or '-':<3}  {row['key']}")
    if next_key is not None:
        print(f"cachectl: more keys follow; the next page: --start-after {next_key}", file=sys.stderr)
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    """`evict KEY` or `evict --prefix PREFIX`: drop keys from the cache tiers; object storage keeps them."""
    if (args.key is None) == (args.prefix is None):
        raise UsageError("evict: give a KEY or --prefix PREFIX (one of them)")
    client = client_of(args)
    if args.key is not None:
        existed = client.evict(_key(args.key))
        if args.json:
            print(json.dumps({"evicted": [args.key] if existed else []}))
        if not existed:
            print(f"cachectl: key {args.key!r} is not cached", file=sys.stderr)
            return EXIT_MISSING
        if not args.json:
            print(f"evicted {args.key!r} (object storage keeps it)")
        return 0
    scanned = 0
    evicted: list[str] = []
    listing = client.list(_key(args.prefix))
    with ThreadPoolExecutor(8) as pool:
        while batch := [key for key, _ in islice(listing, 1000)]:
            scanned += len(batch)
            cached = [key for key, hit in zip(batch, client.contains_many(batch, cached_only=True), strict=True) if hit]
            for key, existed in zip(cached, pool.map(client.evict, cached), strict=True):
                if existed:
                    evicted.append(_show_key(key))
    if args.json:
        print(json.dumps({"evicted": evicted, "scanned": scanned}))
    else:
        print(f"evicted {len(evicted)} of {scanned} keys under {args.prefix!r} (object storage keeps them)")
    return 0


def cmd_leader(args: argparse.Namespace) -> int:
    with meta_client(args) as client:
        found = client.leader(timeout=args.wait)
        members = shard_members(client) if found is None else []
    if found is None:
        if args.json:
            print(json.dumps({"id": None, "address": None}))
        answering = [m for m in members if m["role"] != "unreachable"]
        if not answering:
            print(f"cachectl: no metadata node answered at {','.join(client.addresses)}", file=sys.stderr)
        else:
            print(
                f"cachectl: the metadata shard has no leader ({len(answering)} of {len(members)} nodes answer; "
                f"none leads after {args.wait:g}s)",
                file=sys.stderr,
            )
        return EXIT_UNAVAILABLE
    node_id, address = found
    if args.json:
        print(json.dumps({"id": node_id, "address": address}))
    else:
        print(f"{node_id} {address}")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with meta_client(args) as client:
        nodes = client.nodes(stale=args.stale)
        members = shard_members(client) if args.shard else []
        shares = slot_shares(client.placement(refresh=True))
    if args.json:
        doc: dict[str, Any] = {
            "cache_nodes": [{**_node_dict(n), "slot_share": shares.get(n.address, 0.0)} for n in nodes]
        }
        if args.shard:
            doc["meta_nodes"] = [{k: v for k, v in m.items() if k != "members"} for m in members]
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    now_ms = time.time() * 1000
    print(f"{'machine':<16} {'address':<24} {'state':<9} {'capacity':>11} {'used':>11} {'lease':>8} {'slots':>7}")
    for n in sorted(nodes, key=_by_machine):
        lease = f"{(n.lease_expiry_ms - now_ms) / 1000:.1f}s" if n.lease_expiry_ms else "-"
        capacity, used = human_bytes(n.capacity_bytes), human_bytes(n.used_bytes)
        share = f"{shares.get(n.address, 0.0) * 100:.1f}%"
        print(f"{_machine(n.address):<16} {n.address:<24} {n.state:<9} {capacity:>11} {used:>11} {lease:>8} {share:>7}")
    if args.shard:
        print()
        print(f"{'meta node':<24} {'id':>3} {'role':<11} {'term':>6} {'commit':>9} {'applied':>9}")
        for m in members:
            print(
                f"{m['address']:<24} {m.get('id', '-'):>3} {m['role']:<11} {m.get('term', '-'):>6} "
                f"{m.get('commit', '-'):>9} {m.get('applied', '-'):>9}"
            )
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Takes a cache node out of the placement ("draining"), or puts it back (`--cancel`)."""
    with meta_client(args) as client:
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
            return EXIT_MISSING if "unknown node" in str(exc) else EXIT_USAGE
    print(f"{args.node}: draining; it owns no slots now (its keys are read from their new owners)")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """Removes a down cache node from the shard, accepting the loss of write-back values only it held."""
    with meta_client(args) as client:
        states = {n.address: n for n in client.nodes()}
        node = states.get(args.node)
        if node is None:
            print(f"cachectl: no cache node {args.node} (see `cachectl nodes`)", file=sys.stderr)
            return EXIT_MISSING
        if node.state != "down":
            print(
                f"cachectl: {args.node} is {node.state}, not down: only a node that is gone can be forgotten "
                "(`cachectl drain` it, or stop it, first)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        try:
            client.remove_node(args.node)
        except CommandRefusedError as exc:
            print(f"cachectl: {exc}", file=sys.stderr)
            return EXIT_MISSING
    lost = " (it may have held write-back values object storage lacks: those are lost)" if node.holding else ""
    print(f"{args.node}: forgotten{lost}; its keys are served from object storage by their new owners")
    return 0


def _machine(address: str) -> str:
    """The host of a node's address: the engine processes of one `serve --processes N` share it."""
    return address.rpartition(":")[0]


def _by_machine(n: Any) -> tuple[str, int]:
    host, _, port = n.address.rpartition(":")
    return host, int(port) if port.isdigit() else 0


def _node_dict(n: Any) -> dict[str, Any]:
    return {
        "machine": _machine(n.address),
        "address": n.address,
        "state": n.state,
        "capacity_bytes": n.capacity_bytes,
        "used_bytes": n.used_bytes,
        "lease_expiry_ms": n.lease_expiry_ms,
        "holding": n.holding,
    }


def _add_meta_address(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a --meta given before the subcommand is not overwritten.
    parser.add_argument(
        "--meta",
        default=argparse.SUPPRESS,
        help=f"metadata nodes ADDR[,ADDR...] (default $CACHECTL_META or {DEFAULT_META})",
    )
    parser.add_argument("--wait", type=float, default=5.0, help="seconds to look for a leader (default 5)")


def _add_meta_options(parser: argparse.ArgumentParser) -> None:
    _add_meta_address(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _epilog() -> str:
    codes = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    return (
        "addresses:\n"
        f"  --cache HOST:PORT    one cache server (default $CACHECTL_CACHE, else {DEFAULT_CACHE}; with only\n"
        "                       --meta, data commands route each key to its owner in the cluster)\n"
        f"  --meta HOST:PORT,..  the metadata shard (default $CACHECTL_META, else {DEFAULT_META})\n"
        "  CACHECTL_TOKEN       the bearer token, when the servers require one\n"
        f"  CACHECTL_ADMIN_TOKEN the admin token, for {', '.join(sorted(ADMIN_COMMANDS))} (default CACHECTL_TOKEN)\n"
        "  --tls-ca PATH        the CA (PEM) of TLS servers and metadata nodes (default $CACHECTL_TLS_CA; without it,\n"
        "                       plaintext, and a TLS server is unreachable: exit 3)\n"
        "\n"
        f"exit status:\n{codes}\n"
    )


def build_parser() -> argparse.ArgumentParser:
    """The `cachectl` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="cachectl",
        description="Administer a cachesvc cluster: look at it (status, top, nodes, stats), read and write\n"
        "keys, load datasets, drain nodes. Every command that prints data takes --json.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--cache", default=None, help=f"one cache server HOST:PORT (default $CACHECTL_CACHE, else {DEFAULT_CACHE})"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each call, seconds (default 30)")
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PATH",
        help="CA certificate (PEM) of TLS cache servers and metadata nodes (default $CACHECTL_TLS_CA; "
        "without it: plaintext)",
    )
    parser.add_argument(
        "--meta",
        default=None,
        help=f"metadata nodes HOST:PORT,... (default $CACHECTL_META, else {DEFAULT_META}): leader, nodes, drain, "
        "status, top; the cluster for data commands without --cache",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="the cluster `cachesvc up --state-dir DIR` runs: its metadata shard (as --meta) and, unless "
        "CACHECTL_TOKEN / CACHECTL_ADMIN_TOKEN say otherwise, its tokens (from DIR/cluster.json)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    key_help = "the key (UTF-8), or hex:... for binary keys"

    status = commands.add_parser(
        "status",
        help="the cluster at a glance: leader, nodes and states, tiers, hit ratio, S3, write-back backlog",
        description="The shard's leader and members, each cache node's state, tiers' used and budget bytes, "
        "hit ratio, write-back backlog, and whether each node reaches object storage. Exit 3 when a node, the "
        "leader or object storage does not answer (the problems are listed on stderr).",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=views.cmd_status)

    top = commands.add_parser(
        "top",
        help="per-node request rates, latency, hit ratio and bytes served, refreshed",
        description="Samples every cache node's counters each --interval and shows the rates over it: "
        "requests/s and their mean latency (data calls, as the server timed them), errors/s, gets/s and the "
        "share the cache tiers answered, bytes served/s, S3 fills/s, tier use and write-back backlog. Ctrl-C stops.",
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    top.add_argument("--once", action="store_true", help="one sample interval, one view, then exit")
    top.add_argument("--iterations", type=int, default=0, help="stop after N views (default: until Ctrl-C)")
    top.add_argument("--json", action="store_true", help="one JSON object per view, one per line")
    top.add_argument(
        "--by",
        choices=("node", "tenant"),
        default="node",
        help="rows per cache node (default), or per tenant: hits, misses, evictions, bytes per tier",
    )
    top.set_defaults(func=views.cmd_top)

    get = commands.add_parser("get", help="print a value (or write it to -o FILE)")
    get.add_argument("key", help=key_help)
    get.add_argument("-o", "--output", help="file to write the value to")
    get.set_defaults(func=cmd_get)

    put = commands.add_parser("put", help="store a value from --value, a file, or stdin")
    put.add_argument("key", help=key_help)
    put.add_argument("file", nargs="?", help="file with the value; - or absent: stdin")
    put.add_argument("--value", help="the value as a string")
    put.set_defaults(func=cmd_put)

    rm = commands.add_parser("rm", help="delete a key from every tier and object storage")
    rm.add_argument("key", help=key_help)
    rm.set_defaults(func=cmd_rm)

    ls = commands.add_parser(
        "ls",
        help="list keys under a prefix: size and the cache tier holding each, a page at a time",
        description="List the keys object storage holds under PREFIX (below the server's bucket and prefix), "
        "in key order, with their size and the cache tier that holds each ('-': not cached). Prints --limit "
        "keys; when more follow, says how to ask for the next page (--start-after). --cached lists the keys "
        "the cache tiers hold instead (with --meta, every node's), as a server without object storage does.",
    )
    ls.add_argument("prefix", nargs="?", default="", help="key prefix (default: every key)")
    ls.add_argument("--limit", type=int, default=1000, help="keys per page (default 1000)")
    ls.add_argument("--start-after", default=None, help="list the keys after this one (the next page)")
    ls.add_argument("--cached", action="store_true", help="the keys the cache tiers hold, not object storage's")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    evict = commands.add_parser(
        "evict",
        help="drop a key (or every key under --prefix) from the cache tiers; object storage keeps it",
        description="Drop keys from the cache tiers (L1, L2); object storage keeps them and the next read "
        "fetches them again. A write-back key is uploaded first. --prefix evicts every cached key that "
        "object storage lists under the prefix. Exit 1 when a KEY was not cached.",
    )
    evict.add_argument("key", nargs="?", help=key_help)
    evict.add_argument("--prefix", default=None, help="evict every cached key under this prefix")
    evict.add_argument("--json", action="store_true", help="machine-readable output")
    evict.set_defaults(func=cmd_evict)

    stats = commands.add_parser("stats", help="tier usage and counters")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
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
    warm.add_argument(
        "--whole-shards",
        action="store_true",
        help="load .tar and .mds files as whole objects, not as the 16 MiB parts CachedShardDataset reads",
    )
    warm.set_defaults(func=cmd_warm)

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

    forget = commands.add_parser(
        "forget",
        help="remove a down cache node from the shard, accepting the loss of what only it held",
        description=(
            "Remove a cache node that is down from the metadata shard. While a node that may hold write-back "
            "values object storage lacks is down, the nodes standing in for it refuse those keys "
            "(FAILED_PRECONDITION) rather than serve object storage's older value; forgetting the node accepts "
            "that loss, and its keys are served from object storage again. A node that comes back later "
            "registers as new."
        ),
    )
    forget.add_argument("node", help="the cache node's address, as `cachectl nodes` shows it")
    _add_meta_options(forget)
    forget.set_defaults(func=cmd_forget)

    checkpoints.add_parser(commands, client_of)
    tenancy.add_parsers(commands, _add_meta_address)
    return parser


def _tls_hint(args: argparse.Namespace, exc: BaseException) -> str:
    """A hint for the failures a TLS mismatch causes: plaintext to a TLS port, or a CA that does not fit."""
    text = str(exc).lower()
    configured = bool(getattr(args, "tls_ca", None) or os.environ.get("CACHECTL_TLS_CA"))
    if not configured and "socket closed" in text:
        return " (a TLS server? pass --tls-ca CA.pem or set CACHECTL_TLS_CA)"
    if configured and ("handshake" in text or "ssl" in text or "certificate" in text):
        return " (TLS: is the server TLS, and did this CA sign its certificate?)"
    return ""


def _use_state_dir(args: Any) -> None:
    """Points `args` at the cluster `cachesvc up` runs in `args.state_dir`, and takes its tokens (see --state-dir)."""
    path = Path(args.state_dir) / "cluster.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--state-dir: cannot read {path} (is `cachesvc up --state-dir {args.state_dir}` running?): {exc}"
        ) from None
    if info.get("meta"):
        if not getattr(args, "meta", None):
            args.meta = ",".join(info["meta"])
    elif not args.cache:
        args.cache = info["cache"][0]
    if info.get("token"):
        os.environ.setdefault("CACHECTL_TOKEN", info["token"])
    if info.get("admin_token"):
        os.environ.setdefault("CACHECTL_ADMIN_TOKEN", info["admin_token"])


def main(argv: list[str] | None = None) -> int:
    """Runs `cachectl ARGS`; returns the exit status (`EXIT_CODES`)."""
    args: Any = build_parser().parse_args(argv)
    try:
        if args.state_dir:
            _use_state_dir(args)
        result: int = args.func(args)
        return result
    except UsageError as exc:
        print(f"cachectl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidRequestError, LimitExceededError) as exc:
        print(f"cachectl: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except AuthError as exc:
        hint = (
            "set CACHECTL_ADMIN_TOKEN to the servers' admin token"
            if exc.code is grpc.StatusCode.PERMISSION_DENIED
            else "set CACHECTL_TOKEN to the servers' token"
        )
        print(f"cachectl: refused: {one_line(exc)} ({hint})", file=sys.stderr)
        return EXIT_AUTH
    except (UnavailableError, DeadlineError) as exc:
        print(f"cachectl: unavailable: {one_line(exc)}{_tls_hint(args, exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except CacheClientError as exc:
        print(f"cachectl: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `cachectl ls | head`: the reader left; nothing more to say.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
