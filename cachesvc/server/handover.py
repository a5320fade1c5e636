"""Handover: after a move, a node hands each new owner the moved keys it caches, in batches.

A join or a drain gives keys new owners, which read each from its previous
owner at its first read (peer fill, `cachesvc.server.peers`), one read at a
time, while the client that asked waits: the first epoch after a join pays
a peer fill per moved key. So the previous owner, once it follows the map
that moved them (`Handover.moved`), sends each new owner the clean copies of
the moved keys it caches (in name order when all fit the window, so the new
owner's listing pages follow one another; otherwise L1's first, its hot set,
then L2's) in PutMany batches marked `ROUTE_HANDOVER`. The new owner does
not take them as writes: it holds them in `HandedOver`, the first source of
its fill chain, and fills each key from there as a read would (`Engine.prefetch`): the copy is checked
against object storage (a listing page at a time,
`cachesvc.engine.vouching.ListedPages`, or a HEAD where a listing cannot
tell), a write or a delete of the key meanwhile keeps it out (`races.Fills`),
and a key already cached is left as it is. Nothing is served on the previous
owner's word, so a batch from anyone holding a data token can only cache
bytes object storage holds under those names.

Bounds: one handover at a time (a newer move stops the one under way), at
most `window_bytes` per new owner, batches of `BATCH_BYTES`. `HandedOver`
holds a batch's copies only while the batch's prefetches run (what they did
not take is dropped: a copy kept for a later fill could be older than a
value the cluster took since), at most `max_bytes`, and none longer than
`seconds`. Only write-through keys are handed over (`Engine.handed_over`):
a cache-only key has nothing to check a copy against, and a write-back key
may have a newer value on another node that object storage does not have
yet (a handed-over copy checked against object storage alone was read
stale so, in a Jepsen run after an undrain); a read of those asks the
previous owner as before, which uploads first. The new owner is fenced
first (`Fences.fence`), so it follows the map that made it the owner before
the batch comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence

from cacheclient.errors import CacheClientError
from cacheclient.node import NodeClient
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire.limits import MAX_BATCH_KEYS, PUT_MANY_BYTES
from cacheclient.wire.names import ROUTE_HANDOVER, ROUTE_METADATA
from cacheclient.wire.placement import PlacementMap
from cacheclient.wire.record import checksum
from cachesvc.tiers.base import Entry

__all__ = ["HandedOver", "Handover"]

log = logging.getLogger(__name__)

BATCH_BYTES = min(PUT_MANY_BYTES, 2 << 20)
"""Bytes of values per handover batch."""


class Handover:
    """Hands moved keys over to their new owners (see the module docstring).

    Args:
        address: this node's address in the placement.
        cached: the keys this node caches, hottest tier first, at most the count given.
        copy: a key's clean cached value, or None (dirty, cache-only, gone).
        replicas: how many nodes hold a key.
        fence: fences a peer for the current move (it follows the map first).
        count: adds to a Stats counter (handover_keys sent, handover_bytes, handover_errors).
        held_bytes: the bytes this node's cache tiers hold (to tell whether every moved key fits the window).
        token: the bearer token for the batches (the admin token, or the one token).
        tls_ca: the PEM roots that sign peers' certificates, when they serve TLS.
        window_bytes: bytes handed to one new owner at most per move.
    """

    def __init__(
        self,
        address: Callable[[], str],
        cached: Callable[[int], Sequence[bytes]],
        copy: Callable[[bytes], bytes | None],
        replicas: Callable[[bytes], int],
        fence: Callable[[str], None],
        count: Callable[[str, int], None],
        held_bytes: Callable[[], int],
        *,
        token: str = "",
        tls_ca: bytes | None = None,
        window_bytes: int = 256 << 20,
    ) -> None:
        self._address = address
        self._cached = cached
        self._copy = copy
        self._replicas = replicas
        self._fence = fence
        self._count = count
        self._held_bytes = held_bytes
        self._token = token
        self._tls_ca = tls_ca
        self._window = window_bytes
        self._mu = threading.Lock()
        self._round = 0
        self._closed = False

    def moved(self, before: PlacementMap, after: PlacementMap) -> None:
        """The map moved from `before` to `after`: hands the keys that left this node to their new owners, in
        the background (a handover under way stops at its next batch)."""
        if self._window <= 0 or not after.slots or not before.slots:
            return
        with self._mu:
            if self._closed:
                return
            self._round += 1
            round_ = self._round
        threading.Thread(target=self._run, args=(before, after, round_), name="handover", daemon=True).start()

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
        for key in self._cached(1 << 20):
            replicas = self._replicas(key)
            was = before.candidates(key)[:replicas]
            now = after.candidates(key)[:replicas]
            if me not in was or me in now:
                continue
            for owner in now:
                if owner not in was:
                    by_owner[owner].append(key)
        in_order = self._held_bytes() <= self._window
        for owner, keys in by_owner.items():
            if not self._current(round_):
                return
            if in_order:
                # All of them fit the window: in name order, so the new owner checks them against consecutive
                # listing pages (about one request per 1,000 names), not pages begun at names in hot order.
                keys.sort()
            began = time.monotonic()
            try:
                self._fence(owner)
                sent, size = self._hand(owner, keys, round_)
            except CacheClientError as exc:
                self._count("handover_errors", 1)
                log.warning("handing moved keys over to %s failed: %s", owner, exc)
                continue
            log.info(
                "handed %d moved keys (%d bytes) over to %s in %.2f s", sent, size, owner, time.monotonic() - began
            )

    def _hand(self, owner: str, keys: list[bytes], round_: int) -> tuple[int, int]:
        """Sends `owner` the clean copies of `keys`, batch by batch, up to the window; (keys, bytes) sent."""
        client = NodeClient(owner, timeout=30.0, token=self._token or None, tls_ca=self._tls_ca)
        client = client.with_metadata(((ROUTE_METADATA, ROUTE_HANDOVER),))
        sent = total = 0
        try:
            batch: list[pb.PutRequest] = []
            size = 0
            for key in keys:
                if total + size >= self._window or not self._current(round_):
                    break
                value = self._copy(key)
                if value is None:
                    continue
                if batch and (size + len(value) > BATCH_BYTES or len(batch) >= MAX_BATCH_KEYS):
                    client.rpc("PutMany", pb.PutManyRequest(items=batch))
                    sent, total, batch, size = sent + len(batch), total + size, [], 0
                if len(value) > BATCH_BYTES:
                    continue  # a large value is read at its first read (peer fill, streamed)
                batch.append(pb.PutRequest(key=key, value=value, checksum=checksum(value)))
                size += len(value)
            if batch:
                client.rpc("PutMany", pb.PutManyRequest(items=batch))
                sent, total = sent + len(batch), total + size
        finally:
            client.close()
            self._count("handover_keys", sent)
            self._count("handover_bytes", total)
        return sent, total


class HandedOver:
    """Copies a previous owner handed over, held until a fill takes them: the first source of a cluster node's
    fill chain (`cachesvc.engine.fillchain`), so a handed-over copy is checked as any peer's is.

    Args:
        max_bytes: bytes held at most (the oldest go first).
        seconds: how long a copy waits for its fill.
    """

    name = "handover"

    def __init__(self, max_bytes: int = 64 << 20, seconds: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._max = max_bytes
        self._seconds = seconds
        self._clock = clock
        self._mu = threading.Lock()
        self._held: OrderedDict[bytes, tuple[bytes, int, float]] = OrderedDict()
        self._bytes = 0
        self._counters: Counter[str] = Counter()

    def take(self, items: Sequence[tuple[bytes, bytes, int]]) -> None:
        """Holds (key, value, checksum) handed over, for the fills that follow."""
        now = self._clock()
        with self._mu:
            for key, value, sum_ in items:
                self._pop(key)
                self._held[key] = (value, sum_, now)
                self._bytes += len(value)
            self._counters["handed_over"] += len(items)
            while self._held and (self._bytes > self._max or now - next(iter(self._held.values()))[2] > self._seconds):
                _, (value, _, _) = self._held.popitem(last=False)
                self._bytes -= len(value)
                self._counters["handed_over_dropped"] += 1

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Entry]:
        found: dict[bytes, Entry] = {}
        with self._mu:
            for key in keys:
                held = self._pop(key)
                if held is not None:
                    found[key] = Entry(held[0], held[1])
        return found

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drops the copies of `keys` no fill took (counted as "handed_over_dropped")."""
        with self._mu:
            for key in keys:
                if self._pop(key) is not None:
                    self._counters["handed_over_dropped"] += 1

    def _pop(self, key: bytes) -> tuple[bytes, int, float] | None:
        """Takes the copy of `key` out of those held, if any (mutex held)."""
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= len(held[0])
        return held

    def counters(self) -> dict[str, int]:
        with self._mu:
            return dict(self._counters)

    def close(self) -> None:
        with self._mu:
            self._held.clear()
            self._bytes = 0
