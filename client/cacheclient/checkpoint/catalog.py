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
commit record becomes a retired record in the same Raft entry as the change.
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
from cacheclient.meta import MetaClient
from cacheclient.wire import boot_id
from cacheclient.wire import meta_pb2 as meta_pb

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

    def manifest_value(self, name: str, checksum: int) -> bytes:
        """The cache key of a manifest whose commit the metadata shard holds."""
        return self.manifest(name) + f"~{checksum:016x}".encode()

    def commit_record(self, name: str) -> str:
        """The name of checkpoint `name`'s commit record in the metadata shard."""
        return self.manifest(name).decode()

    def retired_record(self, name: str, checksum: int) -> str:
        """The name of the shard record of a retired manifest of checkpoint `name`."""
        run, step = split_name(name)
        return f"{self.prefix}retired/{run}/~/{step}~{checksum:016x}"

    def record_roots(self) -> tuple[str, str]:
        """The name prefixes of (commit records, retired records) in the metadata shard."""
        return f"{self.prefix}manifests/", f"{self.prefix}retired/"


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
        CheckpointCorrupt: the metadata shard holds its commit, but its
            manifest is missing or does not match the commit's checksum.
    """
    return _manifest_at(cache, keys or CheckpointKeys(), name)[0]


def _manifest_at(cache: CacheClient, keys: CheckpointKeys, name: str) -> tuple[dict[str, Any], bytes]:
    """The committed manifest of `name` and its cache key."""
    shard = _shard(cache, keys)
    if shard is not None:
        record = shard.get(name)
        if record is None:
            raise CheckpointNotFound(f"no checkpoint {name!r} committed in the metadata shard")
        return _record_manifest(cache, record), record.key
    key = keys.manifest(name)
    raw = cache.get(key)
    if raw is None:
        raise CheckpointNotFound(f"no checkpoint {name!r} in the cache or object storage")
    return _parse_manifest(name, raw), key


def _parse_manifest(name: str, raw: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested too deep
        raise CheckpointCorrupt(f"checkpoint {name!r}: its manifest is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"checkpoint {name!r}: its manifest is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint {name!r}: manifest format {manifest.get('format')!r} is not supported")
    return manifest


# -- commit records in the metadata shard -----------------------------------------


@dataclass(frozen=True)
class _Record:
    """A record in the metadata shard naming a manifest of checkpoint `name`: its commit, or a retired one."""

    name: str
    key: bytes
    """The manifest's cache key."""
    size: int
    checksum: int
    """xxh3-64 of the manifest."""
    revision: int = 0
    """The log index that wrote the record: a run's commits in this order are oldest first."""


