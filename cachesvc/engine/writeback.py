"""Write-back: the one owner of values whose newest copy is only in the cache.

`WriteBack` owns the dirty set, the bounded upload queue and the flusher
thread. The engine tells it when a put leaves a key dirty and when a delete
makes the upload moot; the flusher uploads each dirty key's newest cached
value under the key's lock (never under the engine lock) and then tells the
engine, through the `WriteBackSource` interface the engine implements, that
the key is clean.

Failure semantics: every upload error (object storage down, a 403, a deleted
bucket, a 5xx that outlived the S3 client's retries) is counted, the key stays
dirty and queued, and the flusher backs off exponentially up to
`max_backoff` seconds; the thread never ends before `close`. A dirty key is
never dropped from the cache: the engine keeps it out of the last tier's
eviction policy until it is uploaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Protocol

from cachesvc.engine.races import KeyLocks
from cachesvc.errors import Overloaded
from cachesvc.tiers.base import Entry, Tier

__all__ = ["WriteBack", "WriteBackQueue", "WriteBackSource"]

log = logging.getLogger(__name__)


class WriteBackSource(Protocol):
    """What the flusher needs from the cache that holds the dirty values (the engine)."""

    def dirty_entry(self, key: bytes) -> Entry | None:
        """The newest cached value of `key`; None when nothing readable is left."""

    def uploaded(self, key: bytes) -> None:
        """Object storage now holds the newest value of `key`: it may be evicted like any other."""


class WriteBack:
    """Dirty keys, their upload queue and the flusher thread.

    Args:
        store: object storage, where dirty values go.
        source: the cache holding the values (see `WriteBackSource`).
        locks: the per-key locks the engine takes for writes; an upload holds
            its key's lock so a put or delete of the key waits for it.
        capacity: dirty keys queued before puts wait (then `Overloaded`).
        io_timeout: seconds a put waits for room in the queue.
        max_backoff: longest pause between failed uploads.
    """

    def __init__(
        self,
        store: Tier,
        source: WriteBackSource,
        locks: KeyLocks,
        *,
        capacity: int = 4096,
        io_timeout: float = 60.0,
        max_backoff: float = 5.0,
    ) -> None:
        self._store = store
        self._source = source
        self._locks = locks
        self._queue = WriteBackQueue(capacity)
        self._io_timeout = io_timeout
        self._max_backoff = max_backoff
        self._lock = threading.Lock()
        self._dirty: set[bytes] = set()
        self._counters: Counter[str] = Counter()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def start(self) -> None:
        """Starts the flusher thread."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="write-back", daemon=True)
            self._flusher.start()

    # -- the engine's side -------------------------------------------------

    def is_dirty(self, key: bytes) -> bool:
        with self._lock:
            return key in self._dirty

    def reserve(self, key: bytes) -> bool:
        """Waits for room in the queue for `key` (see `WriteBackQueue.reserve`)."""
        return self._queue.reserve(key, self._io_timeout)

    def release(self, reserved: bool) -> None:
        """Gives back a slot `reserve` took for a put that failed."""
        self._queue.release(reserved)

    def mark_dirty(self, key: bytes, reserved: bool = False) -> None:
        """The newest value of `key` is in the cache only: queue its upload."""
        with self._lock:
            self._dirty.add(key)
        self._queue.push(key, reserved)

    def discard(self, key: bytes) -> None:
        """`key` was deleted: nothing is left to upload (caller holds the key's lock)."""
        with self._lock:
            self._dirty.discard(key)
        self._queue.discard(key)

    def upload(self, key: bytes) -> bool:
        """Uploads `key` now if it is dirty (caller holds the key's lock); returns whether it is clean."""
        with self._lock:
            if key not in self._dirty:
                return True
        entry = self._source.dirty_entry(key)
        if entry is None:
            with self._lock:
                self._dirty.discard(key)
                self._counters["writeback_lost"] += 1
            log.error("a write-back value was lost before upload: no readable copy is left")
            return True
        try:
            self._store.put(key, entry.value, entry.checksum)
        except Exception as exc:
            with self._lock:
                self._counters["writeback_errors"] += 1
            log.warning("write-back upload failed, will retry: %s: %s", type(exc).__name__, exc)
            return False
        with self._lock:
            self._dirty.discard(key)
            self._counters["writebacks"] += 1
        self._queue.discard(key)
        self._source.uploaded(key)
        return True

    # -- the flusher -------------------------------------------------------

    def _upload_queued(self, key: bytes) -> bool:
        with self._locks(key):
            if self.upload(key):
                return True
        self._queue.push(key, reserved=False)
        return False

    def _flush_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            key = self._queue.pop(timeout=0.2)
            if key is None:
                continue
            if self._upload_queued(key):
                failures = 0
                continue
            failures += 1
            self._stop.wait(min(self._max_backoff, 0.05 * 2**failures))

    def flush(self, timeout: float) -> int:
        """Uploads queued keys until none are left or `timeout` passes; returns the dirty keys left."""
        deadline = time.monotonic() + timeout
        failures = 0
        while len(self._queue) and time.monotonic() < deadline:
            key = self._queue.pop(timeout=0.0)
            if key is None:
                break
            if self._upload_queued(key):
                failures = 0
                continue
            failures += 1
            time.sleep(max(0.0, min(self._max_backoff, 0.05 * 2**failures, deadline - time.monotonic())))
        return len(self)

    def close(self, flush_timeout: float) -> int:
        """Stops the flusher and uploads what it can within `flush_timeout`; returns the dirty keys left."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=self._max_backoff + 5.0)
        return self.flush(flush_timeout)

    def counters(self) -> dict[str, int]:
        """Uploads, upload errors and lost values so far, and the queue depth."""
        with self._lock:
            counters = dict(self._counters)
            counters["dirty_keys"] = len(self._dirty)
        counters["writeback_queue"] = len(self._queue)
        return counters

    def __len__(self) -> int:
        with self._lock:
            return len(self._dirty)


class WriteBackQueue:
    """Keys awaiting upload, at most `capacity` at a time; a key queued twice is uploaded once."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"write-back queue capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._reserved = 0
        self._cond = threading.Condition()

    def reserve(self, key: bytes, timeout: float) -> bool:
        """Waits for room for `key`; returns whether a slot was taken (False: already queued)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if key in self._keys:
                    return False
                if len(self._keys) + self._reserved < self.capacity:
                    self._reserved += 1
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(f"write-back queue full ({self.capacity} keys awaiting upload to object storage)")
                self._cond.wait(left)

    def push(self, key: bytes, reserved: bool) -> None:
        """Queues `key`, using the slot `reserve` took when `reserved`."""
        with self._cond:
            if reserved:
                self._reserved -= 1
            self._keys[key] = None
            self._keys.move_to_end(key)
            self._cond.notify_all()

    def release(self, reserved: bool) -> None:
        """Gives back a slot taken by `reserve` that was not used."""
        if reserved:
            with self._cond:
                self._reserved -= 1
                self._cond.notify_all()

    def pop(self, timeout: float) -> bytes | None:
        """The oldest queued key, or None if none arrived within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._keys:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            key, _ = self._keys.popitem(last=False)
            self._cond.notify_all()
            return key

    def discard(self, key: bytes) -> None:
        with self._cond:
            if self._keys.pop(key, 0) is None:
                self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._keys)
