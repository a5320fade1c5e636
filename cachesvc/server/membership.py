"""A cache server's membership in the metadata shard: register once, then heartbeat and follow the placement.

Runs beside the gRPC server in one thread. Registration retries with a
bounded backoff until the shard answers; a first heartbeat follows at once
(it makes the node "up" and gives it slots), then one every `interval`
seconds with the server's used bytes, each with a deadline. After each beat
the loop asks the shard for the placement map (a cheap "unchanged" answer
when its version has not moved) and hands a new one to `on_placement`;
`poke()` asks for it at once; `fetch_placement` fetches it in the caller's
thread (a client routed by a map this server lacks: `Ownership`). Failures are
logged and retried: a shard outage never stops the cache from serving, and
the server keeps routing by its last map. A beat that succeeds after a gap
longer than half the lease (the shard may have dropped this node and given
its keys to others meanwhile) calls `on_rejoin` before the placement is
fetched again.

Lease doubt. A node cut off from the shard is still owner as far as its
own map says, but once its lease runs out the shard gives its keys to
others, and they take writes. A second thread watches the lease: from half
the lease after the last heartbeat the shard answered (timed from when it
was sent) the node is `in_doubt` and `on_doubt` runs; co-located clients
then stop reading its shared L1 directly (their reads go through its
gRPC port, which an operator's partition cuts as it cuts the heartbeats).
The next heartbeat answered ends the doubt, after `on_rejoin`.

`leave()` is the graceful stop: the loop ends, the node is marked down in
the shard (unless an operator drained it: that state stays), and the map
without it is handed to `on_placement`, so clients are told to go elsewhere
while the port still answers instead of waiting out the lease. Its next
heartbeat, after a restart, brings it back up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cacheclient.errors import CacheClientError
from cacheclient.meta import MetaClient
from cacheclient.wire.placement import PlacementMap

__all__ = ["Membership"]

log = logging.getLogger(__name__)

_MIN_REFRESH_SECONDS = 0.2
"""Pokes closer together than this share one placement fetch."""


class Membership:
    """Keeps `address` registered and alive in the shard at `meta_addresses`, and its placement current."""

    def __init__(
        self,
        meta_addresses: list[str],
        address: str,
        capacity_bytes: int,
        used_bytes: Callable[[], int],
        interval: float = 2.0,
        on_placement: Callable[[PlacementMap], None] | None = None,
        on_rejoin: Callable[[], None] | None = None,
        token: str = "",
        tls_ca: str | None = None,
        on_doubt: Callable[[], None] | None = None,
    ) -> None:
        self._client = MetaClient(meta_addresses, timeout=5.0, token=token or None, tls_ca=tls_ca)
        self._address = address
        self._capacity = capacity_bytes
        self._used = used_bytes
        self._interval = interval
        self._on_placement = on_placement
        self._on_rejoin = on_rejoin
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._epoch = 0
        """The shard's identity when this node registered (0: not known yet)."""
        self._rebuilt = threading.Event()
        """Set when a fetched map shows the shard has another identity: register again."""
        self._on_doubt = on_doubt
        self._trusted_until = float("inf")
        """Monotonic time until which the shard cannot have dropped this node: half a lease after the send
        of the last heartbeat it answered (infinity before the first)."""
        self._renewed = threading.Event()
        self.in_doubt = False
        """Whether the lease may have run out (no heartbeat answered for half of it)."""
        self._watcher = threading.Thread(target=self._watch, name="membership-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._watcher.start()

    def _watch(self) -> None:
        """Marks the node in doubt once `_trusted_until` passes with no heartbeat answered (its own thread: a
        heartbeat to a cut-off shard blocks the loop for its whole deadline)."""
        while not self._stop.is_set():
            left = self._trusted_until - time.monotonic()
            if left > 0:
                self._renewed.wait(min(left, 1.0))
                self._renewed.clear()
                continue
            if not self.in_doubt:
                self.in_doubt = True
                log.warning("no heartbeat answered for half the lease: %s may have lost its keys", self._address)
                if self._on_doubt is not None:
                    self._on_doubt()
            self._renewed.wait(1.0)
            self._renewed.clear()

    def poke(self) -> None:
        """Fetch the placement now rather than after the next heartbeat."""
        self._wake.set()

    def _run(self) -> None:
        # The map before this node is in it, first: a joining node asks the previous owners of the keys it is
        # given for their bytes (`Ownership.previous_owners`), and knows them only from a map it held before.
        # Fetched after registering, under load the first map could already be the one that gives it keys.
        self._refresh_placement(first=True)
        backoff = 0.2
        while not self._stop.is_set():
            try:
                self._client.register_node(self._address, self._capacity)
                log.info("registered %s with the metadata shard", self._address)
                break
            except CacheClientError as exc:
                log.warning("metadata shard not reachable yet: %s", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        next_beat = time.monotonic()
        last_beat, lease = time.monotonic(), float("inf")
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._interval
                sent = time.monotonic()
                try:
                    lease = self._client.heartbeat(self._address, self._used()) or lease
                except CacheClientError as exc:
                    log.warning("heartbeat to the metadata shard failed: %s", exc)
                else:
                    now = time.monotonic()
                    gap, last_beat = now - last_beat, now
                    if (gap > lease / 2 or self.in_doubt) and self._on_rejoin is not None:
                        log.warning("no heartbeat reached the shard for %.1fs (lease %gs): rejoined", gap, lease)
                        self._on_rejoin()
                    self._trusted_until = sent + lease / 2
                    self.in_doubt = False
                    self._renewed.set()
            self._refresh_placement()
            if self._rebuilt.is_set() and not self._stop.is_set():
                self._register_again()
                next_beat = time.monotonic()  # a beat at once makes it up in the new shard
                continue
            self._stop.wait(_MIN_REFRESH_SECONDS)
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()

    def _register_again(self) -> None:
        """The shard was rebuilt from empty (it forgot this node): register with it again."""
        try:
            self._client.register_node(self._address, self._capacity)
        except CacheClientError as exc:
            log.warning("registering again with the rebuilt metadata shard failed: %s", exc)
            self._stop.wait(_MIN_REFRESH_SECONDS)
            return
        self._rebuilt.clear()
        log.warning("registered %s again: the metadata shard was rebuilt", self._address)
        if self._on_rejoin is not None:
            self._on_rejoin()  # its keys may have moved and been written meanwhile

    def _note_identity(self, placement: PlacementMap) -> None:
        """Remembers the shard's epoch; another one (or none: an empty shard) means it was rebuilt."""
        if self._epoch and placement.epoch != self._epoch:
            log.warning("the metadata shard's identity changed (epoch %d -> %d)", self._epoch, placement.epoch)
            self._rebuilt.set()
        if placement.epoch:
            self._epoch = placement.epoch

    def _refresh_placement(self, first: bool = False) -> None:
        """Fetches the shard's map and follows it. `first`: the fetch before registering, where a shard not
        up yet is waited for by the registration instead, and an empty one (no identity yet) tells nothing."""
        try:
            placement = self._client.placement(refresh=True, timeout=min(self._interval, 5.0))
        except CacheClientError as exc:
            if not first:
                log.warning("placement fetch from the metadata shard failed; keeping the last map: %s", exc)
            return
        if first and not placement.epoch:
            return
        self._note_identity(placement)
        if self._on_placement is not None:
            try:
                self._on_placement(placement)
            except Exception:  # the loop must go on: a node that stops following the shard is lost to it
                log.exception("following placement version %d failed; the next fetch tries again", placement.version)

    def fetch_placement(self, timeout: float) -> PlacementMap | None:
        """Fetches the shard's map now, in the caller's thread, and hands it to `on_placement`; None: no answer.

        For `Ownership`, when a client routes by a map this server has not
        caught up with: the server decides by the shard's map, not the client's word.
        """
        try:
            placement = self._client.placement(refresh=True, timeout=timeout)
        except CacheClientError as exc:
            log.warning("placement fetch from the metadata shard failed: %s", exc)
            return None
        self._note_identity(placement)
        if self._on_placement is not None:
            self._on_placement(placement)
        return placement

    def stop(self) -> None:
        """Ends the loop, leaving the node as the shard sees it (its lease runs out)."""
        self._stop.set()
        self._wake.set()
        self._renewed.set()
        self._thread.join(timeout=10.0)
        self._client.close()

    def leave(self, timeout: float = 3.0, linger: float = 0.5) -> None:
        """Ends the loop and takes the node out of the placement now (see the module docstring).

        Args:
            timeout: seconds each call to the shard may take.
            linger: seconds to go on answering once out of the map, so clients
                that still route here are told of the new one, not refused.
        """
        self._stop.set()
        self._wake.set()
        self._renewed.set()
        self._thread.join(timeout=10.0)
        try:
            states = {node.address: node.state for node in self._client.nodes(timeout=timeout)}
            if states.get(self._address) in ("up", "joining"):
                self._client.set_node_state(self._address, "down", timeout=timeout)
                log.info("left the placement: %s is down in the metadata shard", self._address)
                self._refresh_placement()
                time.sleep(linger)
        except CacheClientError as exc:
            log.warning("could not leave the placement (the lease will run out instead): %s", exc)
        finally:
            self._client.close()