class _Shard:
    """The checkpoints' records in the metadata shard (see the module docstring).

    One `Propose` is one Raft log entry, so the commands of one call here
    (a commit and the retired record of the manifest it replaces; a run's
    retirements) are applied together or not at all.
    """

    _LIST_CONCURRENCY = 8
    """Record reads in flight when listing (each a linearizable read)."""

    def __init__(self, meta: MetaClient, keys: CheckpointKeys) -> None:
        self.meta = meta
        self.keys = keys

    def get(self, name: str) -> _Record | None:
        """The commit record of checkpoint `name`, or None."""
        return self._get(self.keys.commit_record(name), name)

    def _get(self, record: str, name: str) -> _Record | None:
        found = self.meta.get_manifest(record)
        if found is None or len(found.items) != 1:
            return None
        item = found.items[0]
        return _Record(name, item.key.encode(), item.size, item.checksum, found.revision)

    def commit(self, name: str, key: bytes, size: int, checksum: int, replaced: _Record | None) -> None:
        """Makes the manifest at `key` checkpoint `name`; the one it replaces is retired in the same entry."""
        commands = [self._put(self.keys.commit_record(name), key, size, checksum)]
        if replaced is not None and replaced.key != key:
            commands.append(self._put_retired(replaced))
        self._propose(commands)

    def retire(self, records: Sequence[_Record]) -> None:
        """Moves committed checkpoints to retired records (no longer listed or loadable), in one entry."""
        commands = []
        for record in records:
            commands.append(self._put_retired(record))
            commands.append(self._delete(self.keys.commit_record(record.name)))
        self._propose(commands)

    def forget(self, records: Sequence[_Record]) -> None:
        """Deletes retired records (whose manifests and chunks are freed)."""
        self._propose([self._delete(self.keys.retired_record(r.name, r.checksum)) for r in records])

    def committed(self, run: str | None = None) -> list[_Record]:
        """The commit records (of `run`, or of every run), by run, oldest commit first."""
        return self._records(self._names(self.keys.record_roots()[0], run, retired=False))

    def retired(self, run: str) -> list[_Record]:
        """The retired records of `run`."""
        return self._records(self._names(self.keys.record_roots()[1], run, retired=True))

    def runs(self) -> list[str]:
        """The runs with a committed checkpoint, sorted."""
        names = self._names(self.keys.record_roots()[0], None, retired=False)
        return sorted({split_name(name)[0] for _, name in names})

    def _names(self, root: str, run: str | None, *, retired: bool) -> list[tuple[str, str]]:
        """(record, checkpoint name) of every record under `root`, of `run` if given."""
        out = []
        for record in self.meta.list_manifests():
            if not record.startswith(root):
                continue
            record_run, sep, step = record[len(root) :].rpartition("/~/")
            if retired:
                step = step.rpartition("~")[0]
            if not sep or (run is not None and record_run != run):
                continue
            try:
                split_name(f"{record_run}/{step}")
            except CheckpointError:
                continue  # not a record of ours
            out.append((record, f"{record_run}/{step}"))
        return out

    def _records(self, names: list[tuple[str, str]]) -> list[_Record]:
        if len(names) > 1:
            with ThreadPoolExecutor(self._LIST_CONCURRENCY, thread_name_prefix="ckpt-records") as pool:
                found = list(pool.map(lambda pair: self._get(*pair), names))
        else:
            found = [self._get(*pair) for pair in names]
        records = [r for r in found if r is not None]  # deleted since the listing
        return sorted(records, key=lambda r: (split_name(r.name)[0], r.revision))

    def _put_retired(self, record: _Record) -> meta_pb.Command:
        return self._put(
            self.keys.retired_record(record.name, record.checksum), record.key, record.size, record.checksum
        )

    @staticmethod
    def _put(record: str, key: bytes, size: int, checksum: int) -> meta_pb.Command:
        item = meta_pb.ManifestItem(key=key.decode(), size=size, checksum=checksum)
        return meta_pb.Command(put_manifest=meta_pb.PutManifest(manifest=meta_pb.Manifest(name=record, items=[item])))

    @staticmethod
    def _delete(record: str) -> meta_pb.Command:
        return meta_pb.Command(delete_manifest=meta_pb.DeleteManifest(name=record))

    def _propose(self, commands: list[meta_pb.Command]) -> None:
        if not commands:
            return
        results = self.meta.propose(commands)
        for command, result in zip(commands, results, strict=True):
            # A delete of a record already gone is refused, and harmless.
            if not result.ok and command.WhichOneof("op") == "put_manifest":
                raise CheckpointError(
                    f"the metadata shard refused {command.put_manifest.manifest.name}: {result.error}"
                )


def _shard(cache: CacheClient, keys: CheckpointKeys) -> _Shard | None:
    """The metadata shard's records when `cache` routes by a shard, else None (the run index in the cache)."""
    router = cache.router
    meta = router.meta if router is not None else None
    return _Shard(meta, keys) if meta is not None else None


def _record_manifest(cache: CacheClient, record: _Record) -> dict[str, Any]:
    """The manifest a shard record names, checked against the record's size and checksum."""
    try:
        raw = cache.get(record.key)
    except CorruptValueError as exc:
        raise CheckpointCorrupt(f"checkpoint {record.name!r}: its manifest is damaged: {exc}") from exc
    if raw is None:
        raise CheckpointCorrupt(
            f"checkpoint {record.name!r}: its manifest is missing from the cache and object storage"
        )
    if len(raw) != record.size or xxhash.xxh3_64_intdigest(raw) != record.checksum:
        raise CheckpointCorrupt(f"checkpoint {record.name!r}: its manifest does not match the committed checksum")
    return _parse_manifest(record.name, raw)


def _commit_to_shard(
    cache: CacheClient, shard: _Shard, name: str, manifest: dict[str, Any], durability: Durability, timeout: float
) -> None:
    """Stores the manifest under its checksum, then commits it in the shard; frees the one it replaces."""
    raw = json.dumps(manifest, sort_keys=True).encode()
    checksum = xxhash.xxh3_64_intdigest(raw)
    key = shard.keys.manifest_value(name, checksum)
    cache.put(key, raw)
    wait_durable(cache, [key], durability, timeout)
    replaced = shard.get(name)
    shard.commit(name, key, len(raw), checksum, replaced)  # the commit point
    if replaced is not None and replaced.key != key:
        _free_retired(cache, shard, split_name(name)[0])


