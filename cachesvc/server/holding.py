"""Whether this cache node may hold write-back values object storage lacks, as the metadata shard knows it.

A write-back value lives on the node that took it until it is uploaded. If
that node dies first, the value is on its disk alone: the node that stands in
for it (the placement moved its slots) has object storage's older value at
best. So the shard is told before the first such value is acknowledged
(`MetaClient.set_holding(address, True)`, replicated before it returns), and
the placement map names the node among its `holders`. While a holder is down
(or does not answer a reader), every node but the key's replicas withholds
its write-back keys (`PlacementMap.withheld`; the server answers
FAILED_PRECONDITION) until it is back, when its copy is read from it, or
until an operator removes it from the shard (`cachectl forget`), accepting the
loss of what only it held.

`WriteBackHolding` is the engine's `WriteBackGate`:

* `enter`, before a write-back value is acknowledged: nothing while the shard
  already knows (a lock and two integers); otherwise one shard write, with a
  deadline. When the shard cannot be told (down, no quorum, this node not
  registered yet), `enter` is False and the engine writes the value through
  to object storage instead: slower, never unsafe.
* a thread that, every `check_seconds`, tells the shard this node holds none
  once nothing is dirty, nothing is between `enter` and `leave`, and nothing
  entered for `quiet_seconds` (one shard write per quiet period, not per put);
  and that tells it the node holds values when dirty ones are found that it
  did not let in (read back from L2 after a restart, or the shard was rebuilt
  from empty or forgot the node meanwhile).
* `close`, after the engine's last uploads: holds none, if that is so.

At start what the shard says is unknown, so the first `enter` tells it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

__all__ = ["WriteBackHolding"]

log = logging.getLogger(__name__)


class WriteBackHolding:
    """See the module docstring.

    Args:
        declare: tells the shard whether this node holds values (raises when it cannot).
        dirty: how many write-back values here are not uploaded yet.
        quiet_seconds: how long after the last value entered the node may say it holds none.
        check_seconds: how often the thread looks.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        declare: Callable[[bool], None],
        dirty: Callable[[], int],
        *,
        quiet_seconds: float = 10.0,
        check_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._declare = declare
        self._dirty = dirty
        self._quiet = quiet_seconds
        self._check = check_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._held: bool | None = None
        """What the shard was last told (None: not known)."""
        self._inside = 0
        self._last = -math.inf
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool | None:
        """What the shard was last told: True, False, or None when not known."""
        return self._held

    def enter(self) -> bool:
        """Before a write-back value is acknowledged: whether the shard knows this node may hold one."""
        with self._lock:
            if self._held is not True and not self._tell(True):
                return False
            self._inside += 1
            self._last = self._clock()
            return True

    def leave(self) -> None:
        """The value that entered is marked dirty (or failed)."""
        with self._lock:
            self._inside -= 1
            self._last = self._clock()

    def forget(self) -> None:
        """The shard may no longer know (it was rebuilt, or this node rejoined): tell it again."""
        with self._lock:
            self._held = None

    def check(self, *, quiet: bool = True) -> None:
        """Tells the shard what holds now, when that changed (see the module docstring); `quiet=False`
        skips the quiet time (the engine is closed: nothing enters any more)."""
        with self._lock:
            if self._inside:
                return
            dirty = self._dirty()
            if dirty and self._held is not True:
                self._tell(True)
            elif not dirty and self._held is not False and (not quiet or self._clock() - self._last >= self._quiet):
                self._tell(False)

    def _tell(self, holding: bool) -> bool:
        """Tells the shard (lock held); whether it took it."""
        try:
            self._declare(holding)
        except Exception as exc:  # the shard is down, has no leader, or does not know this node yet
            what = "values" if holding else "none"
            log.warning("could not tell the metadata shard this node holds %s: %s", what, exc)
            return False
        self._held = holding
        log.info("told the metadata shard this node %s", "may hold write-back values" if holding else "holds none")
        return True

    def start(self) -> None:
        """Starts the thread that says when this node holds none (or some it did not let in)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="write-back-holding", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._check):
            self.check()

    def close(self) -> None:
        """Stops the thread; after the engine's last uploads, tells the shard this node holds none if so."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.check(quiet=False)
