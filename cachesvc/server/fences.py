"""Fences: before a node takes its first write of a key the placement gave it, the key's earlier owners learn so.

Servers follow the placement after each heartbeat, so for a moment after a
move the key's earlier owner still takes itself for the owner, while a
writer's client already routes by the new map. Without a fence, a put
through the new owner returns, and then a reader whose client still holds
the older map is served the earlier owner's older copy (the Jepsen runs
saw it right after a drained node was put back).

So `Fences.before_serving` runs on every call a client sends (put, delete,
and reads too) once the ownership check passed. When the map moved since this
node last fenced its peers, it sends `Fence` (one RPC, admin scope) to the
key's earlier owners (`Ownership.previous_owners`) and the node that would
own it in this one's place (`Ownership.stand_ins`: the one that stood in
while this node was down or drained) before the write is taken. The fenced
node (`fenced`) fetches the shard's map before it answers, so calls routed
by the older map are refused (`NotOwner`) and their clients move; when the
shard does not answer it, it refuses calls routed by a map older than the
one it was named until it has fetched one (`Ownership.raise_floor`), and its
co-located clients read nothing directly until it holds that map
(`Engine.hold_direct_reads`: following a map marks the copies that moved in
its L2 file, which can outlast the peer's wait); and it
waits for the writes it took by the older map that are still under way
(`writing`), so none of them completes after its answer. Reads fence too:
the new owner's first read of a key that moved vouches for a copy by what
the earlier owner and object storage hold at that moment (`cachesvc.engine`),
and an earlier owner still taking writes by the older map would make that
copy stale as soon as it was vouched for (the Jepsen runs read one, through
a drain, for seconds). Each
peer is fenced once per move: later writes cost one set test. A peer that
does not answer within `TIMEOUT` is counted (`fence_errors`) and not waited
on again for this move (it is down, or cut off from this node; a node cut
off from clients too serves none).

Fences also order write-back uploads (`UploadOrder`, `sole_writer`). A
node's upload of a value it accepted while it owned the key, with no move
since, needs no check of the object's version first: no other node can
have taken a newer write of the key, because that node would have fenced
this one first, and a fence waits for such uploads to finish. Every other
upload (a move since, a value read back from disk after a restart) asks
object storage for the object's version first (one HEAD), as before.

Cost: one set test per call while no move is pending; one RPC per peer (in
the call that finds it pending) per move; a write holds a counter while it
runs (`writing`, with its ownership checked once more inside it).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from cacheclient.errors import CacheClientError
from cacheclient.node import NodeClient
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire.placement import PlacementMap
from cachesvc.server.ownership import Ownership

__all__ = ["Fences"]

log = logging.getLogger(__name__)


class Fences:
    """This node's fences of its peers, and the fences its peers set (see the module docstring).

    Args:
        ownership: this node's placements.
        stamp: the engine's version clock (`VersionClock.next`): a move is
            stamped on the clock that stamps values, so an upload can tell a
            value accepted before it from one accepted after.
        token: the bearer token peers require for `Fence` (the admin token, or the one token).
        tls_ca: the PEM roots that sign peers' certificates, when they serve TLS.
        timeout: seconds a peer has to answer a fence, and a fenced node to fetch the map.
    """

    TIMEOUT = 2.0

    def __init__(
        self,
        ownership: Ownership,
        stamp: Callable[[], int],
        *,
        token: str = "",
        tls_ca: bytes | None = None,
        timeout: float = TIMEOUT,
    ) -> None:
        self._ownership = ownership
        self._stamp = stamp
        self._token = token
        self._tls_ca = tls_ca
        self._timeout = timeout
        self._round = threading.Lock()
        """One round of fences at a time: a write that waits for it finds its peers fenced."""
        self._uploads = threading.Condition()
        self._in_flight = 0
        """Uploads under way that skipped the version check (`sole_writer`)."""
        self._moved_at = 0
        """The version clock's stamp of the last move of the placement, or the last fence by a peer."""
        self._pending: frozenset[str] = frozenset()
        """The peers not fenced since the last move."""
        self._moves = 0
        """Moves seen: a round of fences that began before the last one does not count for it."""
        self._clients: dict[str, NodeClient] = {}
        self._writes = itertools.count()
        self._writing: set[int] = set()
        """The writes under way (`writing`), which a fence waits for."""
        self._counters: Counter[str] = Counter()
        ownership.on_moved = self.moved

    # -- this node's side: fencing peers before a write ------------------------

    def moved(self, placement: PlacementMap) -> None:
        """The placement moved (`Ownership.on_moved`): every peer is fenced again before a write of its keys."""
        peers = self._ownership.known_nodes() - {self._ownership.address}
        with self._uploads:
            self._moved_at = self._stamp()
            self._pending = frozenset(peers)
            self._moves += 1

    def before_serving(self, keys: Sequence[bytes]) -> None:
        """Fences the earlier owners and stand-ins of `keys` that are not fenced since the last move, before a
        write or a read of them is served."""
        pending = self._pending
        if not pending:
            return
        targets = {
            node
            for key in keys
            for node in (*self._ownership.previous_owners(key), *self._ownership.stand_ins(key))
            if node in pending
        }
        if targets:
            self._fence(targets)

    def fence(self, node: str) -> None:
        """Fences `node` now unless it is fenced since the last move (`cachesvc.server.handover`)."""
        if node in self._pending:
            self._fence({node})

    def before_listing(self, timeout: float) -> bool:
        """Before a listing may vouch for cached copies (`cachesvc.engine.vouching`): this node holds a map and
        follows none (`Ownership.settled`), and every peer not fenced since the last move is fenced now. A
        listing sent after that shows every write a peer took by an older map, since a fenced peer finishes
        those first; one sent before might not (the Jepsen runs read a key's older value after an undrain,
        vouched by a listing sent before the drained node's stand-in was fenced). As for a read's fence, a
        peer that does not answer is not waited on again. False: no map within `timeout` seconds (nothing
        is fenced; the listing decides nothing)."""
        if not self._ownership.settled(timeout):
            return False
        pending = self._pending
        if pending:
            self._fence(set(pending))
        return True

    def _fence(self, targets: set[str]) -> None:
        with self._round:
            placement = self._ownership.placement
            if placement is None:
                return
            moves = self._moves
            for node in sorted(targets & self._pending):
                try:
                    self._client(node).rpc(
                        "Fence", pb.FenceRequest(version=placement.version, epoch=placement.epoch), self._timeout
                    )
                except CacheClientError as exc:
                    failed: CacheClientError | None = exc
                    log.warning("peer %s did not answer a fence (%s); calls go on without it for this move", node, exc)
                else:
                    failed = None
                with self._uploads:
                    self._counters["fence_errors" if failed else "fences_sent"] += 1
                    if self._moves == moves:  # a later move fences it again
                        self._pending = self._pending - {node}

    def _client(self, node: str) -> NodeClient:
        client = self._clients.get(node)
        if client is None:
            client = self._clients[node] = NodeClient(
                node, timeout=self._timeout, token=self._token or None, tls_ca=self._tls_ca
            )
            for old in [a for a in self._clients if a not in self._ownership.known_nodes()]:
                self._clients.pop(old).close()
        return client

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Holds a write as under way for its whole length: a fence that comes meanwhile answers only once it
        is done. The caller checks the write's ownership inside (again), so a write either was admitted before
        the fence moved this node's map, and is waited for, or is judged by the map the fence brought."""
        with self._uploads:
            write = next(self._writes)
            self._writing.add(write)
        try:
            yield
        finally:
            with self._uploads:
                self._writing.discard(write)
                self._uploads.notify_all()

    # -- a peer's side: being fenced -------------------------------------------

    def fenced(self, version: int, epoch: int) -> PlacementMap | None:
        """A peer is about to take writes by map (`version`, `epoch`): catch up with it, and let no upload
        that skipped its version check run past this answer. Returns the map held now."""
        with self._uploads:
            self._moved_at = self._stamp()  # uploads from here on check the object's version first
            self._counters["fenced"] += 1
        held = self._ownership.placement
        if held is None or held.behind(version, epoch):
            # Calls routed by older maps are refused from now on, not once the catch-up below is done: following
            # a map rechecks what is cached of the keys that moved (an L2 scan), which can outlast the peer's
            # deadline. The floor lifts itself once this node holds that map (`Ownership.check`).
            self._ownership.raise_floor(version, epoch)
        if not self._ownership.catch_up_to(version, epoch, self._timeout):
            log.warning(
                "fenced by a peer with placement version %d, which the metadata shard did not give this node: "
                "calls routed by older maps are refused until it does",
                version,
            )
            self._ownership.raise_floor(version, epoch)
        with self._uploads:
            before = set(self._writing)  # admitted by the map held before this fence, the older one
            if not self._uploads.wait_for(lambda: self._in_flight == 0 and not before & self._writing, self._timeout):
                log.warning(
                    "an upload or a write was still under way after %gs when a peer fenced this node", self._timeout
                )
        return self._ownership.placement

    # -- write-back uploads (`cachesvc.engine.writeback.UploadOrder`) ----------

    @contextmanager
    def sole_writer(self, key: bytes, version: int) -> Iterator[bool]:
        """Whether the upload of `key` at `version` needs no version check (see the module docstring); a
        fence waits for the upload to finish while the context is open."""
        with self._uploads:
            placement = self._ownership.placement
            sole = version > self._moved_at and placement is not None and self._ownership.owns(placement, key)
            if sole:
                self._in_flight += 1
        try:
            yield sole
        finally:
            if sole:
                with self._uploads:
                    self._in_flight -= 1
                    self._uploads.notify_all()

    def counters(self) -> dict[str, int]:
        """fences_sent, fence_errors (peers that did not answer) and fenced (fences by peers)."""
        with self._uploads:
            return dict(self._counters)

    def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
