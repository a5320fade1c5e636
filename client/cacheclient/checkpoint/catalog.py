"""Checkpoints in the cache, without torch: commit, status, listing and retention (the catalog's public face).

A checkpoint is named "RUN/STEP" (for example "llama-7b/step-1000"); RUN may
have several components, STEP is one. Its bytes are split into chunks named
by their xxh3-128 content hash, so a chunk that an earlier checkpoint of the
run already stored is neither sent nor uploaded again. Under a key prefix
(default "ckpt/", which the server should map to a write-back namespace):

    ckpt/chunks/RUN/~/DIGEST       a chunk (the 32 hex digits of its xxh3-128)
    ckpt/manifests/RUN/~/STEP      the manifest: JSON naming every chunk
    ckpt/index/RUN/~index          the run's committed checkpoints, oldest first
    ckpt/readers/RUN/~/STEP        a marker a loader leaves (with a TTL)

The "~" components keep every object a leaf, so nested run names never ask an
S3 server for a name that is both an object and a directory.

Commit protocol: chunks first, then the manifest, then the run's index, each
only once the previous step is durable (on the cache server's disk or in
object storage, see `Durability`). A manifest therefore never names a chunk
that a crash could lose, and a checkpoint without a manifest does not exist:
no reader sees half a checkpoint.

Retention (`apply_retention`, `delete_checkpoint`) retires checkpoints from
the index, then deletes each retired manifest and the chunks that no kept
checkpoint references. It fails closed: when the manifest of a checkpoint it
keeps cannot be read, it deletes nothing and raises `RetentionBlocked`. A
retired checkpoint that a loader has marked within its lease is kept until
a later pass, so a load running during deletion still succeeds. One writer
per run is assumed (one training job): two jobs saving into one run at once
could race on its index.

With a metadata shard (a `CacheClient(meta=...)`), the commit is a record in
the shard instead of the run index, written through Raft, so it is
linearizable: once `finish` returns, every client that asks the shard sees
the checkpoint, and a save that dies before its record never existed. The
manifest itself stays a cache value (it names every chunk and can be far
larger than a shard proposal may be), under a key that names its content:

    ckpt/manifests/RUN/~/STEP~CHECKSUM   the manifest (CHECKSUM: 16 hex digits of its xxh3-64)

and the shard holds, as `Manifest` records of one `ManifestItem` naming that
key with its size and xxh3-64 checksum:

    ckpt/manifests/RUN/~/STEP            the commit: checkpoint RUN/STEP is this manifest
    ckpt/retired/RUN/~/STEP~CHECKSUM     a retired manifest whose chunks retention has yet to free

Listing, status and retention read the shard (ordered by the commit's log
index), and no run index is written. A replaced or retired checkpoint's

The parts: names, keys and errors in `cacheclient.checkpoint.layout`;
chunks in `cacheclient.checkpoint.chunks`; the two commit back-ends (the
shard's records, the run index) in `cacheclient.checkpoint.commits`, chosen
once per call by `commits(cache, keys)`. Every name they export that users
and `dcp` need is exported here too.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cacheclient.checkpoint.chunks import (
    ChunkReader,
    ChunkWriter,
    WriteStats,
    local_l2_reader,
    locate,
    wait_durable,
)
from cacheclient.checkpoint.commits import commits, mark_reader
from cacheclient.checkpoint.layout import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PREFIX,
    MANIFEST_FORMAT,
    CheckpointCorrupt,
    CheckpointEntry,
    CheckpointError,
    CheckpointKeys,
    CheckpointNotFound,
    Durability,
    RetentionBlocked,
    split_name,
)
from cacheclient.client import CacheClient

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PREFIX",
    "MANIFEST_FORMAT",
    "CheckpointCorrupt",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointKeys",
    "CheckpointNotFound",
    "CheckpointStatus",
    "ChunkReader",
    "ChunkWriter",
    "Durability",
    "RetentionBlocked",
    "WriteStats",
    "apply_retention",
    "checkpoint_status",
    "commit_checkpoint",
    "delete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "list_runs",
    "local_l2_reader",
    "locate",
    "mark_reader",
    "read_manifest",
    "retain_in_background",
    "split_name",
    "wait_durable",
    "wait_for_retention",
]


def read_manifest(cache: CacheClient, name: str, keys: CheckpointKeys | None = None) -> dict[str, Any]:
    """The committed manifest of checkpoint `name`.

    Raises:
        CheckpointNotFound: no checkpoint of that name was committed.
        CheckpointCorrupt: the metadata shard holds its commit, but its
            manifest is missing or does not match the commit's checksum.
    """
    return commits(cache, keys or CheckpointKeys()).manifest_at(name)[0]


def commit_checkpoint(
    cache: CacheClient,
    name: str,
    manifest: dict[str, Any],
    *,
    keys: CheckpointKeys | None = None,
    durability: Durability = Durability.CACHE,
    keep_last: int | None = None,
    durable_timeout: float = 600.0,
) -> None:
    """Makes checkpoint `name` exist: once every chunk is durable, stores its manifest, then commits it.

    The commit is a record in the metadata shard when `cache` routes by
    one, else an entry in the run's index (see the module docstring). A
    checkpoint of the same name is replaced, and its chunks that nothing
    else references are deleted. With `keep_last`, `apply_retention` runs
    after the commit in the background (`retain_in_background`).

    Raises:
        CheckpointError: a chunk is missing or not durable in time (nothing
            is committed then).
    """
    keys = keys or CheckpointKeys()
    run, _ = split_name(name)
    chunk_keys = [keys.chunk(run, digest) for digest in manifest["chunks"]]
    wait_durable(cache, chunk_keys, durability, durable_timeout)
    commits(cache, keys).commit(name, manifest, durability, durable_timeout)
    if keep_last is not None:
        retain_in_background(cache, run, keep_last, keys=keys)


class _Janitor:
    """Retention passes run behind the saves, one at a time per process.

    A save's stall never includes deleting old checkpoints (each delete
    reaches object storage). The next save of the run waits for its run's
    pass first (`wait`), so a pass never deletes a chunk that a save in
    flight has just found present and skipped. The worker thread is not a
    daemon: the interpreter finishes the last pass before it exits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[str, str], Future[list[str]]] = {}

    def submit(self, cache: CacheClient, run: str, keep_last: int, keys: CheckpointKeys) -> Future[list[str]]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retention")
            future = self._pool.submit(apply_retention, cache, run, keep_last, keys=keys)
            self._pending[(keys.prefix, run)] = future
        return future

    def wait(self, run: str, keys: CheckpointKeys) -> None:
        with self._lock:
            future = self._pending.pop((keys.prefix, run), None)
        if future is not None:
            try:
                future.result()
            except Exception as exc:  # a failed pass leaves retired checkpoints for the next one
                log.warning("checkpoint retention of run %r failed: %s", run, exc)