def _free_retired(cache: CacheClient, shard: _Shard, run: str) -> list[str]:
    """Deletes the retired manifests of `run` that no loader uses, then their records; returns their names.

    Chunks go first, then manifests, then records: a pass that dies halfway
    leaves records that the next pass finishes.
    """
    retired = shard.retired(run)
    free = [r for r in retired if not _in_use(cache, shard.keys, r.name)]
    if not free:
        return []
    candidates: set[str] = set()
    for record in free:
        with contextlib.suppress(CheckpointCorrupt):  # its manifest deleted by a pass that died
            candidates |= set(_record_manifest(cache, record)["chunks"])
    for record in [r for r in retired if r not in free] + shard.committed(run):
        with contextlib.suppress(CheckpointCorrupt):  # unloadable anyway
            candidates -= set(_record_manifest(cache, record)["chunks"])
    _delete_chunks(cache, shard.keys, run, candidates)
    for record in free:
        cache.delete(record.key)
    shard.forget(free)
    return list(dict.fromkeys(r.name for r in free))


# -- the run index in the cache ----------------------------------------------------


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
    shard = _shard(cache, keys)
    if shard is not None:
        _commit_to_shard(cache, shard, name, manifest, durability, durable_timeout)
    else:
        _commit_to_index(cache, keys, name, manifest, durability, durable_timeout)
    if keep_last is not None:
        retain_in_background(cache, run, keep_last, keys=keys)


def _commit_to_index(
    cache: CacheClient,
    keys: CheckpointKeys,
    name: str,
    manifest: dict[str, Any],
    durability: Durability,
    durable_timeout: float,
) -> None:
    """Stores the manifest, then lists it in its run's index; frees the chunks of the one it replaces."""
    run, _ = split_name(name)
    try:
        replaced: dict[str, Any] | None = read_manifest(cache, name, keys)
    except CheckpointNotFound:
        replaced = None
    manifest_key = keys.manifest(name)
    cache.put(manifest_key, json.dumps(manifest, sort_keys=True).encode())
    wait_durable(cache, [manifest_key], durability, durable_timeout)
    index = _read_index(cache, keys, run)
    entry = {
        "name": name,
        "created": manifest["created"],
        "bytes": manifest["bytes"],
        "chunks": len(manifest["chunks"]),
    }
    index["checkpoints"] = [c for c in index["checkpoints"] if c["name"] != name] + [entry]
    index["retired"] = [n for n in index["retired"] if n != name]
    _write_index(cache, keys, run, index, durable_timeout)
    if replaced is not None:
        stale = set(replaced["chunks"]) - set(manifest["chunks"])
        _delete_unreferenced(cache, keys, run, index, stale)


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
    shard = _shard(cache, keys)
    if shard is not None:
        shard.retire(shard.committed(run)[:-keep_last])
        return _free_retired(cache, shard, run)
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
    shard = _shard(cache, keys)
    if shard is not None:
        record = shard.get(name)
        listed = record is not None or any(r.name == name for r in shard.retired(run))
        if record is not None:
            shard.retire([record])
        _free_retired(cache, shard, run)
        return listed
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
    _delete_chunks(cache, keys, run, candidates)


def _delete_chunks(cache: CacheClient, keys: CheckpointKeys, run: str, digests: Iterable[str]) -> None:
    # A delete reaches object storage: run them side by side.
    chunk_keys = [keys.chunk(run, digest) for digest in digests]
    if not chunk_keys:
        return
    with ThreadPoolExecutor(_DELETE_CONCURRENCY, thread_name_prefix="ckpt-delete") as pool:
        list(pool.map(cache.delete, chunk_keys))


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
        manifest, manifest_key = _manifest_at(cache, keys, name)
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
    index object storage holds (a brand-new run shows once its index is uploaded).
    """
    keys = keys or CheckpointKeys()
    shard = _shard(cache, keys)
    if shard is not None:
        return shard.runs()
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
    shard = _shard(cache, keys)
    if shard is not None:
        return [_entry(cache, record) for record in shard.committed(run)]
    runs = [run] if run is not None else list_runs(cache, keys=keys)
    return [
        CheckpointEntry(c["name"], c["created"], c["bytes"], c["chunks"])
        for r in runs
        for c in _read_index(cache, keys, r)["checkpoints"]
    ]


def _entry(cache: CacheClient, record: _Record) -> CheckpointEntry:
    try:
        manifest = _record_manifest(cache, record)
    except CheckpointCorrupt:  # listed all the same: its status says "damaged"
        return CheckpointEntry(record.name, 0.0, 0, 0)
    return CheckpointEntry(record.name, manifest["created"], manifest["bytes"], len(manifest["chunks"]))


def latest_checkpoint(cache: CacheClient, run: str, *, keys: CheckpointKeys | None = None) -> str | None:
    """The name of the newest committed checkpoint of `run`, or None."""
    keys = keys or CheckpointKeys()
    shard = _shard(cache, keys)
    if shard is not None:
        records = shard.committed(run)
        return records[-1].name if records else None
    entries = list_checkpoints(cache, run, keys=keys)
    return entries[-1].name if entries else None
