"""Checkpoints in the cache, without torch: key layout, chunks, manifests, runs, status and retention.

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
checkpoint references. A retired checkpoint that a loader has marked within
its lease is kept until a later pass, so a load running during deletion still
succeeds. One writer per run is assumed (one training job): two jobs saving
into one run at once could race on its index.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lmdb
import xxhash

from cacheclient._lmdb_reader import L2Reader
from cacheclient.client import CacheClient, Location
from cacheclient.errors import CacheClientError, CorruptValueError
from cacheclient.wire import boot_id

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PREFIX",
    "CheckpointCorrupt",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointKeys",
    "CheckpointNotFound",
    "CheckpointStatus",
    "ChunkReader",
    "ChunkWriter",
    "Durability",
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

DEFAULT_PREFIX = "ckpt/"
DEFAULT_CHUNK_BYTES = 2 << 20
"""Chunk size: one chunk travels in one batched put (under INLINE_BYTES); a partly changed tensor re-sends little."""
MANIFEST_FORMAT = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)+")
_MAX_NAME_BYTES = 400
_BATCH_BYTES = 64 << 20
"""Chunk bytes per dedup check and put (one `locate_many`, then one `put_many`)."""
_DELETE_CONCURRENCY = 16
"""Deletes in flight during retention (each reaches object storage)."""


class CheckpointError(CacheClientError):
    """A checkpoint could not be saved, found or read."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint has this name."""


class CheckpointCorrupt(CheckpointError):
    """A chunk of a committed checkpoint is missing or fails its content hash."""


class Durability(enum.StrEnum):
    """Where every chunk must be before a checkpoint is committed."""

    CACHE = "cache"
    """On the cache server's disk (L2) or in object storage: survives the server being killed."""
    S3 = "s3"
    """In object storage: survives the loss of the cache server's disk."""

    def holds(self, location: Location | None) -> bool:
        if location is None:
            return False
        return location.uploaded if self is Durability.S3 else location.durable


def split_name(name: str) -> tuple[str, str]:
    """(run, step) of a checkpoint name "RUN/STEP".

    Raises:
        CheckpointError: not a valid name (components of letters, digits,
            ".", "_" and "-", not starting with "." or "-"; at least two).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name.encode()) > _MAX_NAME_BYTES:
        raise CheckpointError(
            f"checkpoint name {name!r}: expected RUN/STEP, components of letters, digits, '.', '_' and '-' "
            f"(at most {_MAX_NAME_BYTES} bytes), e.g. 'llama-7b/step-1000'"
        )
    run, _, step = name.rpartition("/")
    return run, step


def _check_run(run: str) -> str:
    split_name(run + "/x")
    return run


@dataclass(frozen=True)
class CheckpointKeys:
    """The cache keys of checkpoints under `prefix`."""

    prefix: str = DEFAULT_PREFIX

    def chunk(self, run: str, digest: str) -> bytes:
        return f"{self.prefix}chunks/{run}/~/{digest}".encode()

    def manifest(self, name: str) -> bytes:
        run, step = split_name(name)
        return f"{self.prefix}manifests/{run}/~/{step}".encode()

    def index(self, run: str) -> bytes:
        return f"{self.prefix}index/{_check_run(run)}/~index".encode()

    def reader(self, name: str) -> bytes:
        run, step = split_name(name)
        return f"{self.prefix}readers/{run}/~/{step}".encode()

    def index_root(self) -> bytes:
        return f"{self.prefix}index/".encode()


def _digest(data: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# -- writing chunks ------------------------------------------------------------


@dataclass
class WriteStats:
    """What one rank's save handed to the cache."""

    bytes: int = 0
    """Bytes of the tensors and objects saved."""
    chunks: int = 0
    bytes_sent: int = 0
    """Bytes of chunks the cache did not hold yet (the rest was deduplicated)."""
    chunks_sent: int = 0
    seconds_sending: float = 0.0
    """From the first chunk handed over until the last one was acknowledged."""
    seconds_durable: float = 0.0
    """Waiting, after that, until every chunk was durable."""


