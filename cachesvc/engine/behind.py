"""Writes done behind a read: one thread, a bounded backlog, the caller's turn when it is full.

A value filled from object storage into L1 is also written to L2
(`l2.fill_on_read`), so a restarted server keeps what it read. The reader
need not wait for that: its value is in L1, and every reader waiting on the
fill was answered. `Behind` takes such writes and runs them in order on one
thread (LMDB has one writer at a time anyway); a write that would take the
backlog past `max_bytes` is refused, and the caller makes it itself, so a
disk that falls behind slows the reads that fill it, as before, rather than
queue without bound. `close` waits for the backlog.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Behind"]

log = logging.getLogger(__name__)


class Behind:
    """One thread that runs queued writes in order, at most `max_bytes` of them waiting (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._queue: deque[tuple[Callable[[], None], int]] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.ran = 0
        self.refused = 0

    def submit(self, write: Callable[[], None], nbytes: int) -> bool:
        """Queues `write` (of `nbytes`); False when the backlog has no room (or it is closed): run it yourself."""
        with self._cond:
            if self._closed or self._bytes + nbytes > self.max_bytes:
                self.refused += 1
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fill-behind", daemon=True)
                self._thread.start()
            self._queue.append((write, nbytes))
            self._bytes += nbytes
            self._cond.notify()
            return True

    @property
    def backlog_bytes(self) -> int:
        return self._bytes

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                write, nbytes = self._queue[0]
            try:
                write()
            except Exception:  # one write lost (its value stays in L1 and object storage); the next go on
                log.exception("a write behind a read failed")
            with self._cond:
                self._queue.popleft()
                self._bytes -= nbytes
                self.ran += 1
                self._cond.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Refuses new writes and waits (up to `timeout` seconds) for the queued ones."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%d bytes of writes behind reads were still queued after %.0f s", self._bytes, timeout)
