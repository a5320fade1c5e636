"""Prefetch plans as a client holds them: the `PrefetchPlan` protocol and the plan one server runs.

`CacheClient.prefetch` hands a server the keys a job will read, in order,
and returns a `PrefetchPlan`: the handle that extends the plan, reports the
reads done, waits for the fetches and ends it. One server's plan is a
`NodePrefetchPlan`, one Prefetch stream to it; a routed client splits a
plan over the keys' owners (`cacheclient.split_plan.SplitPrefetchPlan`), which
implements the same protocol over one `NodePrefetchPlan` per owner.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import grpc

from cacheclient._batches import PLAN_MESSAGE_BYTES, as_key
from cacheclient.errors import CacheClientError, DeadlineError, InvalidRequestError, LimitExceededError
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire.limits import MAX_PLAN_KEYS, MAX_PLAN_MESSAGE_KEYS

__all__ = ["PRIORITIES", "NodePrefetchPlan", "PrefetchPlan"]

PRIORITIES = {"low": pb.PRIORITY_LOW, "normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH}
"""A plan's priority by the name a caller gives it."""


class PrefetchPlan(Protocol):
    """A prefetch plan running on the cache; see `CacheClient.prefetch`. A context manager that ends it."""

    @property
    def planned(self) -> int:
        """Keys in the plan: those it started with and every `extend` since."""
        ...

    @property
    def progress(self) -> dict[str, Any]:
        """The server's last report: "planned", "fetched", "consumed", "window_used_bytes", "failed", "done"."""
        ...

    @property
    def error(self) -> CacheClientError | None:
        """Why the server ended the plan, if it failed."""
        ...

    def extend(self, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> None:
        """Appends keys to the plan, read after every key already in it."""
        ...

    def consumed(self, n: int) -> None:
        """Tells the server the first `n` keys of the plan have been read."""
        ...

    def wait(self, timeout: float) -> bool:
        """Waits until every key is fetched (or failed); returns whether it was."""
        ...

    def close(self) -> None:
        """Ends the plan: the server stops fetching for it."""
        ...

    def __enter__(self) -> PrefetchPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_priority(priority: str) -> pb.Priority:
    """The wire's priority of a priority name.

    Raises:
        InvalidRequestError: not "low", "normal" or "high".
    """
    if priority not in PRIORITIES:
        raise InvalidRequestError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    return PRIORITIES[priority]


class NodePrefetchPlan(PrefetchPlan):
    """A prefetch plan running on one server: one Prefetch stream, its progress read by a thread.

    Args:
        keys: the keys in the order they will be read.
        window_bytes: most bytes fetched ahead and not yet read, at once.
        sizes: the values' sizes, when known.
        priority: "low", "normal" or "high".
        start: opens the Prefetch stream over an iterator of its requests (the node client's call).
        failed: the typed error of a failed stream.
        address: the server's, for messages.
        timeout: how long the server has to take the plan, in seconds.

    Raises:
        InvalidRequestError: a bad priority or sizes.
        LimitExceededError: more than `MAX_PLAN_KEYS` keys, or a refusal by the server.
        DeadlineError: the server did not answer within `timeout`.
    """

    def __init__(
        self,
        keys: list[bytes],
        window_bytes: int,
        sizes: Sequence[int] | None,
        priority: str,
        *,
        start: Callable[[Iterator[pb.PrefetchRequest]], Any],
        failed: Callable[[grpc.RpcError], CacheClientError],
        address: str,
        timeout: float,
    ) -> None:
        self._priority = check_priority(priority)
        if sizes is not None and len(sizes) != len(keys):
            raise InvalidRequestError(f"sizes has {len(sizes)} entries for {len(keys)} keys")
        if len(keys) > MAX_PLAN_KEYS:
            raise LimitExceededError(
                f"a prefetch plan holds at most {MAX_PLAN_KEYS} keys (MAX_PLAN_KEYS), got {len(keys)}; "
                "split it into several plans"
            )
        self._outbox: queue.Queue[pb.PrefetchRequest | None] = queue.Queue()
        self._send_keys(keys, sizes, window_bytes, self._priority, first=True)
        self._planned = len(keys)
        self._progress: dict[str, Any] = {"planned": len(keys), "fetched": 0, "consumed": 0, "done": False}
        self._error: CacheClientError | None = None
        self._failed = failed
        self._answered = threading.Event()
        self._call = start(iter(self._outbox.get, None))
        self._reader = threading.Thread(target=self._read_progress, name="prefetch-progress", daemon=True)
        self._reader.start()
        # The server answers at once, with progress or a refusal (a bad plan,
        # max_prefetch_plans reached): a refused plan raises here, not later.
        if not self._answered.wait(timeout):
            self.close()
            raise DeadlineError(f"{address}: no answer to a prefetch plan within {timeout:g}s")
        if self._error is not None:
            raise self._error

    def _read_progress(self) -> None:
        try:
            for p in self._call:
                self._progress = {
                    "planned": p.planned,
                    "fetched": p.fetched,
                    "consumed": p.consumed,
                    "window_used_bytes": p.window_used_bytes,
                    "failed": p.failed,
                    "done": p.done,
                }
                self._answered.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._error = self._failed(exc)
        finally:
            self._answered.set()

    def _send_keys(
        self,
        keys: list[bytes],
        sizes: Sequence[int] | None,
        window_bytes: int,
        priority: pb.Priority,
        *,
        first: bool = False,
    ) -> None:
        # Messages stay well under the gRPC limit even with the longest keys;
        # the first message goes even with no keys (it sets the window).
        per_message = min(MAX_PLAN_MESSAGE_KEYS, PLAN_MESSAGE_BYTES // (max(map(len, keys), default=0) + 16))
        for start in range(0, max(len(keys), int(first)), per_message):
            self._outbox.put(
                pb.PrefetchRequest(
                    keys=keys[start : start + per_message],
                    sizes=list(sizes[start : start + per_message]) if sizes is not None else [],
                    window_bytes=window_bytes if start == 0 else 0,
                    priority=priority,
                )
            )

    @property
    def planned(self) -> int:
        """Keys in the plan: those it started with and every `extend` since."""
        return self._planned

    @property
    def progress(self) -> dict[str, Any]:
        """The server's last report: "planned", "fetched", "consumed", "window_used_bytes", "failed", "done"."""
        return self._progress

    @property
    def error(self) -> CacheClientError | None:
        """Why the server ended the plan, if it failed."""
        return self._error

    def extend(self, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> None:
        """Appends keys to the plan, read after every key already in it (a loop's next pass).

        The server learns them in order after the keys sent before; its
        progress counts them once it has (`progress["planned"]`). Keys the
        plan already holds may come again: each occurrence is a read.

        Args:
            keys: the keys, in the order they will be read.
            sizes: their values' sizes, when known; they keep the window exact.

        Raises:
            InvalidRequestError: sizes that do not match keys.
            LimitExceededError: the plan would hold more than `MAX_PLAN_KEYS`
                keys; the plan is unchanged (start another).
        """
        wanted = [as_key(k) for k in keys]
        if sizes is not None and len(sizes) != len(wanted):
            raise InvalidRequestError(f"sizes has {len(sizes)} entries for {len(wanted)} keys")
        if self._planned + len(wanted) > MAX_PLAN_KEYS:
            raise LimitExceededError(
                f"a prefetch plan holds at most {MAX_PLAN_KEYS} keys (MAX_PLAN_KEYS); it has {self._planned} "
                f"and {len(wanted)} more were added: start another plan"
            )
        if not wanted:
            return
        self._planned += len(wanted)
        self._send_keys(wanted, sizes, 0, self._priority)

    def consumed(self, n: int) -> None:
        """Tells the server the first `n` keys of the plan have been read."""
        self._outbox.put(pb.PrefetchRequest(consumed=n))

    def wait(self, timeout: float) -> bool:
        """Waits until the server reports every key fetched (or failed); returns whether it did."""
        deadline = time.monotonic() + timeout
        while not self.progress.get("done") and self._reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return bool(self.progress.get("done"))

    def close(self) -> None:
        """Ends the plan: the server stops fetching for it."""
        self._outbox.put(None)
        self._call.cancel()
        self._reader.join(5.0)