class ChunkWriter:
    """Splits buffers into content-addressed chunks and stores the ones the cache lacks.

    `add` hashes in the caller's thread and hands batches to `threads`
    workers, each of which asks the cache which chunks it already holds
    (`locate_many`) and puts the rest; at most `2 * threads` batches wait, so
    a slow cache slows `add` down instead of piling up copies. `finish` waits
    for the puts, then until every chunk is durable as `durability` says.

    Args:
        cache: the cache server.
        keys: the key layout.
        run: the run the chunks belong to (chunks are shared within a run only).
        chunk_bytes: the size of a chunk (the last one of a buffer is shorter).
        durability: where chunks must be before `finish` returns.
        durable_timeout: seconds `finish` waits for durability before failing.
        known: digests known to be stored (the run's latest checkpoint's),
            skipped without asking the cache.
    """

    def __init__(
        self,
        cache: CacheClient,
        keys: CheckpointKeys,
        run: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        durability: Durability = Durability.CACHE,
        threads: int = 4,
        durable_timeout: float = 600.0,
        known: Iterable[str] = (),
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._cache = cache
        self._keys = keys
        self._run = run
        self._chunk_bytes = chunk_bytes
        self._durability = Durability(durability)
        self._durable_timeout = durable_timeout
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-put")
        self._room = threading.BoundedSemaphore(2 * max(1, threads))
        self._futures: list[Future[tuple[int, int]]] = []
        self._seen: dict[str, int] = {}
        self._known = frozenset(known)
        self._batch: list[tuple[str, memoryview]] = []
        self._batch_bytes = 0
        self._started: float | None = None
        self.stats = WriteStats()

    def add(self, data: memoryview | bytes) -> list[str]:
        """Chunks `data` (kept referenced until `finish`); returns its chunks' digests, in order."""
        view = memoryview(data).cast("B")
        if self._started is None:
            self._started = time.perf_counter()
        digests = []
        for start in range(0, len(view), self._chunk_bytes):
            piece = view[start : start + self._chunk_bytes]
            digest = _digest(piece)
            digests.append(digest)
            if digest in self._seen:
                continue
            self._seen[digest] = len(piece)
            self._batch.append((digest, piece))
            self._batch_bytes += len(piece)
            if self._batch_bytes >= _BATCH_BYTES:
                self._submit()
        self.stats.bytes += len(view)
        return digests

    def _submit(self) -> None:
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._room.acquire()
        future = self._pool.submit(self._store, batch)
        future.add_done_callback(lambda _: self._room.release())
        self._futures.append(future)

    def _store(self, batch: list[tuple[str, memoryview]]) -> tuple[int, int]:
        # Only the cache tiers are asked: a chunk that lives only in object
        # storage would cost a request there each, more than sending it again.
        batch = [(digest, piece) for digest, piece in batch if digest not in self._known]
        keys = [self._keys.chunk(self._run, digest) for digest, _ in batch]
        held = self._cache.locate_many(keys, cached_only=True)
        missing = [(key, piece) for key, (_, piece), where in zip(keys, batch, held, strict=True) if where is None]
        if missing:
            self._cache.put_many(missing)  # type: ignore[arg-type]  # any buffer; put_many copies it once
        return len(missing), sum(len(piece) for _, piece in missing)

    def digests(self) -> dict[str, int]:
        """Every distinct chunk added so far, with its size."""
        return dict(self._seen)

    def finish(self) -> WriteStats:
        """Waits until every chunk is stored and durable; returns what was sent.

        Raises:
            CheckpointError: a put failed, or a chunk was not durable within
                `durable_timeout` seconds.
        """
        try:
            self._submit()
            for future in self._futures:
                sent, sent_bytes = future.result()
                self.stats.chunks_sent += sent
                self.stats.bytes_sent += sent_bytes
            sent_at = time.perf_counter()
            self.stats.seconds_sending = sent_at - (self._started or sent_at)
            self.stats.chunks = len(self._seen)
            wait_durable(
                self._cache,
                [self._keys.chunk(self._run, d) for d in self._seen],
                self._durability,
                self._durable_timeout,
            )
            self.stats.seconds_durable = time.perf_counter() - sent_at
            return self.stats
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def locate(cache: CacheClient, keys: Sequence[bytes]) -> list[Location | None]:
    """`locate_many`, asking object storage only about the keys the cache tiers do not hold."""
    located = cache.locate_many(keys, cached_only=True)
    uncached = [i for i, where in enumerate(located) if where is None]
    if uncached:  # evicted from the cache, or never there
        for i, where in zip(uncached, cache.locate_many([keys[i] for i in uncached]), strict=True):
            located[i] = where
    return located


def wait_durable(cache: CacheClient, keys: Sequence[bytes], durability: Durability, timeout: float) -> None:
    """Waits until every key is held as `durability` says.

    Raises:
        CheckpointError: a key is missing altogether, or `timeout` passed.
    """
    deadline = time.monotonic() + timeout
    pending = list(keys)
    pause = 0.01
    while pending:
        located = locate(cache, pending)
        lost = [key for key, where in zip(pending, located, strict=True) if where is None]
        if lost:
            raise CheckpointError(f"{len(lost)} chunks vanished from the cache before commit, e.g. {lost[0]!r}")
        pending = [key for key, where in zip(pending, located, strict=True) if not durability.holds(where)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{len(pending)} of {len(keys)} values not durable ({durability.value}) after {timeout:g}s, "
                f"e.g. {pending[0]!r}; is the server's write-back upload failing?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


# -- reading chunks ------------------------------------------------------------


class ChunkReader:
    """Fetches chunks by digest and verifies each against its name (xxh3-128) and size.

    With `local` (a reader of the cache server's L2, when this process runs
    on the server's machine), chunks resident there are read straight from
    the server's LMDB file; the rest come over gRPC.
    """

    def __init__(self, cache: CacheClient, keys: CheckpointKeys, run: str, local: L2Reader | None = None) -> None:
        self._cache = cache
        self._keys = keys
        self._run = run
        self._local = local

    def fetch(self, chunks: dict[str, int]) -> dict[str, bytes]:
        """{digest: bytes} for the chunks named (digest -> size).

        Raises:
            CheckpointCorrupt: a chunk is missing, unreadable or does not
                match its digest; `.digest` names it.
        """
        out: dict[str, bytes] = {}
        if self._local is not None:
            try:
                found = self._local.get_many([self._keys.chunk(self._run, d) for d in chunks])
            except lmdb.Error as exc:
                log.warning("co-located reads off: %s", exc)
                self._local = None
            else:
                for digest, value in zip(chunks, found, strict=True):
                    if value is not None and len(value) == chunks[digest] and _digest(value) == digest:
                        out[digest] = value
        digests = [d for d in chunks if d not in out]
        try:
            stream = self._cache.iter_many([self._keys.chunk(self._run, d) for d in digests])
            for digest, (_, value) in zip(digests, stream, strict=True):
                out[digest] = self._check(digest, chunks[digest], value)
        except CheckpointCorrupt:
            raise
        except CacheClientError:
            # One stream failed for all of them: read the rest one by one to
            # name the chunk at fault (and get every chunk that is fine).
            for digest in digests:
                if digest not in out:
                    try:
                        value = self._cache.get(self._keys.chunk(self._run, digest))
                    except CorruptValueError as exc:
                        raise _chunk_error(digest, f"is damaged: {exc}") from exc
                    out[digest] = self._check(digest, chunks[digest], value)
        return out

    @staticmethod
    def _check(digest: str, size: int, value: bytes | None) -> bytes:
        if value is None:
            raise _chunk_error(digest, "is missing from the cache and object storage")
        if len(value) != size or _digest(value) != digest:
            raise _chunk_error(digest, "does not match its content hash")
        return value


def local_l2_reader(cache: CacheClient) -> L2Reader | None:
    """A reader of the cache server's L2 when this process runs on the server's machine, else None."""
    try:
        info = cache.info(timeout=5.0)
    except CacheClientError:
        return None
    path = info.get("l2_path") or ""
    same_machine = info.get("boot_id") == boot_id() and info.get("hostname") == socket.gethostname()
    if not (same_machine and path and os.path.exists(os.path.join(path, "data.mdb"))):
        return None
    reader = L2Reader(path, int(info.get("l2_map_size") or 0))
    try:
        reader.get_many([])
    except (lmdb.Error, OSError) as exc:
        log.warning("co-located reads off: cannot open %s read-only (%s)", path, exc)
        return None
    return reader


def _chunk_error(digest: str, what: str) -> CheckpointCorrupt:
    error = CheckpointCorrupt(f"chunk {digest} {what}")
    error.digest = digest  # type: ignore[attr-defined]
    return error


# -- manifests and the run index ------------------------------------------------


def read_manifest(cache: CacheClient, name: str, keys: CheckpointKeys | None = None) -> dict[str, Any]:
    """The committed manifest of checkpoint `name`.

    Raises:
        CheckpointNotFound: no checkpoint of that name was committed.
    """
    keys = keys or CheckpointKeys()
    raw = cache.get(keys.manifest(name))
    if raw is None:
        raise CheckpointNotFound(f"no checkpoint {name!r} in the cache or object storage")
    manifest: dict[str, Any] = json.loads(raw)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint {name!r}: manifest format {manifest.get('format')!r} is not supported")
    return manifest


def _read_index(cache: CacheClient, keys: CheckpointKeys, run: str) -> dict[str, Any]:
    raw = cache.get(keys.index(run))
    if raw is None:
        return {"format": MANIFEST_FORMAT, "run": run, "checkpoints": [], "retired": []}
    index: dict[str, Any] = json.loads(raw)
    index.setdefault("retired", [])
    return index


def _write_index(cache: CacheClient, keys: CheckpointKeys, run: str, index: dict[str, Any], timeout: float) -> None:
    key = keys.index(run)
    cache.put(key, json.dumps(index, sort_keys=True).encode())
    wait_durable(cache, [key], Durability.CACHE, timeout)


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
    """Makes checkpoint `name` exist: once every chunk is durable, stores its manifest, then lists it in its run.

    A checkpoint of the same name is replaced, and its chunks that nothing
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
    try:
        replaced: dict[str, Any] | None = read_manifest(cache, name, keys)
    except CheckpointNotFound:
        replaced = None
    manifest_key = keys.manifest(name)
    cache.put(manifest_key, json.dumps(manifest, sort_keys=True).encode())
    wait_durable(cache, [manifest_key], durability, durable_timeout)
    index = _read_index(cache, keys, run)
    entry = {"name": name, "created": manifest["created"], "bytes": manifest["bytes"], "chunks": len(chunk_keys)}
    index["checkpoints"] = [c for c in index["checkpoints"] if c["name"] != name] + [entry]
    index["retired"] = [n for n in index["retired"] if n != name]
    _write_index(cache, keys, run, index, durable_timeout)
    if replaced is not None:
        stale = set(replaced["chunks"]) - set(manifest["chunks"])
        _delete_unreferenced(cache, keys, run, index, stale)
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


def mark_reader(cache: CacheClient, name: str, lease: float, keys: CheckpointKeys | None = None) -> None:
    """Records that a load of `name` runs, so retention keeps it for `lease` seconds."""
    keys = keys or CheckpointKeys()
    cache.put(keys.reader(name), json.dumps({"until": time.time() + lease}).encode(), ttl=lease)


def _in_use(cache: CacheClient, keys: CheckpointKeys, name: str) -> bool:
    raw = cache.get(keys.reader(name))
    return raw is not None and json.loads(raw).get("until", 0) > time.time()


def apply_retention(cache: CacheClient, run: str, keep_last: int, *, keys: CheckpointKeys | None = None) -> list[str]:
    """Keeps the newest `keep_last` checkpoints of `run`; deletes the rest. Returns the names deleted.

    A checkpoint a loader marked within its lease is retired (no longer
    listed) but deleted by a later pass.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    keys = keys or CheckpointKeys()
    index = _read_index(cache, keys, run)
    old = index["checkpoints"][:-keep_last]
    return _retire(cache, keys, run, index, [c["name"] for c in old])


def delete_checkpoint(cache: CacheClient, name: str, *, keys: CheckpointKeys | None = None) -> bool:
    """Deletes checkpoint `name` and the chunks only it references; returns whether it was listed.

    A checkpoint a loader marked within its lease is retired now and deleted
    by a later `apply_retention` or `delete_checkpoint` of its run.
    """
    keys = keys or CheckpointKeys()
    run, _ = split_name(name)
    index = _read_index(cache, keys, run)
    listed = any(c["name"] == name for c in index["checkpoints"]) or name in index["retired"]
    if not listed and cache.get(keys.manifest(name)) is not None:
        listed = True  # committed but never indexed (a crash between the two)
    _retire(cache, keys, run, index, [name])
    return listed


def _retire(cache: CacheClient, keys: CheckpointKeys, run: str, index: dict[str, Any], names: list[str]) -> list[str]:
    """Moves `names` to the retired list, then deletes every retired checkpoint no loader uses."""
    index["checkpoints"] = [c for c in index["checkpoints"] if c["name"] not in names]
    index["retired"] = sorted(set(index["retired"]) | set(names))
    if names:
        _write_index(cache, keys, run, index, 60.0)
    deleted: list[str] = []
    candidates: set[str] = set()
    for name in list(index["retired"]):
        if _in_use(cache, keys, name):
            continue
        with contextlib.suppress(CheckpointNotFound):  # committed-and-deleted halfway before
            candidates |= set(read_manifest(cache, name, keys)["chunks"])
        cache.delete(keys.manifest(name))
        cache.delete(keys.reader(name))
        index["retired"].remove(name)
        deleted.append(name)
    if deleted:
        _write_index(cache, keys, run, index, 60.0)
        _delete_unreferenced(cache, keys, run, index, candidates)
    return deleted


def _delete_unreferenced(
    cache: CacheClient, keys: CheckpointKeys, run: str, index: dict[str, Any], candidates: set[str]
) -> None:
    """Deletes the chunks in `candidates` that no listed or retired checkpoint of `run` references."""
    if not candidates:
        return
    for name in [c["name"] for c in index["checkpoints"]] + index["retired"]:
        try:
            candidates -= set(read_manifest(cache, name, keys)["chunks"])
        except CheckpointNotFound:
            continue
    # A delete reaches object storage: run them side by side.
    with ThreadPoolExecutor(_DELETE_CONCURRENCY, thread_name_prefix="ckpt-delete") as pool:
        list(pool.map(cache.delete, [keys.chunk(run, digest) for digest in candidates]))


# -- what is there ---------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointEntry:
    """A committed checkpoint as its run's index lists it."""

    name: str
    created: float
    bytes: int
    chunks: int


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
        manifest = read_manifest(cache, name, keys)
    except CheckpointNotFound:
        return CheckpointStatus(name, "missing")
    chunks: dict[str, int] = manifest["chunks"]
    located = locate(cache, [keys.manifest(name)] + [keys.chunk(run, d) for d in chunks])
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
    """The runs whose index object storage holds (a brand-new run shows once its index is uploaded)."""
    keys = keys or CheckpointKeys()
    root = keys.index_root()
    runs = []
    for key, _ in cache.list(root):
        if key.endswith(b"/~index"):
            runs.append(key[len(root) : -len(b"/~index")].decode())
    return runs


def list_checkpoints(
    cache: CacheClient, run: str | None = None, *, keys: CheckpointKeys | None = None
) -> list[CheckpointEntry]:
    """The committed checkpoints of `run` (of every run when None), oldest first within a run."""
    keys = keys or CheckpointKeys()
    runs = [run] if run is not None else list_runs(cache, keys=keys)
    return [
        CheckpointEntry(c["name"], c["created"], c["bytes"], c["chunks"])
        for r in runs
        for c in _read_index(cache, keys, r)["checkpoints"]
    ]


def latest_checkpoint(cache: CacheClient, run: str, *, keys: CheckpointKeys | None = None) -> str | None:
    """The name of the newest committed checkpoint of `run`, or None."""
    entries = list_checkpoints(cache, run, keys=keys)
    return entries[-1].name if entries else None
