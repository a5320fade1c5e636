"""Write-back: the upload queue and the flusher of values whose newest copy is only in the cache.

`WriteBack` owns the bounded upload queue and the flusher thread. Whether a
key is dirty is key state (`KeyState`, set by the engine's put); the flusher
uploads each queued dirty key's newest cached value under the key's lock
(never under the engine lock; a local-disk copy is read outside it too),
then marks it clean in the key state and makes its cached copies evictable
again (`Placement.unhold`), or drops them when the key passed its TTL
meanwhile. It is handed the key state and the cache tiers it acts on, never
the engine that built it.

Uploads are conditional: before it uploads, the flusher asks object storage
for the object's version (one HEAD, `VersionedTier.head_version`, under the
key's lock) and uploads only when the object is missing or not newer than the
cached value. A cluster node skips that HEAD when it is the key's sole writer
since the value was accepted (`UploadOrder`, `cachesvc.server.fences`: it
owns the key and the placement has not moved since; counted as
`writeback_unchecked`). A value superseded there (the key moved to another node, which
took a newer write of it while this one's upload waited or backed off) is
not uploaded: its copies here are dropped and it counts as
`writeback_superseded`. A newer object that holds the cached bytes (a
replicated put: each replica stamps it with its own clock, and the first to
upload leaves the others an object newer than their copy) is the same
value, not a newer one: the copy stays, clean, with the object's version,
and counts as `writeback_matched` (a second HEAD, on this path only).
Another node's upload between the HEAD and the PUT
is not excluded (the per-key order is this node's own); the window is one
round trip. A delete through a key's new owner reaches this node before it
reaches object storage (`Engine.drop_cached`), so it is not undone either.

Failure semantics: every upload error (object storage down, a 403, a deleted
bucket, a 5xx that outlived the S3 client's retries) is counted, the key stays
dirty and queued, and the flusher backs off exponentially up to
`max_backoff` seconds; the thread never ends before `close`. A dirty key is
never dropped from the cache: placement keeps it out of the last tier's
eviction policy until it is uploaded.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from cachesvc.engine.keystate import KeyState
from cachesvc.engine.placement import Level, Placement
from cachesvc.engine.races import KeyLocks
from cachesvc.errors import CorruptValue, WriteBackFull
from cachesvc.tiers.base import Entry, MappedTier, Tier, VersionedTier

__all__ = [
    "AgainstStore",
    "UploadOrder",
    "WriteBack",
    "WriteBackGate",
    "WriteBackQueue",
    "against_store",
    "answer_within",
]

log = logging.getLogger(__name__)


_answer_by: ContextVar[float] = ContextVar("answer_by", default=math.inf)
"""Monotonic time by which a put made in this context must be answered (`answer_within`)."""


@contextlib.contextmanager
def answer_within(seconds: float | None) -> Iterator[None]:
    """Puts made inside wait for room in the write-back queue only as long as a caller with `seconds` left (None:
    no deadline) can still be told the queue is full (`WriteBackFull`): a tenth of it, up to a second, is kept
    for the answer to travel."""
    if seconds is None:
        yield
        return
    token = _answer_by.set(time.monotonic() + seconds - min(1.0, 0.1 * seconds))
    try:
        yield
    finally:
        _answer_by.reset(token)


@dataclass(frozen=True, slots=True)
class AgainstStore:
    """A write-back copy not uploaded yet, checked against its object (`against_store`)."""

    superseded: bool
    """Object storage holds a newer value (other bytes): the copy must not be served or uploaded."""
    matched: int | None
    """The object is newer and holds the copy's bytes: its version (the copy's value, under a later stamp)."""
    seen: int
    """The newest version the check read (0: none), for the node's clock to observe."""


def against_store(store: VersionedTier, key: bytes, entry: Entry, version: int) -> AgainstStore:
    """Checks a write-back copy of `key` stamped `version`, not uploaded yet, against its object: one HEAD, and
    a second only when the object is newer.

    A newer object holding the copy's bytes is the same value, not a newer
    one: each replica of a replicated put stamps it with its own clock, so
    the first to upload leaves the others an object newer than their copy.
    A copy without a version (0) is never superseded.

    Raises:
        TierUnavailable: object storage cannot be reached.
    """
    theirs = store.head_version(key)
    if theirs is None or not version or theirs <= version:
        return AgainstStore(False, None, theirs or 0)
    stored = store.vouch(key, entry.value, entry.checksum)
    return AgainstStore(stored is None, stored, max(theirs, stored or 0))


