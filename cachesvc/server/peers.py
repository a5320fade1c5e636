"""Peer fill: after the placement moves a key, its new owner asks the key's previous owner before object storage.

A node that joins takes about capacity/total of every node's keys; without
peer fill, each of them is a miss there and a GET from object storage, so a
join re-downloads that share of the warm set. `PeerFill` is the first
source of the engine's fill chain (`cachesvc.engine.fillchain`): a read that
misses the cache tiers asks the nodes that held the key by the last few
placements (`Ownership.previous_owners`) with a cache-only read (`ROUTE_PEER`:
the peer answers from its L1 and L2, never from object storage); the keys no
peer had go on to object storage, the chain's last source. Writes, listing and
write-back uploads never come here. A delete does (`drop`): before the new
owner deletes a key from object storage it tells the key's previous owners
to drop their copies, dirty ones included (`Engine.drop_cached`), so a copy
not yet uploaded there is not uploaded over the delete; a previous owner that
does not answer is counted (`peer_drop_errors`) and skipped. A copy a peer
gives is checked against object storage by the fill chain before it is kept
(`cachesvc.engine.fillchain`), and a peer uploads a value it has not yet
uploaded before it answers, so a moved write-back value is read whole.

A peer that fails to answer (down, slow, refusing) is skipped for
`PEER_BACKOFF` seconds, so a dead node costs one short deadline, not one per
miss; a peer's failure is a miss here, never the read's error. The bytes a
peer returns are checked against their checksum by the client, as every
read is; a peer's dirty value (written back, not yet uploaded) arrives here
only once the peer has uploaded it.
Keys of cache-only namespaces are never filled, so never peer-filled either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from cacheclient.errors import CacheClientError
from cacheclient.node import Location, NodeClient
from cacheclient.wire import ROUTE_METADATA, checksum
from cacheclient.wire.names import ROUTE_PEER
from cachesvc.server.ownership import Ownership
from cachesvc.tiers.base import Entry

__all__ = ["PEER_BACKOFF", "PEER_TIMEOUT", "PeerFill"]

log = logging.getLogger(__name__)

PEER_TIMEOUT = 2.0
"""Seconds a peer has to answer one cache-only read."""
PEER_BACKOFF = 10.0
"""Seconds a peer that failed to answer is not asked again."""
_GAVE_MAX = 4096


class PeerFill:
    """A fill source (`cachesvc.engine.fillchain.FillSource`): a missed key's previous owners, asked in turn.

    Args:
        ownership: this node's placements (`previous_owners`).
        token: the bearer token peers require ("" for none).
        tls_ca: the PEM roots that sign peers' certificates, when they serve TLS.
        timeout: seconds a peer has to answer one read.
        clock: monotonic seconds, for the back-off of peers that failed.
    """

    name = "peers"

    def __init__(
        self,
        ownership: Ownership,
        *,
        token: str = "",
        tls_ca: bytes | None = None,
        timeout: float = PEER_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ownership = ownership
        self._token = token
        self._tls_ca = tls_ca
        self._timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[str, NodeClient] = {}
        self._failed_until: dict[str, float] = {}
        self._gave: dict[bytes, str] = {}
        """Which peer gave each key lately (for `dirty_at_source`), at most `_GAVE_MAX`."""
        self._newer: dict[bytes, str] = {}
        """Which peer holds a newer value of a key (`newer_elsewhere`), asked first by its fill; at most `_GAVE_MAX`."""
        self._counters: Counter[str] = Counter()
        """peer_fills and peer_fill_bytes (values a peer had), peer_misses, peer_errors."""

    def fetch_many(self, keys: Sequence[bytes]) -> dict[bytes, Entry]:
        """The values some previous owner of each key holds in its cache tiers; the others are left out."""
        found: dict[bytes, Entry] = {}
        for key in keys:
            entry = self._fetch(key)
            if entry is not None:
                found[key] = entry
        return found

    def _fetch(self, key: bytes) -> Entry | None:
        with self._lock:
            newer = self._newer.pop(key, None)
        peers = self.ownership.previous_owners(key)
        if newer is not None:
            peers = [newer, *(p for p in peers if p != newer)]
        for peer in peers:
            client = self._client(peer)
            if client is None:
                continue
            try:
                value = client.get(key, timeout=self._timeout)
            except CacheClientError as exc:
                log.info("peer %s did not answer a peer fill (%s); not asked again for %gs", peer, exc, PEER_BACKOFF)
                with self._lock:
                    self._counters["peer_errors"] += 1
                    self._failed_until[peer] = self._clock() + PEER_BACKOFF
                continue
            with self._lock:
                if value is None:
                    self._counters["peer_misses"] += 1
                    continue
                self._counters["peer_fills"] += 1
                self._counters["peer_fill_bytes"] += len(value)
                if len(self._gave) >= _GAVE_MAX:
                    self._gave.pop(next(iter(self._gave)))
                self._gave[key] = peer
            return Entry(value, checksum(value))
        return None

    def dirty_at_source(self, key: bytes) -> int | None:
        """The version of the copy of `key` the previous owner that just gave it holds not yet uploaded
        (one ContainsMany); None when it is uploaded there, or the peer cannot say."""
        with self._lock:
            peer = self._gave.pop(key, None)
        where = self._locate(peer, key) if peer is not None else None
        return where.version if where is not None and not where.uploaded else None

    def newer_elsewhere(self, key: bytes, version: int) -> bool:
        """Whether a previous owner of `key`, or the node that would stand in for this one, caches a newer value.

        Asked before an unvouched copy is served (`cachesvc.engine.readpath`):
        after a restart or a move, the node that held the key meanwhile may
        have taken a newer write-back value that object storage does not have
        yet. One ContainsMany to each (cache only); a peer that does not
        answer is skipped (`_locate`). The peer found is asked first by the
        fill that follows.
        """
        if not version:
            return False  # a copy of unknown version (an older record) cannot be ordered
        peers = self.ownership.previous_owners(key)
        peers += [p for p in self.ownership.stand_ins(key) if p not in peers]
        for peer in peers:
            where = self._locate(peer, key)
            if where is not None and where.version > version:
                with self._lock:
                    self._counters["peer_newer"] += 1
                    if len(self._newer) >= _GAVE_MAX:
                        self._newer.pop(next(iter(self._newer)))
                    self._newer[key] = peer
                return True
        return False

    def _locate(self, peer: str, key: bytes) -> Location | None:
        """Where `peer` caches `key` (one cache-only ContainsMany); None when it does not, or does not answer
        (counted as `peer_locate_errors`, and the peer is not asked again for `PEER_BACKOFF`)."""
        client = self._client(peer)
        if client is None:
            return None
        try:
            [where] = client.locate_many([key], cached_only=True, timeout=self._timeout)
        except CacheClientError as exc:
            log.info("peer %s did not say what it caches of a key (%s)", peer, exc)
            with self._lock:
                self._counters["peer_locate_errors"] += 1
                self._failed_until[peer] = self._clock() + PEER_BACKOFF
            return None
        return where

    def drop(self, key: bytes) -> None:
        """Tells each previous owner of `key` to drop its cached copies (a delete through this node follows).

        Not the key's other replicas by the current map: the client's delete reaches each of them itself (a
        replicated write returns once every replica took it). Told here as well, two replicas deleting the
        key at once would each wait, holding the key, for the other's drop, which waits for the key, until
        the peer deadline.
        """
        replicas = set(self.ownership.co_owners(key))
        for peer in self.ownership.previous_owners(key):
            if peer in replicas:
                continue
            client = self._client(peer)
            if client is None:
                with self._lock:
                    self._counters["peer_drop_errors"] += 1
                continue
            try:
                client.delete(key, timeout=self._timeout)
            except CacheClientError as exc:
                log.warning(
                    "peer %s did not drop a deleted key (%s): a copy it did not upload may come back", peer, exc
                )
                with self._lock:
                    self._counters["peer_drop_errors"] += 1
                    self._failed_until[peer] = self._clock() + PEER_BACKOFF
                continue
            with self._lock:
                self._counters["peer_drops_sent"] += 1

    def _client(self, peer: str) -> NodeClient | None:
        """A cache-only reading client of `peer`; None while it is backing off."""
        with self._lock:
            if self._failed_until.get(peer, 0.0) > self._clock():
                return None
            client = self._clients.get(peer)
            if client is None:
                plain = NodeClient(peer, timeout=self._timeout, token=self._token or None, tls_ca=self._tls_ca)
                client = self._clients[peer] = plain.with_metadata(((ROUTE_METADATA, ROUTE_PEER),))
                # The placement remembers a few maps; drop clients of nodes it no longer names.
                for old in [a for a in self._clients if a not in self.ownership.known_nodes()]:
                    self._clients.pop(old).close()
            return client

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
