"""`cachectl`: the admin command of a cache cluster.

Talks to one cache server (`--cache HOST:PORT`, or `CACHECTL_CACHE`, default
127.0.0.1:7070); `CACHECTL_TOKEN` supplies a bearer token. Exit codes: 0 ok,
1 the key is not there (get, rm), 2 bad usage or input, 3 the server or
object storage is unreachable, 4 any other server error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from cacheclient import (
    CacheClient,
    CacheClientError,
    InvalidRequestError,
    LimitExceededError,
    UnavailableError,
)
from cachesvc.units import human_bytes

__all__ = ["main"]

EXIT_MISSING, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_ERROR = 1, 2, 3, 4


def _client(args: argparse.Namespace) -> CacheClient:
    return CacheClient(args.cache, timeout=args.timeout, token=os.environ.get("CACHECTL_TOKEN") or None)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachectl", description="Administer a cachesvc cluster.")
    parser.add_argument("--cache", default=os.environ.get("CACHECTL_CACHE", "127.0.0.1:7070"), help="cache server")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each call, seconds")
    parser.add_argument("--meta", default=None, help="metadata nodes ADDR[,ADDR...] (leader, nodes)")
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

    from cachesvc.meta.ctl import add_meta_ctl_commands
    from cachesvc.warm import add_warm_command

    add_warm_command(commands)
    add_meta_ctl_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
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
