"""Writes done behind a read: one thread, a bounded backlog, the caller's turn when it is full.

A value filled from object storage into L1 is also written to L2
(`l2.fill_on_read`), so a restarted server keeps what it read. The reader
need not wait for that: its value is in L1, and every reader waiting on the
fill was answered. `Behind` takes such writes and runs them in order on one
thread (LMDB has one writer at a time anyway); a write that would take the
backlog past `max_bytes` is refused, and the caller makes it itself, so a
disk that falls behind slows the reads that fill it, as before, rather than
queue without bound. `close` waits for the backlog.

A write may also be *deferred* (`defer`): it holds no bytes (it reads them
when it runs) and waits until the server was quiet for `quiet` seconds (no
write submitted or deferred, and the count `activity` returns, the reads
served, unchanged), or until `hurry` is called. A cold pass over a dataset
that fits in L1, read by co-located clients from L1 itself, then does not
pay, on the cores it shares with its readers, nor do the passes after it,
for L2 copies nobody reads until a restart; they are written when reading
stops. Immediate writes go first. At most `max_deferred` wait; `close`
drops the deferred ones (the engine keeps L1 in L2 as it closes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["Behind"]

log = logging.getLogger(__name__)


class Behind:
    """One thread that runs queued writes in order, at most `max_bytes` of them waiting (see the module)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        quiet: float = 0.0,
        max_deferred: int = 1 << 16,
        activity: Callable[[], int] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.quiet = quiet
        self.max_deferred = max_deferred
        self._clock = time.monotonic
        self._activity = activity
        self._seen = activity() if activity is not None else 0
        self._queue: deque[tuple[Callable[[], None], int]] = deque()
        self._deferred: deque[Callable[[], None]] = deque()
        self._bytes = 0
        self._last = self._clock()
        self._hurry = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.ran = 0
        self.refused = 0

    def submit(self, write: Callable[[], None], nbytes: int) -> bool:
        """Queues `write` (of `nbytes`); False when the backlog has no room (or it is closed): run it yourself."""
        with self._cond:
            self._last = self._clock()
            if self._closed or self._bytes + nbytes > self.max_bytes:
                self.refused += 1
                return False
            self._queue.append((write, nbytes))
            self._bytes += nbytes
            self._start()
            return True

    def defer(self, write: Callable[[], None]) -> bool:
        """Queues `write` to run once the server is quiet (see the module); False when deferring is off, full
        or closed: submit it instead."""
        with self._cond:
            self._last = self._clock()
            if self._closed or self.quiet <= 0 or len(self._deferred) >= self.max_deferred:
                return False
            self._deferred.append(write)
            self._start()
            return True

    def hurry(self) -> None:
        """Runs the deferred writes now, without waiting for quiet (L1 is filling up: its victims should be on
        disk already)."""
        if not self._deferred:  # the common case, on every fill: no lock taken
            return
        with self._cond:
            if self._deferred and not self._hurry:
                self._hurry = True
                self._cond.notify_all()

    @property
    def backlog_bytes(self) -> int:
        return self._bytes

    @property
    def deferred_waiting(self) -> int:
        return len(self._deferred)

    def _start(self) -> None:
        """Wakes the thread (started on first use). Holds `_cond`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fill-behind", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _next(self) -> tuple[Callable[[], None], int, bool] | None:
        """The next write to run, waiting for one; None once closed and drained. Holds `_cond`."""
        while True:
            if self._queue:
                write, nbytes = self._queue[0]
                return write, nbytes, False
            if self._closed:
                return None
            if self._deferred:
                if self._activity is not None and (seen := self._activity()) != self._seen:
                    self._seen, self._last = seen, self._clock()
                idle = self._clock() - self._last
                if self._hurry or idle >= self.quiet:
                    return self._deferred[0], 0, True
                self._cond.wait(self.quiet - idle)
            else:
                self._hurry = False
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                picked = self._next()
            if picked is None:
                return
            write, nbytes, deferred = picked
            try:
                write()
            except Exception:  # one write lost (its value stays in L1 and object storage); the next go on
                log.exception("a write behind a read failed")
            with self._cond:
                if deferred:
                    if self._deferred and self._deferred[0] is write:
                        self._deferred.popleft()
                else:
                    self._queue.popleft()
                    self._bytes -= nbytes
                self.ran += 1
                self._cond.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Refuses new writes, drops the deferred ones and waits (up to `timeout` seconds) for the queued ones."""
        with self._cond:
            self._closed = True
            self._deferred.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%d bytes of writes behind reads were still queued after %.0f s", self._bytes, timeout)
