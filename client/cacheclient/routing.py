"""`Router`: the transport of a cluster `CacheClient`, which sends each key to the nodes that hold it.

It implements `cacheclient.transport.Transport` and owns three things: the
placement map (from the metadata shard, or a static list of nodes), one
`NodeClient` per node address (each with its own per-process channel), and
a bounded pool of threads that issues the per-node parts of a batch at once.

Routing a key. The map ranks every node for a key (`PlacementMap.candidates`):
the owner, its replicas (the first R; R from the key's namespace), then the
nodes that would hold it if those left. Reads go to one of the replicas,
writes, deletes and evictions to all of them. A call names the map version it
routed by (`PLACEMENT_VERSION_METADATA`); a node whose map is newer and says
it does not own a key answers NOT_OWNER with the owner and its version, and
the router follows the owner at once (one extra round trip) and refreshes
its map from the shard in the background.

Node loss. A node that does not answer (UNAVAILABLE, or a deadline: a read's
first try gets half the time left, so a hung node leaves time for the next)
is skipped by reads for `SUSPECT_SECONDS`; its keys are read from the next
candidate, marked as a fallback (`ROUTE_FALLBACK`), which serves them as if
it owned them (and reads them through from S3: it is the node the shard
will move them to). When every allowed candidate fails, the call raises the
last `UnavailableError`/`DeadlineError`, which `cacheclient.torch` turns
into a direct, counted S3 read.

Writes (put, delete, evict) go to every replica the map names and to no
other node: a write returns once each has it. While one does not answer,
the write asks again every `_WRITE_RETRY_SECONDS` (the shard's map first:
once the shard drops the node, the key's next replica is named) until its
deadline, then raises `ReplicasFailedError`, naming the replicas that failed.
Reads that follow a write are sent to the same replicas, so a write that
returned is on every node a reader is sent to while the map stands. A read
with `release=True` ends the lease on the replica it read (in the read) and
then on the key's other replicas (`release_replicas`).

Metadata outages. The map is refreshed in the background every
`placement_ttl` seconds; a refresh that fails keeps the last map, so the
shard being down never stops the data path. Only the first call of a
process without any map waits for the shard.

Fork safety: the per-node clients and the pool are made lazily per process
(`ProcessLocal`), and the router pickles without them.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cacheclient._batches import PutValue
from cacheclient.colocated import NodeArena
from cacheclient.errors import (
    CacheClientError,
    DeadlineError,
    InvalidRequestError,
    NotOwnerError,
    ReplicasFailedError,
    UnavailableError,
)
from cacheclient.meta import MetaClient
from cacheclient.node import Location, NodeClient
from cacheclient.node_plan import PrefetchPlan
from cacheclient.process_local import ProcessLocal, background_call
from cacheclient.split_plan import SplitPrefetchPlan
from cacheclient.wire import PLACEMENT_VERSION_METADATA, ROUTE_FALLBACK, ROUTE_METADATA
from cacheclient.wire.placement import PlacementMap

__all__ = ["SUSPECT_SECONDS", "Router", "SplitPrefetchPlan"]

log = logging.getLogger(__name__)

T = TypeVar("T")

SUSPECT_SECONDS = 2.0
"""How long a node that did not answer is passed over before it is tried again."""

_MAX_ROUNDS = 6
"""Most times one key is routed again (NOT_OWNER, a lost node) before the call gives up."""
_REFUSAL_REFRESH_SECONDS = 2.0
"""How long a refused call waits for the shard's newer map before following the node's hint instead."""
_WRITE_RETRY_SECONDS = 0.25
"""How often a write that a replica did not take asks again (the shard's map, then the replicas)."""

_NODE_DOWN = (UnavailableError, DeadlineError)

_COUNTERS = ("calls", "not_owner", "failovers", "release_failures", "arena", "staged")
"""Per-process counts: per-node requests made, NOT_OWNER answers followed, lost nodes passed over,
replicas that did not end a lease after a read with release=True."""

_ITER_CHUNK_KEYS = 64
"""Keys `iter_many` reads at once in a cluster, before it yields them in order."""


@dataclass
class _Local:
    """What a router holds in one process: its per-node clients, its pool, its view of lost nodes."""

    pool: ThreadPoolExecutor
    clients: dict[str, NodeClient] = field(default_factory=dict)
    suspect: dict[str, float] = field(default_factory=dict)
    refreshing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    arenas: dict[str, NodeArena] = field(default_factory=dict)
    """The shared L1 of each node on this machine (`cacheclient.colocated`), by address."""


def _by_prefix(replicas: Mapping[bytes, int]) -> list[tuple[bytes, int]]:
    """(prefix, replicas) pairs, longest prefix first, so that the first match is the most specific."""
    return sorted(((p, max(1, int(r))) for p, r in replicas.items()), key=lambda x: -len(x[0]))


@dataclass
class _Key:
    """One key of a routed call: where it went, where it must still go."""

    index: int
    key: bytes
    replicas: int = 1
    """Nodes that hold the key (its namespace's replicas): a read goes to any one of them, a write to all."""
    done: set[str] = field(default_factory=set)
    """Nodes that served the key (a read) or took it (a write)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Nodes that did not answer or refused the key, and why."""
    earlier: dict[str, str] = field(default_factory=dict)
    """Why each node failed the key in an earlier wait of a write (the last wait's reasons are `failed`)."""
    hint: str = ""
    """The owner a node named in a NOT_OWNER answer; tried next."""
    rounds: int = 0


@dataclass(frozen=True)
class _Target:
    address: str
    fallback: bool


class Router:
    """Routes keys to cache nodes by the placement map; see the module docstring.

    Args:
        connect: makes the client of one node address.
        meta: the metadata shard's client, or None for a static map.
        static: the map of a fixed list of nodes (with `meta=None`).
        timeout: default deadline of a call, in seconds.
        concurrency: most per-node requests of one call in flight at once.
        replicas: replicas per key prefix (the longest matching prefix wins; 1 by default);
            None: learn them from a node's namespaces (`NodeClient.info`) on first use.
        placement_ttl: seconds between background refreshes of the map.
    """

    def __init__(
        self,
        connect: Callable[[str], NodeClient],
        *,
        meta: MetaClient | None,
        static: PlacementMap | None = None,
        timeout: float = 30.0,
        concurrency: int = 8,
        replicas: Mapping[bytes, int] | None = None,
        placement_ttl: float = 2.0,
        colocated: bool = True,
    ) -> None:
        if (meta is None) == (static is None):
            raise InvalidRequestError("a router needs the metadata shard or a static map, not both")
        if concurrency < 1:
            raise InvalidRequestError(f"concurrency must be >= 1, got {concurrency}")
        self._connect = connect
        self.colocated = colocated
        self.meta = meta
        self.timeout = timeout
        self.concurrency = concurrency
        self.placement_ttl = placement_ttl
        self._replicas = _by_prefix(replicas) if replicas is not None else None
        self._replicas_given = replicas is not None
        self._replicas_version = 0
        """The version of the shard's namespace table `_replicas` were learned from (0: a node's Info)."""
        self._learn_after = 0.0
        self._map: PlacementMap | None = static
        self._map_expiry = float("inf") if static is not None else 0.0
        self._local = ProcessLocal(self._new_local, _close_local)
        self._extra: tuple[tuple[str, str], ...] = ()
        """Metadata added to every call (`with_metadata`)."""

    def _new_local(self) -> _Local:
        return _Local(ThreadPoolExecutor(self.concurrency, thread_name_prefix="cacheclient-route"))

    # -- the map --------------------------------------------------------

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        """The map keys are routed by: the cached one, refreshed in the background when older than the ttl.

        Waits for the shard only when there is no map yet, or with `refresh`.

        Raises:
            UnavailableError: no map yet and the shard did not answer in time.
        """
        current = self._map
        if current is not None and not refresh:
            if time.monotonic() >= self._map_expiry:
                self._refresh_in_background()
            return current
        assert self.meta is not None or current is not None
        if self.meta is None:
            return current  # type: ignore[return-value]
        try:
            return self._refresh(self.timeout if timeout is None else timeout)
        except CacheClientError as exc:
            if current is not None:
                log.warning("placement refresh failed, routing by version %d: %s", current.version, exc)
                return current
            raise UnavailableError(f"no placement map: the metadata shard did not answer: {exc}") from exc

    def _refresh(self, timeout: float) -> PlacementMap:
        assert self.meta is not None
        fresh = self.meta.placement(refresh=True, timeout=timeout)
        current = self._map
        # Answers can cross: never go back to an older map of this shard; a shard rebuilt
        # from empty (another epoch, its versions counted from 1 again) is followed at once.
        if current is None or fresh.supersedes(current) or fresh.version == current.version:
            self._map = current = fresh
        self._map_expiry = time.monotonic() + self.placement_ttl
        if not self._replicas_given and fresh.namespaces_version != self._replicas_version:
            self._learn_table(fresh.namespaces_version, timeout)
        return current

    def _learn_table(self, version: int, timeout: float) -> None:
        """The replicas of the shard's namespace table, at `version` or later (kept as they were when unread)."""
        assert self.meta is not None
        try:
            table = self.meta.namespaces(timeout=min(timeout, 5.0))
        except CacheClientError as exc:
            log.info("namespace table version %d not read yet (%s); routing by the replicas known", version, exc)
            return
        self._replicas = _by_prefix({ns.prefix.encode(): ns.replicas for ns in table.namespaces})
        self._replicas_version = table.version

    def _refresh_in_background(self) -> None:
        local = self._local.get()
        with local.lock:
            if local.refreshing:
                return
            local.refreshing = True
        # Not again before the ttl, whether this one works or not.
        self._map_expiry = time.monotonic() + self.placement_ttl

        def run() -> None:
            try:
                with background_call():  # a fork waits for it
                    self._refresh(min(self.timeout, 5.0))
            except CacheClientError as exc:
                log.warning("metadata shard unreachable; routing by the last placement map: %s", exc)
            finally:
                local.refreshing = False

        local.pool.submit(run)

    @property
    def counters(self) -> dict[str, int]:
        """This process's counts: "calls" (per-node requests), "not_owner" (answers followed), "failovers"."""
        return dict(self._local.get().counters)

    def replicas_of(self, key: bytes) -> int:
        """How many nodes hold `key`: its namespace's replicas, 1 by default."""
        for prefix, replicas in self._replicas if self._replicas is not None else self._learn_replicas():
            if key.startswith(prefix):
                return replicas
        return 1

    def _learn_replicas(self) -> list[tuple[bytes, int]]:
        """The namespaces' replicas as a node reports them (kept once known; retried every 10 s until then);
        the shard's table replaces them once the map names one (`_refresh`)."""
        now = time.monotonic()
        if now < self._learn_after:
            return []
        try:
            info = self.any_node(lambda c: c.info(timeout=min(self.timeout, 5.0)))
        except CacheClientError as exc:
            log.info("replicas per namespace not learned yet (%s); 1 for now", exc)
            self._learn_after = now + 10.0
            return []
        learned = _by_prefix({ns["prefix"]: ns["replicas"] for ns in info.get("namespaces", ())})
        self._replicas = learned
        return learned

    # -- per-node clients ----------------------------------------------

    def node(self, address: str) -> NodeClient:
        """This process's client of node `address` (`Cluster.node`)."""
        local = self._local.get()
        client = local.clients.get(address)
        if client is None:
            with local.lock:
                client = local.clients.get(address)
                if client is None:
                    client = local.clients[address] = self._connect(address)
        return client

    @property
    def shard(self) -> MetaClient | None:
        """The metadata shard the map comes from; None for a static map."""
        return self.meta

    @property
    def routed(self) -> bool:
        """Always: each key goes to the nodes the map names."""
        return True

    def _view(self, target: _Target, version: int) -> NodeClient:
        """The client of `target` whose calls name the map version (and the fallback, for one)."""
        metadata: list[tuple[str, str]] = []
        if self.meta is not None:
            held = self._map  # the map of `version` (its epoch too), unless it was replaced since
            stamp = held.stamp if held is not None and held.version == version else str(version)
            metadata.append((PLACEMENT_VERSION_METADATA, stamp))
        if target.fallback:
            metadata.append((ROUTE_METADATA, ROUTE_FALLBACK))
        return self.node(target.address).with_metadata((*metadata, *self._extra))

    def with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> Router:
        """This router, over the same connections and pool, with `metadata` added to every call. It follows
        the placement on its own from the map held now; closing either closes both's connections."""
        router = object.__new__(Router)
        router.__dict__.update(self.__dict__)
        router._extra = self._extra + metadata
        return router

    def _suspect(self, address: str) -> None:
        self._local.get().suspect[address] = time.monotonic() + SUSPECT_SECONDS

    def _is_suspect(self, address: str, now: float) -> bool:
        until = self._local.get().suspect.get(address)
        return until is not None and until > now

    def close(self) -> None:
        """Closes every connection; the router reconnects if used again."""
        self._local.close()
        if self.meta is not None:
            self.meta.close()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # the ProcessLocal pickles without its value

    # -- routing --------------------------------------------------------

    @staticmethod
    def _named(item: _Key, placement: PlacementMap) -> list[str]:
        """The nodes `placement` names for `item`: its first `replicas` candidates."""
        candidates = placement.candidates(item.key)
        if not candidates:
            raise UnavailableError("no cache node is up in the placement map")
        return list(candidates[: item.replicas])

    def _read_target(self, item: _Key, placement: PlacementMap, now: float) -> _Target | None:
        """Where a read of `item` goes next: a replica, lost ones passed over, else the next candidate."""
        if item.hint and item.hint not in item.failed:
            return _Target(item.hint, fallback=False)
        candidates = placement.candidates(item.key)
        if not candidates:
            raise UnavailableError("no cache node is up in the placement map")
        replicas = min(item.replicas, len(candidates))
        # One node past the replicas: the one the shard moves the key to when an owner is lost.
        usable = [a for a in candidates[: replicas + 1] if a not in item.failed]
        if not usable:
            return None
        pool = [a for a in usable if not self._is_suspect(a, now)] or usable
        # A read of a replicated key goes to any replica that is left, spreading the load.
        replicas_left = [a for a in pool if candidates.index(a) < replicas]
        address = random.choice(replicas_left) if replicas_left else pool[0]
        return _Target(address, fallback=candidates.index(address) >= replicas)

    def _write_targets(self, item: _Key, placement: PlacementMap) -> list[_Target] | None:
        """The replicas a write of `item` must still reach (none: every one took it); None when one failed.

        Only the replicas the map names take a write: no other node stands in
        for one that failed, so a write that returned is on every replica a
        reader may be sent to.
        """
        if item.hint and item.hint not in item.done and item.hint not in item.failed:
            return [_Target(item.hint, fallback=False)]
        named = self._named(item, placement)
        if any(a in item.failed for a in named):
            return None
        return [_Target(a, fallback=False) for a in named if a not in item.done]

    def run(
        self,
        keys: Sequence[bytes],
        call: Callable[[NodeClient, list[int], float], None],
        *,
        write: bool,
        timeout: float | None = None,
    ) -> None:
        """Calls `call(client, indexes, timeout)` for the keys each node must serve, at once, until all are served.

        `call` stores its results by index; it may be called again for keys
        whose first node failed. Reads are served once, by a replica or (one
        lost) the next candidate; writes by every replica the map names.

        Raises:
            ReplicasFailedError: a write did not reach every replica of its keys
                by its deadline (it waited for them, or for the shard to name others).
            UnavailableError, DeadlineError: a key's allowed nodes all failed.
            NotOwnerError: the nodes kept refusing a key.
            CacheClientError: any other failure, as the node raised it.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pending = [_Key(i, key, self.replicas_of(key)) for i, key in enumerate(keys)]
        while True:
            lost = self._rounds(pending, call, write, deadline)
            if not lost:
                return
            # A replica did not take a write, and no other node stands in for it:
            # the write waits, until its deadline, for the replica to answer again
            # or for the shard to drop it and name the key's next replica.
            if not self._placement_moved(deadline):
                if deadline - time.monotonic() <= _WRITE_RETRY_SECONDS:
                    raise _replicas_failed(lost, self.placement(), self._named)
                time.sleep(_WRITE_RETRY_SECONDS)
            for item in lost:
                item.hint = ""
                item.earlier.update(item.failed)
                item.failed.clear()
                item.rounds = 0  # a waiting write fails by its deadline, not by its count of tries
            pending = lost

    def _rounds(
        self, pending: list[_Key], call: Callable[[NodeClient, list[int], float], None], write: bool, deadline: float
    ) -> list[_Key]:
        """`run`'s rounds over `pending` by the map it has; the write keys a replica of which failed."""
        lost: list[_Key] = []
        first = True
        while pending:
            placement = self.placement()
            now = time.monotonic()
            groups: dict[_Target, list[_Key]] = {}
            for item in pending:
                if write:
                    targets = self._write_targets(item, placement)
                    if targets is None:
                        lost.append(item)
                        continue
                else:
                    target = self._read_target(item, placement, now)
                    if target is None:
                        raise UnavailableError(f"key {item.key[:64]!r}: every node that may hold it failed")
                    targets = [target]
                for target in targets:
                    groups.setdefault(target, []).append(item)
            if not groups:
                break
            if not first and now >= deadline:
                raise DeadlineError(f"{len({i.index for g in groups.values() for i in g})} keys not served in time")
            first = False
            # A read that has somewhere else to go gives its first node half the
            # time left, so a hung node still leaves time for the next one.
            share = 0.5 if not write and len(placement.nodes) > 1 else 1.0
            outcomes = self._scatter(groups, call, placement.version, deadline, share)
            counters = self._local.get().counters
            again: dict[int, _Key] = {}
            newer = 0  # the newest map version a refusing node named
            for target, group in groups.items():
                error = outcomes[target]
                if error is None:
                    for item in group:
                        item.done.add(target.address)
                        item.hint = ""
                        if write:
                            again[item.index] = item  # until every replica has it
                    continue
                if isinstance(error, NotOwnerError):
                    counters["not_owner"] += 1
                    newer = max(newer, error.version)
                else:
                    counters["failovers"] += 1
                    # Once per lost node, not at each of a waiting write's tries.
                    (log.debug if self._is_suspect(target.address, now) else log.warning)(
                        "cache node %s failed (%s)", target.address, error
                    )
                    self._suspect(target.address)
                for item in group:
                    item.rounds += 1
                    if item.rounds > _MAX_ROUNDS:
                        raise error
                    again[item.index] = item
                    if isinstance(error, NotOwnerError):
                        self._not_owner(item, target, error, placement)
                    else:
                        item.failed[target.address] = f"{type(error).__name__}: {error}"
                        item.hint = ""
            pending = list(again.values())
            if pending and newer > placement.version and self._refreshed_to(newer):
                # A batch is refused whole, naming the owner of one of its keys
                # only: with a map as new as the node's, every key goes to its own owner.
                for item in pending:
                    item.hint = ""
        return lost

    def _placement_moved(self, deadline: float) -> bool:
        """Fetches the shard's map now, if there is time left; whether it is another than the one routed by
        (a later version, or another epoch: a shard rebuilt from empty counts its versions from 1 again)."""
        left = deadline - time.monotonic()
        if self.meta is None or left <= 0:
            return False
        before = self.placement()
        after = self.placement(refresh=True, timeout=min(left, _REFUSAL_REFRESH_SECONDS))
        return (after.version, after.epoch) != (before.version, before.epoch)

    def _refreshed_to(self, version: int) -> bool:
        """Fetches the shard's map now; whether it is at least `version` (a node said ours is stale)."""
        if self.meta is None:
            return False
        try:
            # Briefly: a shard that does not answer must not hold up the data path.
            return self._refresh(min(self.timeout, _REFUSAL_REFRESH_SECONDS)).version >= version
        except CacheClientError as exc:
            log.warning("placement refresh after a refusal failed; following the node's hint: %s", exc)
            return False

    def _not_owner(self, item: _Key, target: _Target, error: NotOwnerError, placement: PlacementMap) -> None:
        if error.version > placement.version and error.owner and error.owner != target.address:
            # The node's map is newer: its owner is right; the shard's map follows in the background.
            item.hint = error.owner
            self._map_expiry = 0.0
        else:
            # Maps agree yet the node refuses (or named itself): this map is wrong; a read goes
            # to the next candidate as a fallback, a write fails (no node stands in for a replica).
            item.hint = ""
            item.failed[target.address] = f"refused: {error}"

    def _scatter(
        self,
        groups: dict[_Target, list[_Key]],
        call: Callable[[NodeClient, list[int], float], None],
        version: int,
        deadline: float,
        share: float = 1.0,
    ) -> dict[_Target, CacheClientError | None]:
        """Runs one `call` per target, all at once (the last in this thread); each target's error or None."""

        counters = self._local.get().counters

        def one(target: _Target, group: list[_Key]) -> CacheClientError | None:
            left = deadline - time.monotonic()
            timeout = max(0.001, left if target.fallback else left * share)
            counters["calls"] += 1
            try:
                call(self._view(target, version), [item.index for item in group], timeout)
            except CacheClientError as exc:
                if isinstance(exc, (*_NODE_DOWN, NotOwnerError)):
                    return exc
                raise
            return None

        work = list(groups.items())
        pool = self._local.get().pool
        futures: list[tuple[_Target, Future[CacheClientError | None]]] = [
            (target, pool.submit(one, target, group)) for target, group in work[:-1]
        ]
        last_target, last_group = work[-1]
        outcomes = {last_target: one(last_target, last_group)}
        for target, future in futures:
            outcomes[target] = future.result()
        return outcomes

    def any_node(self, call: Callable[[NodeClient], T], timeout: float | None = None) -> T:
        """`call` on the first node of the map that answers (for calls about the cluster, not a key)."""
        placement = self.placement(timeout=timeout)
        nodes = list(placement.nodes)
        now = time.monotonic()
        nodes.sort(key=lambda a: self._is_suspect(a, now))
        last: CacheClientError | None = None
        for address in nodes:
            try:
                return call(self.node(address))
            except _NODE_DOWN as exc:
                self._suspect(address)
                last = exc
        raise last if last is not None else UnavailableError("no cache node is up in the placement map")

    # -- the transport's calls, routed -------------------------------------

    def get(self, key: bytes, *, release: bool, timeout: float | None) -> bytes | None:
        """`CacheClient.get` over the cluster: a batch of one."""
        return self.get_many([key], release=release, timeout=timeout)[0]

    def get_many(self, keys: Sequence[bytes], *, release: bool, timeout: float | None) -> list[bytes | None]:
        """`CacheClient.get_many` over the cluster: each key read from one of its nodes.

        A key one of whose replicas runs on this machine is read from that
        node's shared L1 when it is published there (`cacheclient.colocated`);
        the rest are routed. With `release`, the node read ends each key's
        lease as it reads it (or is told to, for a read from its shared L1),
        and then the key's other replicas end theirs (`release_replicas`).
        """
        began = time.monotonic()
        values: list[bytes | None] = [None] * len(keys)
        served = [""] * len(keys) if release else None
        local = self._arena_reads(keys, values, served) if self.colocated else []
        rest = [i for i in range(len(keys)) if i not in set(local)] if local else range(len(keys))
        if rest:
            part = [keys[i] for i in rest]
            part_served = [""] * len(part) if release else None
            got = self._gather(
                part,
                lambda client, part, t: client.get_many(part, release=release, timeout=t),
                None,
                timeout,
                part_served,
            )
            for j, i in enumerate(rest):
                values[i] = got[j]
                if served is not None and part_served is not None:
                    served[i] = part_served[j]
        if served is not None:
            left = max((self.timeout if timeout is None else timeout) - (time.monotonic() - began), 0.5)
            by_node: dict[str, list[bytes]] = {}
            for i in local:
                by_node.setdefault(served[i], []).append(keys[i])
            for address, part in by_node.items():  # read from its shared L1: its lease is ended now
                self.node(address).release(part, timeout=left)
            self.release_replicas(keys, served, timeout=left)
        return values

    def _arena_reads(self, keys: Sequence[bytes], values: list[bytes | None], served: list[str] | None) -> list[int]:
        """Reads what it can of `keys` from the shared L1 of a replica on this machine, into `values` (and
        the node into `served`); the indexes read."""
        placement = self.placement()
        local = self._local.get()
        read: list[int] = []
        for i, key in enumerate(keys):
            replicas = self.replicas_of(key)
            owners = (placement.locate(key),) if replicas == 1 else placement.candidates(key)[:replicas]
            for address in owners:
                if address is None:
                    continue
                l1 = self._arena(local, address).get()
                if l1 is None:
                    continue
                value = l1.get(key)
                if isinstance(value, bytes):
                    values[i] = value
                    if served is not None:
                        served[i] = address
                    read.append(i)
                    break
        local.counters["arena"] += len(read)
        return read

    def _arena(self, local: _Local, address: str) -> NodeArena:
        """This process's view of the shared L1 of the node at `address` (`cacheclient.colocated`)."""
        arena = local.arenas.get(address)
        if arena is None:
            arena = local.arenas[address] = NodeArena(self.node(address))
        return arena

    def release_replicas(self, keys: Sequence[bytes], read_from: Sequence[str], *, timeout: float) -> int:
        """Ends the lease on each replicated key's replicas other than the node it was read from, at once.

        A replica that does not answer keeps its lease until the lease runs out
        (logged and counted as "release_failures"; a replica that was restarted
        lost its leases with its memory). Returns the replicas that failed.
        """
        placement = self.placement()
        by_node: dict[str, list[bytes]] = {}
        for key, reader in zip(keys, read_from, strict=True):
            replicas = self.replicas_of(key)
            if replicas < 2:
                continue
            for address in placement.candidates(key)[:replicas]:
                if address != reader:
                    by_node.setdefault(address, []).append(key)
        if not by_node:
            return 0
        local = self._local.get()
        futures = [
            (address, local.pool.submit(self.node(address).release, part, timeout=timeout))
            for address, part in by_node.items()
        ]
        failed = 0
        for address, future in futures:
            local.counters["calls"] += 1
            try:
                future.result()
            except CacheClientError as exc:
                failed += 1
                local.counters["release_failures"] += 1
                log.warning(
                    "replica %s did not end the leases of %d keys (they run out): %s",
                    address,
                    len(by_node[address]),
                    exc,
                )
        return failed

    def _gather(
        self,
        keys: Sequence[bytes],
        read: Callable[[NodeClient, list[bytes], float], Sequence[T]],
        missing: T,
        timeout: float | None,
        served: list[str] | None = None,
    ) -> list[T]:
        """One answer per key, in order: each node's share of `keys` read with `read`, at once.

        `served`, when given, gets the address of the node that answered each key.
        """
        answers: list[T] = [missing] * len(keys)

        def call(client: NodeClient, indexes: list[int], t: float) -> None:
            for i, answer in zip(indexes, read(client, [keys[i] for i in indexes], t), strict=True):
                answers[i] = answer
                if served is not None:
                    served[i] = client.address

        self.run(keys, call, write=False, timeout=timeout)
        return answers

    def iter_pieces(
        self, keys: Sequence[bytes], *, release: bool, timeout: float | None, verify: bool = True
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """`CacheClient.iter_many` over the cluster: in order, a chunk of keys read from their nodes at once.

        Each value comes whole, in one piece, verified by the node client that read it (`verify` is moot).
        """
        for start in range(0, len(keys), _ITER_CHUNK_KEYS):
            chunk = keys[start : start + _ITER_CHUNK_KEYS]
            for key, value in zip(chunk, self.get_many(chunk, release=release, timeout=timeout), strict=True):
                yield key, None if value is None else [memoryview(value)]

    def get_with_tier(self, key: bytes, *, timeout: float | None) -> tuple[bytes, str] | None:
        result: list[tuple[bytes, str] | None] = [None]

        def call(client: NodeClient, indexes: list[int], t: float) -> None:
            result[0] = client.get_with_tier(key, timeout=t)

        self.run([key], call, write=False, timeout=timeout)
        return result[0]

    def contains(self, key: bytes, *, cached_only: bool, timeout: float | None) -> bool:
        return self.contains_many([key], cached_only=cached_only, timeout=timeout)[0]

    def contains_many(self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None) -> list[bool]:
        return self._gather(
            keys, lambda client, part, t: client.contains_many(part, cached_only=cached_only, timeout=t), False, timeout
        )

    def locate_many(self, keys: Sequence[bytes], *, cached_only: bool, timeout: float | None) -> list[Location | None]:
        return self._gather(
            keys, lambda client, part, t: client.locate_many(part, cached_only=cached_only, timeout=t), None, timeout
        )

    def put_many(
        self,
        pairs: Sequence[tuple[bytes, PutValue]],
        *,
        lease: float | None,
        ttl: float | None,
        timeout: float | None,
        durable: bool,
    ) -> None:
        """`CacheClient.put_many` over the cluster: each item to every replica of its key (a co-located node's
        through its staging area, `cacheclient.staged`)."""

        def call(client: NodeClient, indexes: list[int], t: float) -> None:
            items = [pairs[i] for i in indexes]
            if not self.colocated:
                client.put_many(items, lease=lease, ttl=ttl, timeout=t, durable=durable)
                return
            local = self._local.get()
            staged = self._arena(local, client.address).put_many(
                client, items, lease=lease, ttl=ttl, durable=durable, timeout=t
            )
            local.counters["staged"] += staged

        self.run([key for key, _ in pairs], call, write=True, timeout=timeout)

    def delete(self, key: bytes, *, timeout: float | None) -> bool:
        """Deletes `key` on every replica (and in object storage); whether any held it.

        The replicas are asked one after another: each deletes the object from
        object storage too, and SeaweedFS makes one of two DELETEs of the same
        object at once wait a second (a write-through replicated delete took
        1 s, not a few ms). A replica waits for the one before it for at most
        half the deadline, and that wait counts against its own: a delete
        returns by its deadline, and a healthy replica asked after a hung one
        still answers.
        """
        existed: list[bool] = []
        one_at_a_time = threading.Lock()

        def call(client: NodeClient, indexes: list[int], t: float) -> None:
            asked = time.monotonic()
            # A replica that takes over half the time does not hold the next one up: within the
            # deadline, and a healthy replica asked after a hung one still gets half of it.
            taken = one_at_a_time.acquire(timeout=t / 2)
            try:
                left = t - (time.monotonic() - asked)
                existed.append(client.delete(key, timeout=max(0.001, left)))
            finally:
                if taken:
                    one_at_a_time.release()

        self.run([key], call, write=True, timeout=timeout)
        return any(existed)

    def evict(self, key: bytes, *, timeout: float | None) -> bool:
        """Evicts `key` from every replica's cache tiers; whether any held it."""
        existed: list[bool] = []

        def call(client: NodeClient, indexes: list[int], t: float) -> None:
            existed.append(client.evict(key, timeout=t))

        self.run([key], call, write=True, timeout=timeout)
        return any(existed)

    def prefetch(
        self, keys: list[bytes], *, window_bytes: int, sizes: Sequence[int] | None, priority: str
    ) -> SplitPrefetchPlan:
        """One plan per owner, each with its keys in plan order and a share of the window by its keys."""
        placement = self.placement()
        by_owner: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            owner = placement.locate(key)
            if owner is None:
                raise UnavailableError("no cache node is up in the placement map")
            by_owner.setdefault(owner, []).append(position)
        plans: list[tuple[list[int], PrefetchPlan]] = []
        try:
            for owner, positions in by_owner.items():
                share = max(1, window_bytes * len(positions) // max(1, len(keys)))
                plan = self.node(owner).prefetch(
                    [keys[p] for p in positions],
                    window_bytes=share,
                    sizes=[sizes[p] for p in positions] if sizes is not None else None,
                    priority=priority,
                )
                plans.append((positions, plan))
        except BaseException:
            for _, opened in plans:
                opened.close()
            raise
        owners = list(by_owner)
        return SplitPrefetchPlan(plans, owners, len(keys), placement.locate, self.node, window_bytes, priority)

    def stats(self, *, timeout: float | None) -> dict[str, Any]:
        """Every node's stats under "nodes" (an "error" for one that did not answer); tiers and counters summed."""
        placement = self.placement(timeout=timeout)
        pool = self._local.get().pool
        futures = {a: pool.submit(self.node(a).stats, timeout=timeout) for a in placement.nodes}
        nodes: dict[str, Any] = {}
        tiers: dict[str, dict[str, Any]] = {}
        counters: dict[str, int] = {}
        for address, future in futures.items():
            try:
                one = future.result()
            except CacheClientError as exc:
                nodes[address] = {"error": str(exc)}
                continue
            nodes[address] = one
            for tier in one["tiers"]:
                total = tiers.get(tier["name"])
                if total is None:
                    tiers[tier["name"]] = dict(tier)
                    continue
                for name in ("used_bytes", "capacity_bytes", "entries", "hits", "evictions"):
                    total[name] += tier[name]
            for name, value in one["counters"].items():
                counters[name] = counters.get(name, 0) + int(value)
        return {
            "tiers": list(tiers.values()),
            "counters": counters,
            "nodes": nodes,
            "placement_version": placement.version,
        }

    def wait_ready(self, timeout: float) -> None:
        """Until there is a map and every node in it accepts connections."""
        deadline = time.monotonic() + timeout
        placement = self.placement(timeout=timeout)
        if not placement.nodes:
            raise UnavailableError("no cache node is up in the placement map")
        for address in placement.nodes:
            self.node(address).wait_ready(max(0.1, deadline - time.monotonic()))

    def list(
        self, prefix: bytes, *, bucket: str, start_after: bytes, page_size: int, cached: bool, timeout: float | None
    ) -> Iterator[tuple[bytes, int]]:
        """`CacheClient.list`: every node caches the same object storage, so the first that answers lists it.

        With `cached`: every node's cached keys merged in key order, each key once.
        """
        if not cached:
            node = self.any_node(lambda c: (c.info(timeout=timeout), c)[1])
            yield from node.list(prefix, bucket=bucket, start_after=start_after, page_size=page_size, timeout=timeout)
            return
        listings = [
            self.node(address).list(
                prefix, bucket=bucket, start_after=start_after, page_size=page_size, cached=True, timeout=timeout
            )
            for address in self.placement(timeout=timeout).nodes
        ]
        last: bytes | None = None
        for key, size in heapq.merge(*listings, key=lambda entry: entry[0]):
            if key != last:
                last = key
                yield key, size

    def info(self, *, probe_object_storage: bool, timeout: float | None) -> dict[str, Any]:
        """`CacheClient.info` of the first node that answers."""
        return self.any_node(lambda c: c.info(probe_object_storage=probe_object_storage, timeout=timeout))


def _close_local(local: _Local) -> None:
    local.pool.shutdown(wait=False, cancel_futures=True)
    for client in local.clients.values():
        client.close()
    for arena in local.arenas.values():
        arena.close()


def _reason(item: _Key, address: str) -> str:
    """Why `address` failed `item`: a deadline that ran out on the last try names what the node answered before
    it (a refusal that says why, such as a server behind the map that cannot reach the shard)."""
    reason = item.failed[address]
    before = item.earlier.get(address)
    if before is not None and before != reason and reason.startswith(f"{DeadlineError.__name__}:"):
        return f"{reason} (before that: {before})"
    return reason


def _replicas_failed(
    lost: list[_Key], placement: PlacementMap, replicas: Callable[[_Key, PlacementMap], list[str]]
) -> ReplicasFailedError:
    """The error of a write whose `lost` keys did not reach every replica `placement` names."""
    failed: dict[str, str] = {}
    for item in lost:
        for address in replicas(item, placement):
            if address in item.failed:
                failed.setdefault(address, _reason(item, address))
    first = lost[0]
    took = sorted(a for a in replicas(first, placement) if a in first.done)
    why = "; ".join(f"{address}: {reason}" for address, reason in sorted(failed.items()))
    return ReplicasFailedError(
        f"{len(lost)} key(s) not written to every replica (replicas that failed: {why}); the first, "
        f"{first.key[:64]!r}, is on {', '.join(took) or 'none of its replicas'}: retry the call",
        failed,
        [item.key for item in lost],
    )
