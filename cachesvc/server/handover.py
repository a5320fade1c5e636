"""Handover: after a move, a node offers each new owner the keys it caches that moved to it, hot first.

A join or a drain gives keys new owners, which read each from its previous
owner at its first read (peer fill, `cachesvc.server.peers`), one read at a
time, while the client that asked waits: the first epoch after a join pays
a peer fill per moved key. So the previous owner, once it follows the map
that moved them (`Handover.moved`), sends each new owner a prefetch plan of
the moved keys it caches (L1's first: its hot set; then L2's), at low
priority: the new owner fills them through its own fill chain as it would
for a read (from this node first, each copy checked against object storage
a listing page at a time, `cachesvc.engine.vouching.ListedPages`), in the
background, ahead of its clients. Nothing is served on this node's word:
the new owner's checks are the reads' own.

Bounds: one handover at a time (a newer move stops the one under way),
at most `MAX_PLAN_KEYS` keys and `window_bytes` fetched per new owner, at
most `seconds` per plan; a new owner that refuses (its `max_prefetch_plans`
taken, or down) is skipped and logged. Keys of cache-only namespaces are
not offered: the new owner cannot fill them (nothing to check them against).
The new owner is fenced first (`Fences.fence`), so it follows the map that
made it the owner before it plans: by an older one, it would not know this
node as the keys' previous owner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from cacheclient.errors import CacheClientError
from cacheclient.node import NodeClient
from cacheclient.wire.limits import MAX_PLAN_KEYS
from cacheclient.wire.placement import PlacementMap

__all__ = ["Handover"]

log = logging.getLogger(__name__)


class Handover:
    """Offers moved keys to their new owners (see the module docstring).

    Args:
        address: this node's address in the placement.
        cached: the keys this node caches, hottest tier first, at most the count given.
        offered: whether a key may be offered (not a cache-only namespace's).
        replicas: how many nodes hold a key.
        fence: fences a peer for the current move (it follows the map first).
        count: adds to a Stats counter (handover_keys offered, handover_fetched by the new owners,
            handover_errors).
        token: the bearer token for the plans (the admin token, or the one token).
        tls_ca: the PEM roots that sign peers' certificates, when they serve TLS.
        window_bytes: bytes a new owner fetches for one handover at most (its plan's window).
        seconds: how long a plan may run before it is closed.
    """

    def __init__(
        self,
        address: Callable[[], str],
        cached: Callable[[int], Sequence[bytes]],
        offered: Callable[[bytes], bool],
        replicas: Callable[[bytes], int],
        fence: Callable[[str], None],
        count: Callable[[str, int], None],
        *,
        token: str = "",
        tls_ca: bytes | None = None,
        window_bytes: int = 256 << 20,
        seconds: float = 60.0,
    ) -> None:
        self._address = address
        self._cached = cached
        self._offered = offered
        self._replicas = replicas
        self._fence = fence
        self._count = count
        self._token = token
        self._tls_ca = tls_ca
        self._window = window_bytes
        self._seconds = seconds
        self._mu = threading.Lock()
        self._round = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def moved(self, before: PlacementMap, after: PlacementMap) -> None:
        """The map moved from `before` to `after`: offers the keys that left this node to their new owners, in
        the background (a handover under way stops at its next plan)."""
        if self._window <= 0 or not after.slots or not before.slots:
            return
        with self._mu:
            if self._closed:
                return
            self._round += 1
            round_ = self._round
            self._thread = threading.Thread(
                target=self._run, args=(before, after, round_), name="handover", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        with self._mu:
            self._closed = True
            self._round += 1

    def _current(self, round_: int) -> bool:
        with self._mu:
            return round_ == self._round and not self._closed

    def _run(self, before: PlacementMap, after: PlacementMap, round_: int) -> None:
        me = self._address()
        by_owner: dict[str, list[bytes]] = defaultdict(list)
        for key in self._cached(MAX_PLAN_KEYS):
            replicas = self._replicas(key)
            was = before.candidates(key)[:replicas]
            now = after.candidates(key)[:replicas]
            if me not in was or me in now or not self._offered(key):
                continue
            for owner in now:
                if owner not in was and len(by_owner[owner]) < MAX_PLAN_KEYS:
                    by_owner[owner].append(key)
        for owner, keys in by_owner.items():
            if not self._current(round_):
                return
            began = time.monotonic()
            try:
                self._fence(owner)
                self._offer(owner, keys, round_)
            except CacheClientError as exc:
                self._count("handover_errors", 1)
                log.warning("handing %d moved keys over to %s failed: %s", len(keys), owner, exc)
                continue
            log.info(
                "handed %d moved keys over to %s in %.2f s (it read them from here ahead of its clients)",
                len(keys),
                owner,
                time.monotonic() - began,
            )

    def _offer(self, owner: str, keys: list[bytes], round_: int) -> None:
        client = NodeClient(owner, timeout=10.0, token=self._token or None, tls_ca=self._tls_ca)
        try:
            plan = client.prefetch(keys, window_bytes=self._window, priority="low")
            try:
                self._count("handover_keys", len(keys))
                deadline = time.monotonic() + self._seconds
                while self._current(round_) and time.monotonic() < deadline:
                    if plan.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                        break
                progress = plan.progress
                self._count("handover_fetched", int(progress.get("fetched", 0)))
            finally:
                plan.close()
        finally:
            client.close()
