"""A local index of the keys a cache holds under one prefix: `KVIndex`.

A decode or prefill worker wants the longest cached prefix of a prompt
before it decides what to compute. Asking the server costs a round trip
(0.6-1.1 ms); `KVIndex` answers from a set of key digests held in this
process (`cacheclient.wire.key_digest`), which a background thread keeps in
step with the server through the `KeyDigest` RPC: one full snapshot, then
only the changes, every `interval` seconds.

The index may lag the server by up to one sync interval plus one call; its
`staleness` says by how much. An index nobody reads and whose keys do not
change backs off: each quiet round doubles the wait, up to `idle_interval`
(0.4 s, below `KVCache`'s default `max_staleness` of 0.5 s, so an idle
index is still used); a change, or a lookup, brings back `interval` (seconds since the start of the last sync
that completed with every node). It can claim a key the server has just
dropped, so a fetch after a lookup may miss (the caller recomputes); it
never hands out a value (fetches verify what they read).

With a cluster client (`CacheClient(meta=...)` or `nodes=[...]`) it follows
every node of the placement map and answers from the union; a node it
cannot reach stops `staleness` from falling.

Fork-safe: the sets and the thread belong to the process that made them; a
forked child (a DataLoader worker) starts its own, empty, on first use and
is stale until its first sync.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from cacheclient.client import CacheClient
from cacheclient.errors import CacheClientError
from cacheclient.node import NodeClient
from cacheclient.process_local import ProcessLocal, background_call
from cacheclient.wire import KEY_DIGEST_ENTRIES, cache_pb2, unpack_digests

__all__ = ["KVIndex"]

log = logging.getLogger(__name__)

IDLE_INTERVAL = 0.4
"""Seconds between syncs of an idle index, at most: under `KVCache`'s default `max_staleness` (0.5 s)."""

_PAGES_PER_ROUND = 64
"""Answers one node gets per sync round; a bigger snapshot goes on in the next round."""


@dataclass
class _Node:
    """What this process knows of one server's digests."""

    address: str
    epoch: int = 0
    seq: int = 0
    held: set[int] = field(default_factory=set)
    in_snapshot: bool = False
    snapshot_after: int = 0
    synced_at: float = float("-inf")
    """Monotonic time at which the last complete sync with this node began."""


class _Follower:
    """One process's index: per-node digest sets, their union (as counts), and the sync thread."""

    def __init__(self) -> None:
        self.nodes: dict[str, _Node] = {}
        self.counts: dict[int, int] = {}
        """Digest -> how many followed nodes hold it: the union of the nodes' sets, read by lookups."""
        self.oldest = float("-inf")
        """The oldest `synced_at` of the followed nodes."""
        self.lock = threading.Lock()
        """One sync round at a time (the thread's or `KVIndex.sync`'s)."""
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.looked = False
        """Set by lookups, cleared by each round: a reader keeps the syncs at `interval`."""
        self.changes = 0
        """Digests added or removed so far: a round that changes nothing lets the thread back off."""
        self.syncs = 0
        self.failures = 0
        self.snapshots = 0
        self.last_error = ""

    def add(self, node: _Node, digests: Sequence[int]) -> None:
        counts = self.counts
        for digest in digests:
            if digest not in node.held:
                node.held.add(digest)
                counts[digest] = counts.get(digest, 0) + 1
                self.changes += 1

    def remove(self, node: _Node, digests: Sequence[int] | set[int]) -> None:
        counts = self.counts
        for digest in list(digests):
            if digest in node.held:
                node.held.discard(digest)
                self.changes += 1
                left = counts[digest] - 1
                if left:
                    counts[digest] = left
                else:
                    del counts[digest]