_janitor = _Janitor()


def retain_in_background(
    cache: CacheClient, run: str, keep_last: int, *, keys: CheckpointKeys | None = None
) -> Future[list[str]]:
    """`apply_retention` in this process's retention thread; returns its future."""
    return _janitor.submit(cache, run, keep_last, keys or CheckpointKeys())


def wait_for_retention(run: str, *, keys: CheckpointKeys | None = None) -> None:
    """Waits for the retention pass of `run` that a commit in this process started, if any."""
    _janitor.wait(run, keys or CheckpointKeys())


def apply_retention(cache: CacheClient, run: str, keep_last: int, *, keys: CheckpointKeys | None = None) -> list[str]:
    """Keeps the newest `keep_last` checkpoints of `run`; deletes the rest. Returns the names deleted.

    A checkpoint a loader marked within its lease is retired (no longer
    listed) but deleted by a later pass.

    Fails closed: a chunk is deleted only once the manifest of every
    checkpoint kept (the newest `keep_last`, and retired ones a loader
    uses) was read. When one cannot be read (missing, damaged, its node
    away), the pass retires and deletes nothing and raises.

    Raises:
        RetentionBlocked: a kept manifest cannot be read; nothing changed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    return commits(cache, keys or CheckpointKeys()).retain(run, keep_last)


def delete_checkpoint(cache: CacheClient, name: str, *, keys: CheckpointKeys | None = None) -> bool:
    """Deletes checkpoint `name` and the chunks only it references; returns whether it was listed.

    A checkpoint a loader marked within its lease is retired now and deleted
    by a later `apply_retention` or `delete_checkpoint` of its run.

    Raises:
        RetentionBlocked: `name` is retired, but the manifest of another
            checkpoint of the run cannot be read, so nothing was deleted yet
            (a later pass does it).
    """
    split_name(name)
    return commits(cache, keys or CheckpointKeys()).delete(name)


# -- what is there ---------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointStatus:
    """Where a checkpoint's bytes are.

    `state` is "uploaded" (object storage holds the manifest and every
    chunk), "in cache" (all there, some only in the cache so far), "missing"
    (no manifest: never committed, or deleted) or "damaged" (a chunk is gone).
    """

    name: str
    state: str
    created: float | None = None
    bytes: int = 0
    """Logical bytes of the checkpoint's tensors and objects."""
    stored_bytes: int = 0
    """Bytes of its distinct chunks (shared with other checkpoints of the run)."""
    chunks: int = 0
    chunks_uploaded: int = 0
    chunks_on_disk: int = 0
    chunks_missing: int = 0
    world_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def checkpoint_status(cache: CacheClient, name: str, *, keys: CheckpointKeys | None = None) -> CheckpointStatus:
    """Whether checkpoint `name` exists, and whether it is uploaded to object storage yet."""
    keys = keys or CheckpointKeys()
    run, _ = split_name(name)
    try:
        manifest, manifest_key = commits(cache, keys).manifest_at(name)
    except CheckpointNotFound:
        return CheckpointStatus(name, "missing")
    except CheckpointCorrupt:
        return CheckpointStatus(name, "damaged")
    chunks: dict[str, int] = manifest["chunks"]
    located = locate(cache, [manifest_key] + [keys.chunk(run, d) for d in chunks])
    manifest_at, chunks_at = located[0], located[1:]
    missing = sum(1 for where in chunks_at if where is None)
    uploaded = sum(1 for where in chunks_at if where is not None and where.uploaded)
    on_disk = sum(1 for where in chunks_at if where is not None and where.on_disk)
    if missing:
        state = "damaged"
    elif uploaded == len(chunks) and manifest_at is not None and manifest_at.uploaded:
        state = "uploaded"
    else:
        state = "in cache"
    return CheckpointStatus(
        name,
        state,
        created=manifest["created"],
        bytes=manifest["bytes"],
        stored_bytes=sum(chunks.values()),
        chunks=len(chunks),
        chunks_uploaded=uploaded,
        chunks_on_disk=on_disk,
        chunks_missing=missing,
        world_size=manifest.get("world_size", 0),
        extra={"tensors": len(manifest.get("items", []))},
    )


def list_runs(cache: CacheClient, *, keys: CheckpointKeys | None = None) -> list[str]:
    """The runs with committed checkpoints.

    With a metadata shard, the runs it holds commits of; else the runs whose
    index the cache or object storage holds (a run saved a moment ago shows
    before its index is uploaded).
    """
    return commits(cache, keys or CheckpointKeys()).runs()


def list_checkpoints(
    cache: CacheClient, run: str | None = None, *, keys: CheckpointKeys | None = None
) -> list[CheckpointEntry]:
    """The committed checkpoints of `run` (of every run when None), oldest first within a run."""
    return commits(cache, keys or CheckpointKeys()).entries(run)


def latest_checkpoint(cache: CacheClient, run: str, *, keys: CheckpointKeys | None = None) -> str | None:
    """The name of the newest committed checkpoint of `run`, or None."""
    return commits(cache, keys or CheckpointKeys()).latest(run)
