"""`cachesvc meta`: run one node of the metadata shard.

`add_meta_command(subparsers)` adds the subcommand to the `cachesvc` parser::

    cachesvc meta --id 1 --listen 127.0.0.1:7081 \\
        --peers 1=127.0.0.1:7081,2=127.0.0.1:7082,3=127.0.0.1:7083 --data-dir /var/lib/cachesvc/meta1

Every node of a shard gets the same `--peers` list (itself included). The
Raft log, vote and snapshots live under `--data-dir`; restarting a node with
the same directory recovers it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_meta_command", "parse_peers"]


def parse_peers(text: str) -> dict[int, str]:
    """`1=host:port,2=host:port` -> {1: "host:port", 2: "host:port"}.

    Raises:
        ValueError: malformed list, a non-positive or repeated id.
    """
    peers: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        ident, sep, address = item.partition("=")
        if not sep or not address or ":" not in address:
            raise ValueError(f"bad peer {item!r}: expected ID=HOST:PORT")
        node_id = int(ident)
        if node_id <= 0 or node_id in peers:
            raise ValueError(f"bad peer {item!r}: ids must be positive and distinct")
        peers[node_id] = address
    if not peers:
        raise ValueError("no peers given")
    return peers


def _run(args: argparse.Namespace) -> int:
    from cachesvc.meta.node import NodeConfig
    from cachesvc.meta.service import serve

    try:
        peers = parse_peers(args.peers)
        if args.id not in peers:
            peers[args.id] = args.listen
        cfg = NodeConfig(
            id=args.id,
            peers=peers,
            data_dir=Path(args.data_dir),
            tick_ms=args.tick_ms,
            election_tick=args.election_ticks,
            heartbeat_tick=args.heartbeat_ticks,
            snapshot_every=args.snapshot_every,
            batching=not args.no_batching,
            lease_ms=int(args.lease_seconds * 1000),
        )
        cfg.validate()
    except ValueError as exc:
        print(f"cachesvc meta: {exc}", file=sys.stderr)
        return 2
    try:
        serve(cfg, args.listen)
    except OSError as exc:
        print(f"cachesvc meta: {exc}", file=sys.stderr)
        return 1
    return 0


def add_meta_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add `meta` to the subcommands of `cachesvc`; returns its parser."""
    meta = subparsers.add_parser("meta", help="run a metadata-shard (Raft) node")
    meta.add_argument("--id", type=int, required=True, help="this node's id (positive, unique in the shard)")
    meta.add_argument("--listen", required=True, help="HOST:PORT for clients and peers")
    meta.add_argument("--peers", required=True, help="every member as ID=HOST:PORT,... (this node included)")
    meta.add_argument("--data-dir", required=True, help="directory of the Raft log and snapshots")
    meta.add_argument("--tick-ms", type=int, default=10, help="Raft tick, ms (default 10)")
    meta.add_argument("--election-ticks", type=int, default=20, help="election timeout in ticks (default 20)")
    meta.add_argument("--heartbeat-ticks", type=int, default=3, help="leader heartbeat interval in ticks (default 3)")
    meta.add_argument("--snapshot-every", type=int, default=10_000, help="compact the log every N entries")
    meta.add_argument("--lease-seconds", type=float, default=10.0, help="lease a cache-node heartbeat buys")
    meta.add_argument(
        "--no-batching", action="store_true", help="one log entry and fsync per client request (for benchmarks)"
    )
    meta.set_defaults(func=_run)
    return meta