class WriteBackGate(Protocol):
    """What a write-back value passes before the engine acknowledges it: in a cluster, the metadata shard
    told that this node may hold values object storage lacks (`cachesvc.server.holding`).

    `enter` returns False when that cannot be done now; the put is then
    written through. A node says it holds none again only once no value is
    dirty, none is between `enter` and `leave`, and none entered for a
    quiet time (seconds), within which an adopted value is marked dirty.
    """

    def enter(self) -> bool: ...

    def leave(self) -> None: ...


class UploadOrder(Protocol):
    """Whether an upload may skip the object's version check (`cachesvc.server.fences.Fences`)."""

    def sole_writer(self, key: bytes, version: int) -> AbstractContextManager[bool]:
        """True inside when no other node can have written `key` since this one accepted `version`; the
        context lasts the upload (the node that takes the key over waits for it)."""
        ...


class WriteBack:
    """The upload queue of dirty keys and the flusher thread.

    Args:
        store: object storage, where dirty values go.
        placement: the cache tiers holding the dirty values.
        state: the key state (which keys are dirty).
        lock: the engine lock, which guards `placement` and `state`.
        locks: the per-key locks the engine takes for writes; an upload holds
            its key's lock so a put or delete of the key waits for it.
        capacity: dirty keys queued before puts wait (then `Overloaded`).
        io_timeout: seconds a put waits for room in the queue.
        max_backoff: longest pause between failed uploads.
        observe: told each object version a version check reads (the engine's clock, so that a later put
            here is stamped past it).
    """

    def __init__(
        self,
        store: Tier,
        placement: Placement,
        state: KeyState[Level],
        lock: AbstractContextManager[Any],
        locks: KeyLocks,
        *,
        capacity: int = 4096,
        io_timeout: float = 60.0,
        max_backoff: float = 5.0,
        observe: Callable[[int], None] = lambda version: None,
    ) -> None:
        self._store = store
        self._observe = observe
        self._placement = placement
        self._state = state
        self._engine_lock = lock
        self._locks = locks
        self._queue = WriteBackQueue(capacity)
        self._io_timeout = io_timeout
        self._max_backoff = max_backoff
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self.order: UploadOrder | None = None
        """Says when an upload may skip the object's version check (a cluster node's; None: never)."""
        self.busy: Callable[[], bool] = lambda: False
        """Whether writers are under way that will queue keys soon (co-located clients writing into places):
        the flusher holds its uploads while so, as it does while puts are settling."""
        self.vouch: Callable[[bytes], None] | None = None
        """Checks an unvouched copy before it is uploaded (`ReadPath.vouch`): the object, and the peers that
        may hold a newer value (the stand-in that took writes while this node was down); a stale copy goes."""

    def start(self) -> None:
        """Starts the flusher thread."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="write-back", daemon=True)
            self._flusher.start()

    # -- the engine's side -------------------------------------------------

    def reserve(self, key: bytes) -> bool:
        """Waits for room in the queue for `key` (see `WriteBackQueue.reserve`): at most `io_timeout`, and no
        later than the caller's own deadline allows (`answer_within`)."""
        return self._queue.reserve(key, min(self._io_timeout, _answer_by.get() - time.monotonic()))

    def release(self, reserved: bool) -> None:
        """Gives back a slot `reserve` took for a put that failed."""
        self._queue.release(reserved)

    def queue(self, key: bytes, reserved: bool = False) -> None:
        """Queues the upload of `key`, which the engine marked dirty (in the slot `reserve` took, when `reserved`)."""
        self._queue.push(key, reserved)

    def dequeue(self, key: bytes) -> None:
        """Nothing is left to upload for `key` (deleted, or uploaded by its put)."""
        self._queue.discard(key)

    def upload(self, key: bytes) -> bool:
        """Uploads `key` now if it is dirty (caller holds the key's lock); returns whether it is clean."""
        with self._engine_lock:
            if not self._state.dirty(key):
                return True
            unvouched = self._state.unvouched(key)
        if unvouched and self.vouch is not None:
            # A dirty copy found at a restart (or after a move) may be older than a value a stand-in took and
            # has not uploaded yet: S3 alone cannot say so, and uploading it would make it the object and the
            # copy vouched (a Jepsen run read it so, from L2's file, after a node blinked). Its read's check
            # first, which asks those peers; it drops a stale copy.
            try:
                self.vouch(key)
            except Exception as exc:
                with self._lock:
                    self._counters["writeback_errors"] += 1
                log.warning("checking a write-back value before its upload failed, will retry: %s", exc)
                return False
            with self._engine_lock:
                if not self._state.dirty(key):
                    return True
        entry = self._dirty_entry(key)
        if entry is None:
            with self._engine_lock:
                self._state.clean(key)
            with self._lock:
                self._counters["writeback_lost"] += 1
            log.error("a write-back value was lost before upload: no readable copy is left")
            return True
        with self._engine_lock:
            version = self._state.version(key)
        order = self.order if version and isinstance(self._store, VersionedTier) else None
        try:
            with order.sole_writer(key, version) if order is not None else nullcontext(False) as sole:
                stored = None
                if not sole and version and isinstance(self._store, VersionedTier):
                    checked = against_store(self._store, key, entry, version)
                    if checked.seen:
                        self._observe(checked.seen)
                    if checked.superseded:
                        self._superseded(key)
                        return True
                    stored = checked.matched
                if stored is None:
                    self._store.put(key, entry.value, entry.checksum, version=version)
        except Exception as exc:
            with self._lock:
                self._counters["writeback_errors"] += 1
            log.warning("write-back upload failed, will retry: %s: %s", type(exc).__name__, exc)
            return False
        with self._engine_lock:
            if stored is not None:
                self._state.set_version(key, stored)  # the copy is the object's bytes: its version too
            self._state.vouch(key)  # object storage holds these bytes now: the copy is the newest
            if self._state.clean(key):
                # It passed its TTL while it awaited upload: it goes now.
                self._state.forget(key)
                self._placement.drop(key)
            else:
                self._placement.unhold(key, uploaded=True)
        with self._lock:
            self._counters["writebacks" if stored is None else "writeback_matched"] += 1
            if sole:
                self._counters["writeback_unchecked"] += 1
        self._queue.discard(key)
        return True

    def _superseded(self, key: bytes) -> None:
        """Object storage holds a newer value of dirty `key` than this cache: the cached one goes, not uploaded."""
        with self._engine_lock:
            self._state.forget(key)
            self._placement.drop(key)
        with self._lock:
            self._counters["writeback_superseded"] += 1
        log.info("a write-back value of %r was superseded in object storage; dropped, not uploaded", key[:64])
        self._queue.discard(key)

    def _dirty_entry(self, key: bytes) -> Entry | None:
        """The newest cached value of dirty `key`; None when no readable copy is left.

        Memory is read under the engine lock, local disk outside it: the
        caller holds the key's lock, so no put or delete of the key comes
        between, and a dirty value is never evicted, only demoted into a tier
        that lacks it (memory is read first, so a demotion cannot hide it).
        """
        with self._engine_lock:
            found = self._placement.read(key, self._placement.locked)
        if found is not None:
            return found[1]
        below = self._placement.unlocked
        if below is None:
            return None
        try:
            # A large value's file is uploaded from a map of it (no copy of the whole value here).
            return below.tier.get_mapped(key) if isinstance(below.tier, MappedTier) else below.tier.get(key)
        except CorruptValue:
            with self._engine_lock:
                self._placement.drop_corrupt(below, key)
            return None

    # -- the flusher -------------------------------------------------------

    def _upload_queued(self, key: bytes) -> bool:
        with self._locks(key):
            if self.upload(key):
                return True
        self._queue.push(key, reserved=False, settled=True)
        return False

    def _flush_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if self.order is None:  # a lone server: nothing else takes writes of its keys while one waits
                key = self._queue.pop(timeout=0.2, settle=SETTLE_SECONDS, hold=HOLD_SECONDS, busy=self.busy)
            else:
                # A cluster node uploads at once: while a value waits, a stand-in or a new owner may take
                # newer writes of the key, and the Jepsen runs read stale write-back values through that
                # window twice (after a node blinked, and after a cut healed) with the hold on cluster nodes.
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
        with self._engine_lock:
            return self._state.dirty_count()

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
        counters["writeback_queue"] = len(self._queue)
        return counters


