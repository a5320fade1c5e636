"""`cachectl checkpoints ls|show|rm`: the checkpoints a cache holds, their size, state and age.

Reads the catalog that `cacheclient.checkpoint` writes (no torch needed):
with `--meta`, the commit records in the metadata shard; with `--cache`,
the run indexes in the cache.
State is "uploaded" (object storage has every byte), "in cache" (some
chunks await the write-back upload), "damaged" (a chunk is gone) or
"missing".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cacheclient import CacheClient
from cacheclient.checkpoint.catalog import (
    DEFAULT_PREFIX,
    CheckpointError,
    CheckpointKeys,
    apply_retention,
    checkpoint_status,
    delete_checkpoint,
    list_checkpoints,
)
from cachesvc.commands.common import EXIT_MISSING
from cachesvc.units import human_bytes

__all__ = ["add_parser"]


def add_parser(commands: Any, client: Any) -> None:
    """Adds `checkpoints` with its subcommands to cachectl's `commands`; `client(args)` makes the CacheClient."""
    parser = commands.add_parser("checkpoints", help="list, show and delete checkpoints saved through the cache")
    sub = parser.add_subparsers(dest="checkpoints_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"key prefix of checkpoints (default {DEFAULT_PREFIX})")

    ls = sub.add_parser("ls", help="checkpoints with size, state and age (every run, or one)")
    ls.add_argument("run", nargs="?", help="only this run (with --cache, also a run whose index is not uploaded yet)")
    common(ls)
    ls.set_defaults(func=lambda args: cmd_ls(args, client(args)))

    show = sub.add_parser("show", help="one checkpoint: chunks, bytes, where they are")
    show.add_argument("name", help="RUN/STEP")
    common(show)
    show.set_defaults(func=lambda args: cmd_show(args, client(args)))

    rm = sub.add_parser(
        "rm",
        help="delete a checkpoint (or all but the newest N of a run) and the chunks no other references",
    )
    rm.add_argument("name", help="RUN/STEP, or RUN with --keep-last")
    rm.add_argument("--keep-last", type=int, default=None, help="keep the newest N checkpoints of run NAME")
    common(rm)
    rm.set_defaults(func=lambda args: cmd_rm(args, client(args)))


def _age(created: float | None) -> str:
    if not created:
        return "-"
    seconds = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_ls(args: argparse.Namespace, cache: CacheClient) -> int:
    keys = CheckpointKeys(args.prefix)
    rows = []
    for entry in list_checkpoints(cache, args.run, keys=keys):
        status = checkpoint_status(cache, entry.name, keys=keys)
        rows.append(status.as_dict())
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(f"{'checkpoint':<40} {'state':<9} {'size':>10} {'stored':>10} {'uploaded':>9} {'age':>7}")
    for row in rows:
        uploaded = f"{row['chunks_uploaded']}/{row['chunks']}"
        print(
            f"{row['name']:<40} {row['state']:<9} {human_bytes(row['bytes']):>10} "
            f"{human_bytes(row['stored_bytes']):>10} {uploaded:>9} {_age(row['created']):>7}"
        )
    return 0


def cmd_show(args: argparse.Namespace, cache: CacheClient) -> int:
    status = checkpoint_status(cache, args.name, keys=CheckpointKeys(args.prefix))
    if args.json:
        print(json.dumps(status.as_dict(), indent=2, sort_keys=True))
    else:
        row = status.as_dict()
        row["age"] = _age(row["created"])
        for field in ("name", "state", "age", "world_size", "tensors"):
            print(f"{field:<16} {row.get(field, '-')}")
        for field in ("bytes", "stored_bytes"):
            print(f"{field:<16} {human_bytes(row[field])}")
        for field in ("chunks", "chunks_uploaded", "chunks_on_disk", "chunks_missing"):
            print(f"{field:<16} {row[field]}")
    if status.state == "missing":
        print(f"cachectl: no checkpoint {args.name!r}", file=sys.stderr)
        return EXIT_MISSING
    return 0


def cmd_rm(args: argparse.Namespace, cache: CacheClient) -> int:
    keys = CheckpointKeys(args.prefix)
    if args.keep_last is not None:
        try:
            deleted = apply_retention(cache, args.name, args.keep_last, keys=keys)
        except (ValueError, CheckpointError) as exc:
            print(f"cachectl: {exc}", file=sys.stderr)
            return 2
        _report(args, deleted)
        return 0
    if not delete_checkpoint(cache, args.name, keys=keys):
        print(f"cachectl: no checkpoint {args.name!r}", file=sys.stderr)
        return EXIT_MISSING
    _report(args, [args.name])
    return 0


def _report(args: argparse.Namespace, deleted: list[str]) -> None:
    if args.json:
        print(json.dumps({"deleted": deleted}))
    else:
        for name in deleted:
            print(f"removed {name}")
