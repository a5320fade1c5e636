"""Answers in request order while the slow ones are fetched concurrently, a bounded number at a time.

`pipelined` is how `Engine.iter_many` fills the misses of one request: the
answers already known go out at once, each missing one is submitted to a
pool in key order, at most `limit` in flight, and the answers are yielded in
order as they complete, so the first values can go out while later ones are
still being fetched. Closing the iterator early cancels what has not started.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

from cachesvc.errors import Abandoned

__all__ = ["pipelined"]

T = TypeVar("T")


def pipelined(
    known: Sequence[T],
    missing: Sequence[int],
    submit: Callable[[int], Future[T]],
    limit: int,
    stop: Future[Any] | None = None,
) -> Iterator[T]:
    """`known` in order, each index in `missing` replaced by the result of `submit(index)`, `limit` at a time.

    Args:
        known: the answers, in request order (those at `missing` are placeholders).
        missing: the indexes to fetch, ascending.
        submit: starts the fetch of one index.
        limit: fetches in flight at once.
        stop: done once the answers are no longer wanted: the wait ends and
            the fetches not yet started are cancelled.

    Raises:
        Abandoned: `stop` was done while a fetch was awaited.
    """
    pending = iter(missing)
    submitted: dict[int, Future[T]] = {}
    running: set[Future[Any]] = set()

    def top_up() -> None:
        while len(running) < limit:
            j = next(pending, None)
            if j is None:
                return
            future = submit(j)
            submitted[j] = future
            running.add(future)

    try:
        top_up()
        for i, answer in enumerate(known):
            future = submitted.pop(i, None)
            if future is None:
                # Known already: fetches start in index order and one more starts after each is taken,
                # so a missing index has always been submitted by the time it is reached.
                yield answer
                continue
            while not future.done():
                if stop is not None and stop.done():
                    raise Abandoned("the caller left before its reads finished: fills not yet started cancelled")
                finished, _ = wait(running if stop is None else {*running, stop}, return_when=FIRST_COMPLETED)
                running.difference_update(finished)
                top_up()
            running.discard(future)
            top_up()
            yield future.result()
    finally:
        for future in submitted.values():
            future.cancel()
