"""Handles that belong to one process: gRPC channels, boto3 clients, LMDB environments.

None of them survives `fork`: a child that uses its parent's gRPC channel,
boto3 connection pool or LMDB environment hangs, reads another process's
sockets, or corrupts the parent's state. PyTorch DataLoader workers fork.
`ProcessLocal` makes its value lazily in the process that first asks for it
and forgets it in a forked child (an `os.register_at_fork` hook), which then
makes its own on first use.

A forked child never closes or finalizes what it inherited: closing an LMDB
environment touches a mapping the parent still uses, and a gRPC object
finalized in the child can wait forever on a lock a parent thread held. The
inherited values are kept referenced for the life of the child instead.
The garbage collector is off across a fork and the child freezes every object
it inherited before turning it back on (the pattern `gc.freeze`'s
documentation gives), so no garbage of the parent's (a finished gRPC call
in a reference cycle, say) is ever collected, and finalized, in the child.
A full collection before every fork did that before: about 80 ms per
DataLoader worker per epoch with torch imported, paid by every DataLoader of
a process that imported this package.

A fork waits for the gRPC calls this package's background threads have
under way (`background_call`: a co-located arena's mapping, a routing
client's map refresh, a KV index's sync round), up to `FORK_WAIT_SECONDS`:
a child forked while a thread of its parent is inside a gRPC call can hang
(gRPC's own caveat), and these calls start on their own, just before a
DataLoader forks its workers as often as not.

gRPC's library stays initialised from a process's first channel to its
exit (`keep_grpc_initialised`). gRPC counts its users (each channel one) and,
when the count falls to zero, hands the teardown to a thread of its own
that holds gRPC's init lock while it runs; a fork in those milliseconds
leaves the child that lock, held forever, and the child's first channel
waits on it for good. That happened to a DataLoader worker forked just
after its parent closed its last client. Bare channels reproduced it, with
the worker's stack frame for frame, in 7 of 1,800 forks made just after the
parent closed its last channel, and in none of 1,600 with one reference
kept; `tests/test_process_local.py` checks that the teardown never starts.

Used by the server too (the S3 tier's boto3 client), which may import the
client package but never the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["FORK_WAIT_SECONDS", "ProcessLocal", "background_call", "keep_grpc_initialised"]

T = TypeVar("T")

FORK_WAIT_SECONDS = 8.0
"""How long a fork waits for the background calls under way in its process (`background_call`)."""

_instances: weakref.WeakSet[ProcessLocal[Any]] = weakref.WeakSet()
# What forked children inherited, kept alive so that it is never finalized there.
_inherited: list[Any] = []


@functools.cache
def keep_grpc_initialised() -> Any:
    """Keeps gRPC's library initialised in this process until it exits (see the module docstring): one
    idle channel, never connected (a channel connects on its first call) and never closed, returned. Call it
    before making a channel; a forked child inherits the reference with the rest of its parent's memory."""
    import grpc

    return grpc.insecure_channel("unix:/nonexistent/cacheclient-keeps-grpc-initialised")


class ProcessLocal(Generic[T]):
    """A value made on first use in each process, and forgotten, unclosed, in a forked child.

    Thread-safe: concurrent first calls of `get` make one value. Pickles
    without its value (for `spawn` workers); `make` and `close` must then be
    picklable (functions or bound methods, not lambdas).

    Args:
        make: builds the value, in the process that will use it.
        close: releases a value in the process that made it (`close()`); None
            when there is nothing to release.
    """

    def __init__(self, make: Callable[[], T], close: Callable[[T], None] | None = None) -> None:
        self._make = make
        self._close = close
        self._value: T | None = None
        self._pid = -1
        self._lock = threading.Lock()
        _instances.add(self)

    def get(self) -> T:
        """This process's value, made now if it has none yet."""
        value = self._value
        if value is not None and self._pid == os.getpid():
            return value
        with self._lock:
            if self._value is None or self._pid != os.getpid():
                self._value = self._make()
                self._pid = os.getpid()
            return self._value

    def peek(self) -> T | None:
        """This process's value if it has made one, else None; never makes one."""
        return self._value if self._pid == os.getpid() else None

    def close(self) -> None:
        """Releases this process's value, if any; the next `get` makes a new one."""
        with self._lock:
            value, mine = self._value, self._pid == os.getpid()
            self._value, self._pid = None, -1
        if value is not None and mine and self._close is not None:
            self._close(value)

    def _forget_inherited(self) -> None:
        if self._value is not None:
            _inherited.append(self._value)
        self._value = None
        self._pid = -1
        self._lock = threading.Lock()  # a parent thread may have held the old one at the fork

    def __getstate__(self) -> dict[str, Any]:
        return {"make": self._make, "close": self._close}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["make"], state["close"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ProcessLocal({self._make!r}, made={self.peek() is not None})"


class _Collector:
    """The collector's state across forks: off from the first fork begun to the last one ended (forks from
    several threads may overlap), then as it was before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.forks = 0
        self.was_on = False

    def before_fork(self) -> None:
        with self.lock:
            if self.forks == 0:
                self.was_on = gc.isenabled()
                gc.disable()
            self.forks += 1

    def after_fork_in_parent(self) -> None:
        with self.lock:
            self.forks -= 1
            if self.forks == 0 and self.was_on:
                gc.enable()

    def after_fork_in_child(self) -> None:
        # What the child inherited, garbage included, is the parent's to collect, never the child's: frozen
        # before the collector runs here at all (it was off across the fork).
        gc.freeze()
        for local in list(_instances):
            local._forget_inherited()
        self.lock = threading.Lock()  # another parent thread may have held it at the fork
        self.forks = 0
        if self.was_on:
            gc.enable()


_collector = _Collector()
os.register_at_fork(
    before=_collector.before_fork,
    after_in_parent=_collector.after_fork_in_parent,
    after_in_child=_collector.after_fork_in_child,
)


class _BackgroundCalls:
    """The background calls under way in this process (`background_call`), which a fork waits for."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.under_way = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self.changed:
            self.under_way += 1
        try:
            yield
        finally:
            with self.changed:
                self.under_way -= 1
                self.changed.notify_all()

    def before_fork(self) -> None:
        deadline = time.monotonic() + FORK_WAIT_SECONDS
        with self.changed:
            while self.under_way and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(left)

    def after_fork_in_child(self) -> None:
        # The parent's background threads are not here (and one may have held the condition's lock).
        self.changed = threading.Condition()
        self.under_way = 0


_background = _BackgroundCalls()
os.register_at_fork(before=_background.before_fork, after_in_child=_background.after_fork_in_child)


def background_call() -> contextlib.AbstractContextManager[None]:
    """Marks a gRPC call a background thread of this package makes (bounded by its deadline) as under way:
    a fork in this process waits for it to end, up to `FORK_WAIT_SECONDS` (see the module docstring)."""
    return _background.call()