SETTLE_SECONDS = 0.2
"""A lone server's flusher (not a cluster node's) uploads once no key was queued for this long: a burst of
puts (a checkpoint save: hundreds of chunks in a second) is uploaded after it, not under it. Measured on 2
cores (`bench/checkpoint_phases.py`, 256 MiB, co-located): the upload running under the save (reading each
file back, hashing it for the request, sending it) made the save's stall 3.3x DCP's to local disk, against
0.86x with nothing uploaded."""
HOLD_SECONDS = 2.0
"""The longest a queued key waits for puts to settle: under a steady stream of puts, uploads lag this far (a
queue more than half full does not wait)."""
BUSY_HOLD_SECONDS = 10.0
"""The longest a queued key waits while writers are under way (`WriteBack.busy`: co-located clients writing
into places). `HOLD_SECONDS` alone let the uploads start under 264 MiB saves that a loaded 2-core machine
stretched to 3-8 s (11-39 uploads under each; the server sees no put while a client writes 16 places)."""
BUSY_POLL_SECONDS = 0.05
"""How often the flusher asks, while it holds, whether writers are still under way."""


class WriteBackQueue:
    """Keys awaiting upload, at most `capacity` at a time; a key queued twice is uploaded once."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"write-back queue capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, float] = OrderedDict()
        """Each key, and when it was queued (monotonic)."""
        self._last_queued = -math.inf
        """When a put last queued a key (monotonic)."""
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
                    raise WriteBackFull(
                        f"write-back queue full ({self.capacity} keys awaiting upload to object storage); "
                        "retry later, or write through"
                    )
                self._cond.wait(left)

    def push(self, key: bytes, reserved: bool, *, settled: bool = False) -> None:
        """Queues `key`, using the slot `reserve` took when `reserved`; `settled`: a key queued again after a
        failed upload (ready at once, and no sign that puts are arriving)."""
        with self._cond:
            if reserved:
                self._reserved -= 1
            now = time.monotonic()
            self._keys[key] = -math.inf if settled else now
            self._keys.move_to_end(key)
            if not settled:
                self._last_queued = now
            self._cond.notify_all()

    def release(self, reserved: bool) -> None:
        """Gives back a slot taken by `reserve` that was not used."""
        if reserved:
            with self._cond:
                self._reserved -= 1
                self._cond.notify_all()

    def pop(
        self, timeout: float, *, settle: float = 0.0, hold: float = 0.0, busy: Callable[[], bool] = lambda: False
    ) -> bytes | None:
        """The oldest queued key, or None if none is ready within `timeout`. With `settle`, the oldest key is
        ready once no key was queued for `settle` seconds and `busy()` is false, or once it waited `hold`
        seconds itself (`BUSY_HOLD_SECONDS` while `busy()`), or once the queue is more than half full."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                ready_at = deadline
                if self._keys:
                    queued = next(iter(self._keys.values()))
                    ready_at = now
                    if settle > 0 and 2 * len(self._keys) <= self.capacity:
                        writing = busy()
                        settled = max(self._last_queued + settle, now + BUSY_POLL_SECONDS if writing else now)
                        ready_at = min(settled, queued + (max(hold, BUSY_HOLD_SECONDS) if writing else hold))
                    if now >= ready_at:
                        key, _ = self._keys.popitem(last=False)
                        self._cond.notify_all()
                        return key
                if now >= deadline:
                    return None
                self._cond.wait(min(ready_at, deadline) - now)

    def discard(self, key: bytes) -> None:
        with self._cond:
            if self._keys.pop(key, None) is not None:
                self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._keys)
