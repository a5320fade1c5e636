"""`cachectl warm s3://bucket/prefix`: load a dataset into the cache ahead of a job.

The server does the work: warm lists the objects through the cache server,
asks which are already cached (those are skipped, so a warm that was
interrupted resumes where it stopped), and hands the rest to the server as one
prefetch plan whose window is their total size, so the server fetches them
from S3 into its tiers with its own bounded concurrency and no byte travels
to this command. A progress bar shows bytes, objects, rate and ETA.

Shard files (`.tar`, `.mds`: `cacheclient.shards.SHARD_SUFFIXES`) are loaded
as the range keys `CachedShardDataset` reads them by, one per part, so a
warmed shard is a warm epoch (and a shard larger than the server's largest
value still loads); `--whole-shards` loads them as whole objects instead.

Exit codes as in `cachectl`: 0 all loaded, 2 bad usage, 3 unreachable, 4 some
objects failed to load (run warm again to retry them).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cacheclient import CacheClient, CacheClientError
from cacheclient.shards import is_shard, part_keys
from cacheclient.wire import parse_s3_uri
from cachesvc.commands.common import EXIT_ERROR, EXIT_USAGE, client_of
from cachesvc.config import parse_size
from cachesvc.units import human_bytes

__all__ = ["cmd_warm"]

_CONTAINS_THREADS = 8


def cmd_warm(args: argparse.Namespace) -> int:
    """`cachectl warm URI [--window BYTES] [--no-progress] [--whole-shards]`, with `--cache` and `--timeout`
    from the main parser."""
    try:
        bucket, prefix = parse_s3_uri(args.uri)
        window = parse_size(args.window) if args.window else None
    except ValueError as exc:
        print(f"cachectl warm: {exc}", file=sys.stderr)
        return EXIT_USAGE
    client = client_of(args)
    # The server refuses a bucket other than its own, naming both.
    listing = client.list(prefix, bucket=bucket)
    objects = [(key, size) for key, size in listing if not (key.endswith(b"/") and size == 0)]
    # A shard is loaded as the range keys the shard dataset reads (its parts), not as one value.
    whole = getattr(args, "whole_shards", False)
    objects = [p for k, n in objects for p in (part_keys(k, n) if not whole and is_shard(k) else [(k, n)])]
    if not objects:
        info = client.info()
        print(
            f"cachectl warm: no objects under {args.uri} (the server caches "
            f"s3://{info['s3_bucket']}/{info['s3_prefix']}; the prefix is below that)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    total_bytes = sum(size for _, size in objects)

    # Which are cached already: the resume.
    with ThreadPoolExecutor(_CONTAINS_THREADS) as pool:
        cached = list(pool.map(lambda item: client.contains(item[0], cached_only=True), objects))
    todo = [item for item, hit in zip(objects, cached, strict=True) if not hit]
    skipped = len(objects) - len(todo)
    todo_bytes = sum(size for _, size in todo)
    print(
        f"warm {args.uri}: {len(objects)} objects, {human_bytes(total_bytes)}; "
        f"{skipped} already cached, loading {len(todo)} ({human_bytes(todo_bytes)})",
        flush=True,
    )
    _warn_if_too_big(client, todo_bytes)
    if not todo:
        return 0
    return _load(client, todo, window or max(todo_bytes, 1), show_bar=not args.no_progress)


def _warn_if_too_big(client: CacheClient, todo_bytes: int) -> None:
    try:
        tiers = client.stats()["tiers"]
    except CacheClientError:
        return
    room = max((t["capacity_bytes"] - t["used_bytes"] for t in tiers if t["capacity_bytes"]), default=None)
    if room is not None and todo_bytes > room:
        print(
            f"cachectl warm: warning: {human_bytes(todo_bytes)} to load but the largest cache tier has "
            f"{human_bytes(room)} free; "
            "objects loaded first may be evicted by the last",
            file=sys.stderr,
        )


def _chunks(todo: list[tuple[bytes, int]], window: int) -> list[list[tuple[bytes, int]]]:
    """Consecutive runs of `todo` of at most `window` bytes each (at least one object each)."""
    chunks: list[list[tuple[bytes, int]]] = [[]]
    held = 0
    for item in todo:
        if chunks[-1] and held + item[1] > window:
            chunks.append([])
            held = 0
        chunks[-1].append(item)
        held += item[1]
    return chunks


def _load(client: CacheClient, todo: list[tuple[bytes, int]], window: int, *, show_bar: bool) -> int:
    from tqdm import tqdm

    began = time.monotonic()
    bar = tqdm(
        total=sum(size for _, size in todo),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="warm",
        disable=not show_bar,
        dynamic_ncols=True,
    )
    fetched = failed = loaded_bytes = 0
    try:
        # A plan's window counts loaded-but-unread bytes, and nobody reads during
        # a warm: one plan per window's worth keeps the server's work bounded.
        for chunk in _chunks(todo, window):
            outcome = _load_chunk(client, chunk, bar, fetched + failed, len(todo))
            fetched += outcome[0]
            failed += outcome[1]
            loaded_bytes += outcome[2]
    except KeyboardInterrupt:
        bar.close()
        print("cachectl warm: interrupted; run it again to resume", file=sys.stderr)
        return 130
    except CacheClientError as exc:
        bar.close()
        print(f"cachectl warm: the server ended the warm: {exc}; run it again to resume", file=sys.stderr)
        return EXIT_ERROR
    bar.close()
    elapsed = time.monotonic() - began
    print(
        f"warm: loaded {fetched} objects ({human_bytes(loaded_bytes)}) in {elapsed:.1f}s "
        f"({human_bytes(loaded_bytes / max(elapsed, 1e-9))}/s)"
        + (f"; {failed} failed (missing or unreadable; run warm again to retry)" if failed else "")
    )
    return EXIT_ERROR if failed else 0


def _load_chunk(
    client: CacheClient, chunk: list[tuple[bytes, int]], bar: Any, before: int, total: int
) -> tuple[int, int, int]:
    """Loads one chunk through one plan; (objects loaded, objects failed, bytes loaded)."""
    sizes = [size for _, size in chunk]
    plan = client.prefetch([key for key, _ in chunk], window_bytes=max(sum(sizes), 1), sizes=sizes)
    shown = 0
    progress: dict[str, Any] = {}
    try:
        while True:
            progress = dict(plan.progress)
            # Bytes the plan holds are the bytes it loaded (0 for an object cached meanwhile).
            held = max(shown, int(progress.get("window_used_bytes", 0)))
            bar.update(held - shown)
            shown = held
            done = int(progress.get("fetched", 0)) + int(progress.get("failed", 0))
            bar.set_postfix_str(f"{before + done}/{total} objects", refresh=False)
            if plan.error is not None:
                raise plan.error
            if progress.get("done"):
                break
            time.sleep(0.2)
    finally:
        plan.close()
    # Objects cached by someone else meanwhile were not charged: account for them.
    bar.update(max(0, sum(sizes) - shown) if not progress.get("failed") else 0)
    return int(progress.get("fetched", 0)), int(progress.get("failed", 0)), shown
