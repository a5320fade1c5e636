"""Which keys this cache server owns, by the placement map it last fetched from the shard.

Only calls from routing clients are checked: they name the map they routed
by (`PLACEMENT_VERSION_METADATA`: its version and the shard's epoch, see
`PlacementMap.stamp`). A call without it comes from a client of this one
server and is served whatever the placement says, as before there were
clusters.

A routed call is served when this server is one of the key's replicas (the
first R of its rendezvous candidates; R from the key's namespace), or when
the client marks the call as a fallback (`ROUTE_FALLBACK`: the owners did not
answer; this node takes the keys the shard will move to it). A fallback read
of a key this server does not own checks a copy cached here against object
storage before serving it (it may date from an earlier fallback, and the
owner has taken writes since). Anything else is refused with `NotOwner`,
which names the owner and this server's map version: a client behind this
server's map is sent to the owner, not served a copy cached here before the
key moved (the owner may have taken a write the client has not seen the map
for; the Jepsen runs read such copies).

What a client names never changes what this server believes about the
placement: only maps fetched from the shard do (`update`). A client that
routed by a map this server has not caught up with (a later version, or
another epoch: the shard was rebuilt) makes it fetch the shard's map before
it decides (`fetch`: one fetch at a time, at most one per `FETCH_GAP`
seconds, so a bad client cannot make every call reach the shard). A call
that came after the last fetch began waits for the next one (up to
`FETCH_GAP`) while the shard answers: a server that fetched just before a
drain and was asked right after by a client with the drain's map refused a
read it owned by the newer map (a fresh-clone CI run); calls that came
before a fetch began share it. When the shard's map bears the client out,
the call is decided by it. Otherwise (the shard did not answer, or its map
is older than the client's) a read is decided by the map held (served, when
the shard did not answer: the client's map is likely the newer; while it
stays silent, calls within `FETCH_GAP` of its last miss are not held for
it), and a write is refused (`BehindPlacement`, UNAVAILABLE; counted as
`refused_behind_map`): the map held may not give this node the key, and
then names none of its earlier owners to fence, so a write taken by it
would be followed by their older copies (a fresh-clone CI run read 25 of
25 keys so, after the shard's answer outlasted its deadline). Nothing is
remembered of the client's map either way.

Write-back keys whose newest value may be on a node that is down are
withheld from every reader but that key's replicas (`withhold`,
`PlacementMap.withheld`): routed, fallback and direct calls alike; a peer's
fill is not a reader. The map held may be a heartbeat behind on who holds
such values: a node that held none tells the shard before it acknowledges
its next one, and a fallback reader (its client passed the owner over) with
that older map would serve object storage's older value after the put
returned (a Jepsen run read one, right after the owner's restart). So a
read of a write-back key this node is not a replica of, which the map held
does not withhold, is decided by a map fetched from the shard after the call
came (`_fresh`: one fetch at a time, which every call that came before it
began shares); when the shard does not answer, the read is refused
(`HoldersUnknown`, FAILED_PRECONDITION, as a withheld key is).

A node that takes the first write of a key the placement gave it fences the
key's earlier owners first (`cachesvc.server.fences`): a fenced server fetches
the map it was named, and while it cannot (the shard does not answer it)
refuses calls routed by a map older than that one (`raise_floor`), so no
reader is served its older copy after the write returned.

Batches are all or nothing: one refused key refuses the call (naming that
key's owner), before any key is read or written; the client re-splits the
batch by the newer map.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeGuard

from cacheclient.wire import PLACEMENT_VERSION_METADATA, ROUTE_FALLBACK, ROUTE_METADATA
from cacheclient.wire.placement import PlacementMap, parse_stamp
from cachesvc.errors import BehindPlacement, HoldersUnknown, NotOwner, Withheld

__all__ = ["Ownership", "replicas_by_prefix"]

log = logging.getLogger(__name__)


def _mapped(placement: PlacementMap | None) -> TypeGuard[PlacementMap]:
    """Whether `placement` is a map of nodes (not none yet, nor one from before any node joined)."""
    return placement is not None and bool(placement.nodes)


def replicas_by_prefix(prefixes: Sequence[tuple[bytes, int]]) -> Callable[[bytes], int]:
    """The replicas of a key: those of the longest of `prefixes` ((prefix, replicas) pairs) it starts with, else 1."""
    ordered = sorted(((p, max(1, r)) for p, r in prefixes), key=lambda x: -len(x[0]))

    def replicas(key: bytes) -> int:
        for prefix, count in ordered:
            if key.startswith(prefix):
                return count
        return 1

    return replicas


class Ownership:
    """This server's view of the placement; see the module docstring.

    Args:
        address: this server's address as registered in the shard.
        replicas: how many nodes hold a key (its namespace's `replicas`).
        fetch: fetches the shard's map now, within the seconds given, hands it
            to `update` and returns it (None: the shard did not answer); called
            when a client routes by a map this server has not caught up with.
        clock: monotonic seconds (injected for tests).
        sleep: waits the seconds given (injected for tests).
    """

    HISTORY = 3
    """Earlier placements remembered for `previous_owners`."""
    FETCH_GAP = 0.2
    """Seconds between fetches a client's newer map sets off; calls in between are decided by the map held."""
    FETCH_TIMEOUT = 1.0
    """Seconds such a fetch may take (a call waits for it)."""

    def __init__(
        self,
        address: str,
        replicas: Callable[[bytes], int] | None = None,
        fetch: Callable[[float], PlacementMap | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.address = address
        self._replicas = replicas or (lambda key: 1)
        self.fetch = fetch
        self._clock = clock
        self._sleep = sleep
        self._map: PlacementMap | None = None
        self._earlier: tuple[PlacementMap, ...] = ()
        """The maps before `_map` whose placement differed from the next one's, newest first (at most `HISTORY`)."""
        self._updating = threading.Lock()
        self._adopting = threading.Lock()
        """Held while a map is followed (`adopting`): what moved is unvouched, then the map is adopted."""
        self._fetching = threading.Lock()
        self._next_fetch = 0.0
        self._last_began = float("-inf")
        """When the last fetch a client's newer map set off began (`_catch_up`)."""
        self._fetched: tuple[float, PlacementMap] | None = None
        """When the last fetch that got the shard's map began, and that map (`_fresh`)."""
        self._shard_answered = False
        """Whether the last fetch a client set off got the shard's map."""
        self.refused_behind_map = 0
        """Writes refused because the client routed by a map this server could not fetch (`BehindPlacement`)."""
        self._floor: tuple[int, int] | None = None
        """A map (version, epoch) a peer fenced this server with that it has not fetched yet (`raise_floor`)."""
        self.on_floor: Callable[[], None] | None = None
        """Called when a peer's fence raises the floor (`raise_floor`), before the catch-up: a server stops
        co-located direct reads until it holds that map (`below_floor`)."""
        self._away = False
        """Set by `rejoined`: the next map adopted counts as a move, whatever it places where."""
        self.on_moved: Callable[[PlacementMap], None] | None = None
        """Called with each map adopted whose nodes or slots differ from the one before (the first one too), or
        that skips versions, or that is the first after `rejoined` (which calls it with the map held, too)."""
        self.in_doubt: Callable[[], bool] = lambda: False
        """Whether this node's lease in the shard may have run out (`Membership.in_doubt`): its map may be
        behind one that gave its keys to others, so co-located clients neither read its shared L1 directly nor
        write through its staging areas."""

    @property
    def placement(self) -> PlacementMap | None:
        """The map this server routes by (None until the first fetch)."""
        return self._map

    def update(self, placement: PlacementMap) -> None:
        """Adopt `placement`, a map fetched from the shard, unless it is older than the one held (same epoch)."""
        with self._updating:  # the membership loop and a call that set off a fetch may both hand one over
            self._adopt(placement)

    def _adopt(self, placement: PlacementMap) -> None:
        current = self._map
        if placement.supersedes(current):
            self._map = placement
            floor = self._floor
            if floor is not None and current is not None and floor[1] == current.epoch != placement.epoch:
                self._floor = None  # the shard was rebuilt: its maps supersede the old one's, a fence's too
            if current is not None and placement.epoch != current.epoch:
                log.warning(
                    "the metadata shard has another identity (epoch %d, was %d): it was rebuilt; following its "
                    "placement version %d (was %d)",
                    placement.epoch,
                    current.epoch,
                    placement.version,
                    current.version,
                )
            moved = (
                current is None
                or (current.nodes, current.slots) != (placement.nodes, placement.slots)
                or placement.skips(current)  # maps it never saw may have moved its keys away and back
                or self._away
            )
            self._away = False
            if current is not None and moved:
                self._earlier = (current, *self._earlier)[: self.HISTORY]
            if moved and self.on_moved is not None:
                self.on_moved(placement)
            if current is None or placement.nodes != current.nodes:
                mine = placement.nodes.index(self.address) if self.address in placement.nodes else -1
                share = placement.slots.count(mine)
                log.info(
                    "placement version %d: %d nodes; this server owns %d of %d slots",
                    placement.version,
                    len(placement.nodes),
                    share,
                    len(placement.slots),
                )

    @contextmanager
    def adopting(self) -> Iterator[None]:
        """Held while this server follows a map (`cachesvc.server.server.follow_placement`): the copies of the keys
        that moved are unvouched, then the map is adopted (and its move fences the peers again). `settled`
        waits for it."""
        with self._adopting:
            yield

    def settled(self, timeout: float) -> bool:
        """Waits until this server holds a map and is adopting none (`adopting`); False when `timeout` seconds
        pass first. A listing that vouches for cached copies waits for this (`Fences.before_listing`): a move
        being followed has unvouched copies whose peers it has not marked to be fenced yet."""
        deadline = self._clock() + timeout
        while self._map is None:
            if self._clock() >= deadline:
                return False
            self._sleep(0.05)
        if not self._adopting.acquire(timeout=max(0.0, deadline - self._clock())):
            return False
        self._adopting.release()
        return True

    def rejoined(self) -> None:
        """This node's lease may have run out and been renewed (`Membership.on_rejoin`): the shard may have
        given its keys to others meanwhile and back to it, in maps it never saw, and those nodes may still
        serve them by those maps. So its peers are fenced again before its next call (`on_moved`, at once,
        with the map held: a write may come before the shard's next map is fetched), and the next map adopted
        counts as a move even when it places every key where the map held does."""
        with self._updating:
            self._away = True
            current = self._map
            if current is not None and self.on_moved is not None:
                self.on_moved(current)

    def _catch_up(self, claim: tuple[int, int], since: float) -> bool:
        """Fetches the shard's map for a call that came at `since` routed by the map `claim` (version, epoch)
        (see the module docstring); whether the shard answered.

        One fetch at a time: calls that arrive during one wait for it and
        share it. A call that came after the last fetch began waits out
        `FETCH_GAP` from it and fetches again, unless the shard did not
        answer that one (then the call goes on by the map held at once).
        """
        if self.fetch is None:
            return False
        with self._fetching:
            held = self._map
            if _mapped(held) and not held.behind(*claim):
                return True  # a fetch this call waited for brought the client's map
            if self._last_began >= since:
                return self._shard_answered  # fetched since the call came: the shard has no newer map
            now = self._clock()
            if now < self._next_fetch:
                if not self._shard_answered:
                    return False
                self._sleep(self._next_fetch - now)
            began = self._clock()
            self._last_began = began
            self._next_fetch = began + self.FETCH_GAP
            try:
                fetched = self.fetch(self.FETCH_TIMEOUT)
            except Exception as exc:  # the data path goes on by the map held
                log.warning("placement fetch for a client ahead of this server failed: %s", exc)
                fetched = None
            self._shard_answered = fetched is not None
            if fetched is not None:
                self.update(fetched)  # before the calls that shared this fetch look at the map
        return fetched is not None

    def catch_up_to(self, version: int, epoch: int, timeout: float) -> bool:
        """Fetches the shard's map now unless the one held is at least (`version`, `epoch`) (a peer's fence);
        whether the map held is that far now. Not spaced out by `FETCH_GAP`: fences are one per peer and move."""
        placement = self._map
        if placement is not None and not placement.behind(version, epoch):
            return True
        if self.fetch is None:
            return False
        with self._fetching:
            placement = self._map
            if placement is None or placement.behind(version, epoch):
                try:
                    fetched = self.fetch(timeout)
                except Exception as exc:  # refused below instead
                    log.warning("placement fetch for a peer's fence failed: %s", exc)
                    fetched = None
                if fetched is not None:
                    self.update(fetched)
        placement = self._map
        return placement is not None and not placement.behind(version, epoch)

    def raise_floor(self, version: int, epoch: int) -> None:
        """Refuses calls routed by a map older than (`version`, `epoch`) until this server holds that map:
        a peer fenced it with that map and the shard could not be asked for it (`cachesvc.server.fences`)."""
        with self._updating:
            floor = self._floor
            if floor is None or floor[1] != epoch or version > floor[0]:
                self._floor = (version, epoch)
        if self.on_floor is not None:
            self.on_floor()

    def below_floor(self) -> bool:
        """Whether a peer fenced this server with a map newer than the one it holds (`raise_floor`)."""
        floor, placement = self._floor, self._map
        return floor is not None and (placement is None or placement.behind(*floor))

    def previous_owners(self, key: bytes) -> list[str]:
        """The nodes other than this one that held `key` by the last `HISTORY` placements before this one,
        most recent first: whom to ask for a key's bytes before object storage, after the placement moved it.

        A key this server does not own by its current map is read here for a
        client whose owners did not answer (a fallback): its current owners
        are left out, so a node that is hung or cut off, which the client has
        just waited on, is not waited on again (one peer deadline per fill).
        Only maps fetched from the shard count: a client routed by a newer
        map makes this server fetch it first (`check`).
        """
        replicas = self._replicas(key)
        skip = {self.address}
        maps = self._earlier
        current = self._map
        if current is not None and not self.owns(current, key):
            skip.update(current.candidates(key)[:replicas])
        found: list[str] = []
        for placement in maps:
            for node in placement.candidates(key)[:replicas]:
                if node not in skip and node not in found:
                    found.append(node)
        return found

    def replicas(self, key: bytes) -> int:
        """How many nodes hold `key` (its namespace's `replicas`)."""
        return self._replicas(key)

    def co_owners(self, key: bytes) -> list[str]:
        """The other replicas of `key` by the current map when this server is one of them (none otherwise)."""
        named = self._map.candidates(key)[: self._replicas(key)] if self._map is not None else []
        return [node for node in named if node != self.address] if self.address in named else []

    def stand_ins(self, key: bytes) -> list[str]:
        """The node that would own `key` in this node's place, by the current map, when this node owns it:
        the one that held it while this node was away (down, or restarting), most likely."""
        current = self._map
        if current is None or not self.owns(current, key):
            return []
        replicas = self._replicas(key)
        return [node for node in current.candidates(key)[replicas : replicas + 1] if node != self.address]

    def withhold(
        self, keys: Sequence[bytes], write_back: Callable[[bytes], bool], *, check_fresh: bool = False
    ) -> None:
        """Raises `Withheld` for the first write-back key of `keys` whose newest value may be on a holder that
        is down or does not answer, and not here (`PlacementMap.withheld`).

        With `check_fresh` (a read), a write-back key this node is not a
        replica of, that the map held does not withhold, is judged by a map
        fetched from the shard since this call (see the module docstring).

        Raises:
            Withheld: as above.
            HoldersUnknown: such a key, and the shard did not answer.
        """
        placement = self._map
        if placement is None or not (placement.holders or check_fresh):
            return
        came = self._clock()
        fresh: PlacementMap | None = None
        for key in keys:
            if not write_back(key):
                continue  # most reads (a prefix test): no slot ranked for them
            replicas = self._replicas(key)
            holder = placement.withheld(key, replicas, self.address)
            if holder is None and check_fresh and _mapped(placement) and not self.owns(placement, key):
                if fresh is None:
                    fresh = self._fresh(came)
                    if fresh is None:
                        raise HoldersUnknown(key, placement.locate(key) or "")
                holder = fresh.withheld(key, replicas, self.address)
            if holder is not None:
                raise Withheld(key, holder)

    def _fresh(self, since: float) -> PlacementMap | None:
        """A map fetched from the shard by a fetch that began at `since` or later (monotonic): the last one
        when it did, else one fetched now (one at a time: calls waiting meanwhile share it). None: the shard
        did not answer."""
        if self.fetch is None:
            return None
        with self._fetching:
            fetched = self._fetched
            if fetched is not None and fetched[0] >= since:
                return fetched[1]
            began = self._clock()
            try:
                placement = self.fetch(self.FETCH_TIMEOUT)
            except Exception as exc:  # refused by the caller
                log.warning("placement fetch for a read of another node's write-back key failed: %s", exc)
                placement = None
            if placement is not None:
                self._fetched = (began, placement)
                self.update(placement)
        return placement

    def withheld(self, key: bytes, write_back: Callable[[bytes], bool]) -> bool:
        """Whether `withhold` would refuse `key` here now."""
        placement = self._map
        if placement is None or not placement.holders or not write_back(key):
            return False
        return placement.withheld(key, self._replicas(key), self.address) is not None

    def known_nodes(self) -> set[str]:
        """Every node the current and the remembered placements name."""
        return {node for placement in (self._map, *self._earlier) if placement is not None for node in placement.nodes}

    def owns(self, placement: PlacementMap, key: bytes) -> bool:
        """Whether this server is one of `key`'s replicas by `placement`."""
        replicas = self._replicas(key)
        if replicas == 1:
            return placement.locate(key) == self.address
        return self.address in placement.candidates(key)[:replicas]

    def check(
        self,
        keys: Sequence[bytes],
        metadata: Mapping[str, str | bytes],
        suspect: Callable[[bytes], object] | None = None,
        *,
        write: bool = False,
    ) -> None:
        """Raises `NotOwner` for the first of `keys` this server must not serve to the caller, and
        `BehindPlacement` for a `write` routed by a map this server could not catch up with.

        Args:
            keys: the call's keys.
            metadata: the call's invocation metadata.
            suspect: for a read, called with each key of a fallback read that
                this server does not own by its map: a copy cached here may be
                older than what the owner took (checked against object storage
                before it is served); None for a write.
            write: the call writes the keys (a put or a delete).
        """
        routed = metadata.get(PLACEMENT_VERSION_METADATA)
        if routed is None:
            return
        came = self._clock()
        placement = self._map
        if metadata.get(ROUTE_METADATA) == ROUTE_FALLBACK:
            if suspect is not None and _mapped(placement):
                for key in keys:
                    if not self.owns(placement, key):
                        suspect(key)
            return
        claim = parse_stamp(routed)
        if claim is None:
            return
        if not _mapped(placement) or placement.behind(*claim):
            # A map newer than ours, or none yet (a server whose first fetch found no map of nodes, and whose
            # next heartbeat is far off, took every write unchecked: it fenced nobody).
            answered = self._catch_up(claim, came)
            placement = self._map
            if write and keys and (not _mapped(placement) or placement.behind(*claim)):
                self.refused_behind_map += 1
                raise BehindPlacement(keys[0], placement.version if placement is not None else 0, claim[0])
            if not _mapped(placement):
                return  # reads are served by no map as before
            if not answered:
                return  # the shard did not answer: the client's map is likely the newer; served
        floor = self._floor
        if floor is not None and keys:
            if not placement.behind(*floor):
                self._floor = None
            elif claim[1] in (0, floor[1]) and claim[0] < floor[0]:
                # A peer took writes by a newer map this server could not fetch: it may not own these keys.
                raise NotOwner(keys[0], "", floor[0])
        for key in keys:
            if not self.owns(placement, key):
                raise NotOwner(key, placement.locate(key) or "", placement.version)
