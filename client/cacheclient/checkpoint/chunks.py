"""Checkpoint chunks: written content-addressed (`ChunkWriter`), read and verified (`ChunkReader`), and
waited on until durable (`wait_durable`).

A checkpoint's bytes are split into chunks named by their xxh3-128 content
hash, so a chunk that an earlier checkpoint of the run already stored is
neither sent nor uploaded again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import lmdb

from cacheclient._lmdb_reader import L2Reader, colocated_reader
from cacheclient.checkpoint.layout import (
    DEFAULT_CHUNK_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointKeys,
    Durability,
    chunk_digest,
)
from cacheclient.client import CacheClient, Location
from cacheclient.errors import CacheClientError, CorruptValueError

__all__ = [
    "ChunkReader",
    "ChunkWriter",
    "WriteStats",
    "delete_chunks",
    "local_l2_reader",
    "locate",
    "wait_durable",
]

log = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20
"""Chunk bytes per dedup check and put (one `locate_many`, then one `put_many`)."""
_DELETE_CONCURRENCY = 8
"""Deletes in flight during retention (each reaches object storage). Half a server's default 16 calls in
flight (`server.workers`): with 16, a retention pass behind a save had a checkpoint's status refused as
overloaded (RESOURCE_EXHAUSTED)."""


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
        self._pieces: dict[str, memoryview] = {}
        """Unsynced: each chunk added, until `finish` checked where it landed."""
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
            digest = chunk_digest(piece)
            digests.append(digest)
            if digest in self._seen:
                continue
            self._seen[digest] = len(piece)
            if self._durability is Durability.UNSYNCED:
                self._pieces[digest] = piece
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
            # Synced: durable when the put returns (on the server's disk at least): nothing to wait for after,
            # and a server that cannot keep them says so at once. Unsynced: checked in `finish`.
            self._cache.put_many(missing, durable=self._durability.synced_puts)  # type: ignore[arg-type]
        return len(missing), sum(len(piece) for _, piece in missing)

    def _keep_on_disk(self) -> None:
        """Puts again, durable, every chunk sent unsynced that the server keeps in memory only (a cache-only
        prefix): the commit must not wait for a chunk that never reaches disk. One look-up for all of them."""
        keys = [self._keys.chunk(self._run, digest) for digest in self._pieces]
        where = self._cache.locate_many(keys, cached_only=True)
        again = [
            (key, piece)
            for key, piece, at in zip(keys, self._pieces.values(), where, strict=True)
            if at is not None and not self._durability.holds(at)
        ]
        if again:
            self._cache.put_many(again, durable=True)  # type: ignore[arg-type]

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
            if self._durability is Durability.UNSYNCED:
                self._keep_on_disk()
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
    the server's LMDB file; the rest come over gRPC. A chunk is named by its
    content hash, which every read checks, so the file's copy is read even
    where the server would first check it against object storage (after a
    restart: one HEAD per chunk, and the bytes over gRPC).
    """

    def __init__(self, cache: CacheClient, keys: CheckpointKeys, run: str, local: L2Reader | None = None) -> None:
        # Chunks are named by their digest: any stored copy is the chunk, so one a node withholds (a node
        # that may hold write-back values is down) is read from object storage (`verified_reads`).
        self._cache = cache.verified_reads()
        self._keys = keys
        self._run = run
        self._local = local

    @property
    def local(self) -> bool:
        """Whether chunks are read straight from the co-located server's L2."""
        return self._local is not None

    def fetch(
        self, chunks: dict[str, int], places: dict[str, memoryview] | None = None
    ) -> dict[str, bytes | memoryview]:
        """{digest: bytes} for the chunks named (digest -> size).

        With `places` (digest -> where the chunk belongs), a chunk in the
        co-located L2 is read straight into its place and verified there;
        its entry is then that place.

        Raises:
            CheckpointCorrupt: a chunk is missing, unreadable or does not
                match its digest; `.digest` names it.
        """
        out: dict[str, bytes | memoryview] = {}
        if self._local is not None:
            try:
                for digest, place in (places or {}).items():
                    got = self._local.get_into(self._keys.chunk(self._run, digest), place, unchecked=True)
                    if isinstance(got, memoryview) and len(got) == chunks[digest] and chunk_digest(got) == digest:
                        out[digest] = got
                rest = [d for d in chunks if d not in out]
                found = self._local.get_many([self._keys.chunk(self._run, d) for d in rest], unchecked=True)
            except lmdb.Error as exc:
                log.warning("co-located reads off: %s", exc)
                self._local = None
            else:
                for digest, value in zip(rest, found, strict=True):
                    if value is not None and len(value) == chunks[digest] and chunk_digest(value) == digest:
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
        if len(value) != size or chunk_digest(value) != digest:
            raise _chunk_error(digest, "does not match its content hash")
        return value


def local_l2_reader(cache: CacheClient) -> L2Reader | None:
    """A reader of the cache server's L2 when this process runs on the server's machine, else None."""
    return colocated_reader(cache, cache.address)


def _chunk_error(digest: str, what: str) -> CheckpointCorrupt:
    error = CheckpointCorrupt(f"chunk {digest} {what}")
    error.digest = digest  # type: ignore[attr-defined]
    return error


def delete_chunks(cache: CacheClient, keys: CheckpointKeys, run: str, digests: Iterable[str]) -> None:
    """Deletes chunks of `run`, side by side (a delete reaches object storage)."""
    chunk_keys = [keys.chunk(run, digest) for digest in digests]
    if not chunk_keys:
        return
    with ThreadPoolExecutor(_DELETE_CONCURRENCY, thread_name_prefix="ckpt-delete") as pool:
        list(pool.map(cache.delete, chunk_keys))
