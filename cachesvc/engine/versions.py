"""Value versions: a hybrid logical clock, one per engine, that stamps every value the node accepts.

A version is one unsigned 64-bit integer (`stamp`): wall-clock milliseconds
in the high 42 bits (good until the year 2109), a counter in the next 14,
and the clock's tag in the low 8 (random per engine, so two nodes' stamps of
one millisecond differ: a tie cannot happen but between two nodes with the
same tag). The node that accepts a
write (a put) gives the value the clock's next stamp; the stamp travels with
the value into L1 (the key state), L2 (the record header,
`cacheclient.wire.record`) and object storage (the object's metadata,
`cacheclient.wire.s3.META_VERSION`). Comparing two stamps orders two values
of one key: the larger one was written later.

The clock never goes backwards and never hands out a stamp twice: each
`next()` is past the last one, and past every stamp the node has seen
(`observe`: a value filled from object storage or a peer, a version read
back from L2 at start-up, an object's version in a HEAD). So a write that
follows, on this node, anything it has seen of a key gets a larger stamp,
whatever the wall clocks say; between nodes, a writer that writes a key
through one node and then (after that put returned) through another gets a
larger stamp the second time as long as the second node's wall clock is not
behind the first's by more than the time between the two puts (NTP keeps
clocks within milliseconds; the puts of one writer are at least a round trip
apart). 0 means "unknown": a value written before versions existed.

Cost: one lock, one `time.time()` and a few integer operations per put.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

__all__ = ["COUNTER_BITS", "TAG_BITS", "VersionClock", "stamp"]

TAG_BITS = 8
"""Low bits of a version that tell the clocks of different engines apart."""
COUNTER_BITS = 14 + TAG_BITS
"""Low bits of a version below the milliseconds: the counter within one millisecond, then the tag."""


def stamp(millis: int, counter: int = 0, tag: int = 0) -> int:
    """The version of wall-clock millisecond `millis`, `counter` within it, by the clock tagged `tag`."""
    return (millis << COUNTER_BITS) | (counter << TAG_BITS) | tag


class VersionClock:
    """A hybrid logical clock (see the module docstring); thread-safe.

    Args:
        wall_clock: Unix seconds (injected in tests).
        tag: the low bits of every stamp this clock hands out (default: random).
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time, tag: int | None = None) -> None:
        self._wall_clock = wall_clock
        self.tag = secrets.randbelow(1 << TAG_BITS) if tag is None else tag
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        """A stamp larger than every stamp handed out or observed so far."""
        now = stamp(int(self._wall_clock() * 1000), 0, self.tag)
        with self._lock:
            last = self._last
            self._last = now if now > last else (((last >> TAG_BITS) + 1) << TAG_BITS) | self.tag
            return self._last

    def observe(self, version: int) -> None:
        """Moves the clock past `version`, a stamp seen elsewhere (a peer, object storage, L2)."""
        if version > self._last:
            with self._lock:
                if version > self._last:
                    self._last = version

    @property
    def last(self) -> int:
        """The largest stamp handed out or observed."""
        return self._last