class KVIndex:
    """The digests of the keys a cache holds under `prefix`, in this process, kept fresh in the background.

    Args:
        cache: the cache (one server, or a cluster client).
        prefix: the key prefix to follow; one of the servers' `kv_index_prefixes`.
        interval: seconds between syncs while keys change or lookups read the index.
        idle_interval: the longest wait between syncs of an index nobody reads and whose keys do not change
            (default `IDLE_INTERVAL`, or `interval` if longer).
        timeout: deadline of each KeyDigest call, in seconds.
        max_entries: most digests per answer (0: the protocol's most).

    The thread starts on first use in each process (and at once in the one
    that makes the index); `close` stops it.
    """

    def __init__(
        self,
        cache: CacheClient,
        prefix: bytes | str = b"kv/",
        *,
        interval: float = 0.05,
        idle_interval: float | None = None,
        timeout: float = 2.0,
        max_entries: int = 0,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError(f"interval and timeout must be positive, got {interval} and {timeout}")
        idle_interval = max(IDLE_INTERVAL, interval) if idle_interval is None else idle_interval
        if idle_interval < interval:
            raise ValueError(f"idle_interval ({idle_interval}) must be at least interval ({interval})")
        if not 0 <= max_entries <= KEY_DIGEST_ENTRIES:
            raise ValueError(f"max_entries must be 0..{KEY_DIGEST_ENTRIES}, got {max_entries}")
        self.cache = cache
        self.prefix = prefix.encode() if isinstance(prefix, str) else prefix
        self.interval = interval
        self.idle_interval = idle_interval
        self.timeout = timeout
        self.max_entries = max_entries
        self._local = ProcessLocal(self._start, _stop)
        self._local.get()

    def __repr__(self) -> str:
        return f"KVIndex({self.cache.address!r}, {self.prefix!r}, interval={self.interval})"

    def _start(self) -> _Follower:
        follower = _Follower()
        # The thread holds the index weakly: an index dropped without `close` stops its thread.
        thread = threading.Thread(
            target=_run,
            args=(weakref.ref(self), follower, self.interval, self.idle_interval),
            name="kv-index",
            daemon=True,
        )
        follower.thread = thread
        thread.start()
        return follower

    # -- what lookups read ------------------------------------------------

    @property
    def staleness(self) -> float:
        """Seconds since the start of the last sync that completed with every node; inf before the first."""
        return time.monotonic() - self._local.get().oldest

    def contains(self, digest: int) -> bool:
        """Whether a followed node held the key of `digest` at the last sync."""
        follower = self._local.get()
        follower.looked = True
        return digest in follower.counts

    def held_prefix(self, digests: Sequence[int]) -> int:
        """How many of `digests`, from the first, were held at the last sync (up to the first that was not)."""
        follower = self._local.get()
        follower.looked = True
        counts = follower.counts
        n = 0
        for digest in digests:
            if digest not in counts:
                break
            n += 1
        return n

    @property
    def size(self) -> int:
        """Distinct digests held (not `len`: an empty index must still be true in `if index:`)."""
        return len(self._local.get().counts)

    @property
    def counters(self) -> dict[str, int]:
        """This process's "syncs" (complete rounds), "failures" and "snapshots" (resets) so far."""
        follower = self._local.get()
        return {"syncs": follower.syncs, "failures": follower.failures, "snapshots": follower.snapshots}

    # -- syncing ------------------------------------------------------------

    def sync(self) -> None:
        """One sync round with every node now, in this thread.

        Raises:
            CacheClientError: a node did not answer; the others are synced.
        """
        follower = self._local.get()
        error = self._round(follower)
        if error is not None:
            raise error

    def _addresses(self) -> dict[str, NodeClient]:
        """A client of every node of the cache's placement map (one server: just it)."""
        return self.cache.cluster.nodes()

    def _round(self, follower: _Follower) -> CacheClientError | None:
        """Syncs with every node; the first error, if any."""
        with follower.lock:
            first: CacheClientError | None = None
            try:
                clients = self._addresses()
            except CacheClientError as exc:
                follower.failures += 1
                follower.last_error = str(exc)
                return exc
            for address in [a for a in follower.nodes if a not in clients]:
                gone = follower.nodes.pop(address)  # left the placement map
                follower.remove(gone, gone.held)
            for address, client in clients.items():
                node = follower.nodes.setdefault(address, _Node(address))
                try:
                    self._pull(follower, node, client)
                except CacheClientError as exc:
                    follower.failures += 1
                    follower.last_error = str(exc)
                    first = first or exc
            follower.oldest = min((n.synced_at for n in follower.nodes.values()), default=float("-inf"))
            if first is None:
                follower.syncs += 1
            return first

    def _pull(self, follower: _Follower, node: _Node, client: NodeClient) -> None:
        """Brings `node`'s set up to the server's, unless its snapshot needs more pages than one round takes."""
        began = time.monotonic()
        for _ in range(_PAGES_PER_ROUND):
            request = cache_pb2.KeyDigestRequest(
                prefix=self.prefix,
                epoch=node.epoch,
                since_seq=node.seq,
                snapshot=node.in_snapshot,
                snapshot_after=node.snapshot_after,
                max_entries=self.max_entries,
            )
            answer = client.rpc("KeyDigest", request, self.timeout)
            if answer.reset:
                follower.snapshots += 1
                follower.remove(node, node.held)
            follower.remove(node, unpack_digests(answer.removed))
            follower.add(node, unpack_digests(answer.added))
            node.epoch, node.seq = answer.epoch, answer.seq
            if answer.full:
                node.in_snapshot, node.snapshot_after = answer.more, answer.next_after
                continue  # more pages, or the changes made while they were read
            if not answer.more:
                node.synced_at = began
                return

    def close(self) -> None:
        """Stops this process's sync thread and forgets its sets (a later use starts them again)."""
        self._local.close()

    def __enter__(self) -> KVIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(index_ref: weakref.ref[KVIndex], follower: _Follower, interval: float, idle_interval: float) -> None:
    """The sync thread: a round every `interval` seconds while keys change or lookups read the index, backing
    off to `idle_interval` otherwise, until stopped or the index is gone."""
    wait = interval
    while not follower.stop.is_set():
        index = index_ref()
        if index is None:
            return
        # Lookups since the last round, or changes in this one, keep the pace; a failing node is retried
        # at the idle pace like a quiet one.
        looked, follower.looked = follower.looked, False
        changes = follower.changes
        with background_call():  # a fork waits for the round
            error = index._round(follower)
        del index
        if error is not None:
            log.debug("kv index sync failed: %s", error)
        busy = looked or follower.changes != changes
        wait = interval if busy else min(wait * 2, idle_interval)
        follower.stop.wait(wait)


def _stop(follower: _Follower) -> None:
    follower.stop.set()
    if follower.thread is not None and follower.thread is not threading.current_thread():
        follower.thread.join(timeout=5.0)
