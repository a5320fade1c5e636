"""Vouching in bulk: cached copies checked against object-storage listings, a page of up to 1,000 at a time.

A node that cannot say its cached copies are the newest (back from a
restart, from a lost lease, or given keys that were elsewhere) must check
each before serving it (`ReadPath`, STYLE rule 12). One HEAD per copy costs
a cold start; a listing (ListObjectsV2) shows up to 1,000 objects per request
with each one's ETag, size and last-modified time, and the node's keys, in
object-name order, can be walked beside it.

What a listing entry proves (`decide`): a listing carries no user metadata,
so neither the xxh3 checksum nor the version our writes store. It carries
the ETag, which for an object PUT whole is the MD5 of its bytes (S3, MinIO
and SeaweedFS alike; an object uploaded in parts has "<md5>-<parts>"). A copy
is kept when the listed object has its size and a plain-MD5 ETag equal to the
MD5 of the copy's bytes: the object holds exactly those bytes now, which is
what a HEAD's check establishes too (`S3Tier.vouch`). It is dropped when the
object is gone (absent from a page that covers its name) or shows another
size or another plain MD5. Anything else is left to the copy's first read
(one HEAD, `ReadPath`): an ETag of parts, an object named by a digest
(long keys: a listing cannot say which key it holds), a dirty copy, and, in a
cluster, a key of a write-back namespace (a peer may hold a newer value that
object storage lacks; only that peer can say). A kept copy keeps the version
it was stored with; the node's clock observes the object's last-modified time
(an object rewritten with the same bytes may carry a later version).

Order: a copy's bytes are read, and a read of it registered (`Placement.reads`),
before the listing request is sent; a put or a fill of the key meanwhile
ends that read changed, and the listing decides nothing for it.

In a cluster, the listing waits for the node's peers to be fenced (`gate`,
`cachesvc.server.fences`): after a move, the node that held a key meanwhile
may still take writes of it by its older map, and a listing sent before it
learns of the move may miss one it acknowledges (the Jepsen runs read a key's
older value after an undrain so). A page whose gate does not open decides
nothing; its copies are checked at their first read, which fences first.

Some copies need no listing: a content-addressed value, whose key ends in
"/~/" and the 32 hex digits of its bytes' xxh3-128 (checkpoint chunks,
`cacheclient.checkpoint.layout`), is kept when its bytes match its name (a
value of that name can be no other); the engine does not mark the copies of
an immutable namespace unvouched at all.

`decide` and `covered` are the pure core; `BulkVouching` is the driver: a
background walk from the moment the engine starts (at most `in_flight`
listings at once), and `vouch_around`, which a read of a copy not yet vouched
calls to vouch its own page (it and the up to 999 copies after it) first, or
to wait for the page already in flight that holds it.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from cachesvc.engine.keystate import KeyState
from cachesvc.engine.placement import Level
from cachesvc.engine.races import Read
from cachesvc.engine.versions import VersionClock, stamp
from cachesvc.errors import CacheError
from cachesvc.tiers.base import Entry, ListedObject, NamedListingTier

__all__ = [
    "BulkVouching",
    "Copy",
    "ListedPages",
    "Verdict",
    "before",
    "content_addressed",
    "covered",
    "decide",
    "plain_md5",
]

log = logging.getLogger(__name__)

PAGE = 1000
"""Objects per listing request (ListObjectsV2's most)."""


class Verdict(enum.Enum):
    """What a listing entry says of a cached copy."""

    KEEP = "keep"
    """The object holds the copy's bytes: the copy is vouched for."""
    DROP = "drop"
    """The object is gone or holds other bytes: the copy goes."""
    ASK = "ask"
    """A listing cannot tell: the copy's first read checks it alone (one HEAD)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """What the node holds of one key, as a listing can compare it."""

    name: str
    """The name of the key's object."""
    size: int
    md5: str
    """MD5 of the copy's bytes, lowercase hex."""


_CONTENT_NAME = re.compile(rb"/~/([0-9a-f]{32})\Z")


def content_addressed(key: bytes, value: bytes | memoryview) -> bool:
    """Whether `key` names its value's content: it ends in "/~/" and the xxh3-128 of `value` in hex (a checkpoint
    chunk's name, `cacheclient.checkpoint.layout`)."""
    named = _CONTENT_NAME.search(key)
    return named is not None and xxhash.xxh3_128_hexdigest(value).encode() == named.group(1)


def plain_md5(etag: str) -> bool:
    """Whether `etag` (quotes taken off) is a plain MD5: 32 hex digits, not an ETag of parts."""
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)


def decide(copy: Copy, listed: ListedObject | None) -> Verdict:
    """What a listing says of `copy`: `listed` is its object's entry, None when a page that covers the
    copy's name does not show it (see the module docstring)."""
    if listed is None or listed.size != copy.size:
        return Verdict.DROP
    if not plain_md5(listed.etag):
        return Verdict.ASK
    return Verdict.KEEP if listed.etag.lower() == copy.md5 else Verdict.DROP


def before(name: str) -> str:
    """A `StartAfter` under `name`, so a listing from it shows `name` itself, with as few other names first as
    it can (names are compared as UTF-8 bytes, which is code-point order)."""
    if not name:
        return ""
    last = ord(name[-1])
    if last == 0:
        return name[:-1]
    last -= 1
    if 0xD800 <= last <= 0xDFFF:
        last = 0xD7FF  # no surrogate in a name
    return name[:-1] + chr(last)


def covered(
    names: Sequence[str], start_after: str, listed: Sequence[ListedObject], more: bool
) -> tuple[int, dict[str, ListedObject]]:
    """How many of `names` (sorted, each after `start_after`) a page decides, and the page's entries by name.

    A page lists every object named after `start_after` up to its last entry,
    or to the end when no more follow: each name in that range is decided
    (shown, or gone). The names past a truncated page's last entry are not.
    """
    found = {entry.name: entry for entry in listed}
    if not more:
        return len(names), found
    if not listed:
        return 0, found
    return bisect.bisect_right(names, listed[-1].name), found


@dataclass(slots=True)
class _Progress:
    """What the walk has done since copies last needed checking."""

    held: int = 0
    checked: int = 0
    kept: int = 0
    dropped: int = 0
    asked: int = 0
    listings: int = 0
    began: float = 0.0
    ended: float = 0.0


class BulkVouching:
    """Vouches unvouched cached copies from listings (see the module docstring).

    Args:
        store: object storage that lists its objects (`NamedListingTier`).
        state: the key state (which copies are unvouched).
        lock: the engine lock, which guards `state`.
        peek: a copy's bytes and a read registered before they were taken (`ReadPath.peek`); None: not cached.
        end_read: ends such a read under the engine lock; whether the copy is unchanged since.
        drop: drops a copy found stale, under the engine lock (`ReadPath.drop_stale`).
        eligible: whether a listing may vouch for the copy of a key (engine lock held): not dirty, not a
            range key, not one only a peer can speak for.
        counters: the engine's counters.
        versions: the node's version clock (it observes a kept object's last-modified time).
        in_flight: listings at once in the background walk.
        wait: seconds a read waits for the page in flight that holds its key, and a listing for `gate`.
        gate: waited for before each listing (see the module docstring); None: nothing to wait for.
    """

    def __init__(
        self,
        *,
        store: NamedListingTier,
        state: KeyState[Level],
        lock: threading.RLock,
        peek: Callable[[bytes], tuple[Entry, Read] | None],
        end_read: Callable[[Read], bool],
        drop: Callable[[bytes], None],
        eligible: Callable[[bytes], bool],
        counters: Counter[str],
        versions: VersionClock,
        in_flight: int = 4,
        wait: float = 30.0,
        gate: Callable[[float], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._state = state
        self._lock = lock
        self._peek = peek
        self._end_read = end_read
        self._drop = drop
        self._eligible = eligible
        self._counters = counters
        self._versions = versions
        self._in_flight = max(1, in_flight)
        self._wait = wait
        self._gate = gate
        self._clock = clock
        self._mu = threading.Lock()
        self._names: list[str] = []
        """Object names of the copies to check, sorted (the walk's snapshot)."""
        self._keys: dict[str, bytes] = {}
        self._pending: dict[bytes, threading.Event] = {}
        """Keys a listing in flight will decide: a read of one waits for it."""
        self._progress = _Progress()
        self._walk: threading.Thread | None = None
        self._again = False
        self._closed = False
        self._on_demand = threading.Semaphore(self._in_flight)
        self.walks: Callable[[bytes], bool] | None = None
        """Which copies a listing vouches for now, asked once `gate` opened (a cluster node's: those of the keys
        its map gives it; a copy of a key that moved away waits for its first read, if it comes back). None:
        every copy."""
        self._generation = 0
        """Bumped (engine lock held) each time copies are unvouched anew: a page begun before decides nothing."""

    # -- the driver's entry points ----------------------------------------------

    def start(self) -> None:
        """Walks every unvouched copy now, in the background (again if a walk is running: it starts over)."""
        with self._lock:
            keys = self._state.unvouched_keys()
        named = sorted((self._store.object_name(key), key) for key in keys)
        with self._mu:
            if self._closed:
                return
            self._names = [name for name, _ in named]
            self._keys = dict(named)
            progress = self._progress
            if self._walk is None or progress.ended:
                self._progress = _Progress(held=len(named), began=self._clock())
            else:
                progress.held = progress.checked + len(named)
            if not named:
                return
            if self._walk is not None and self._walk.is_alive():
                self._again = True
                return
            self._walk = threading.Thread(target=self._run, name="vouch-walk", daemon=True)
            self._walk.start()

    def unvouching(self) -> None:
        """Copies are about to be unvouched anew (a move, a rejoin; engine lock held): a listing sent before
        may predate writes made elsewhere meanwhile, so the pages in flight decide nothing (their keys are
        walked again)."""
        self._generation += 1

    def close(self) -> None:
        """Stops the walk (the page in flight finishes)."""
        with self._mu:
            self._closed = True
            walk = self._walk
        if walk is not None:
            walk.join(timeout=self._wait)

    def progress(self) -> dict[str, float | int]:
        """Copies to check since the last restart or move, how many are checked, and the rate (copies/s)."""
        with self._mu:
            p = self._progress
            end = p.ended or self._clock()
            seconds = max(end - p.began, 1e-9) if p.began else 0.0
            return {
                "held": p.held,
                "checked": p.checked,
                "kept": p.kept,
                "dropped": p.dropped,
                "left_to_reads": p.asked,
                "listings": p.listings,
                "seconds": round(seconds, 3),
                "rate": round(p.checked / seconds, 1) if seconds else 0.0,
                "done": bool(p.ended) or not p.held,
            }

    def vouch_around(self, key: bytes) -> None:
        """Before a read checks the copy of `key` alone: the listing page in flight that holds it is awaited, or
        one is made for it and the copies after it. Errors are the read's own check's to meet (nothing raised)."""
        with self._mu:
            waiting = self._pending.get(key)
            name = None if waiting is not None else self._store.object_name(key)
            if name is not None and name not in self._keys:
                self._keys[name] = key
                bisect.insort(self._names, name)
        if waiting is not None:
            waiting.wait(self._wait)
            return
        assert name is not None
        if not self._on_demand.acquire(timeout=self._wait):
            return
        try:
            self._page(self._names_from(name), before(name))
        except Exception as exc:  # the read's own check meets it (a HEAD, or TierUnavailable)
            log.debug("listing around %r failed: %s", key[:64], exc)
        finally:
            self._on_demand.release()

    def vouch_keys(self, keys: Sequence[bytes]) -> None:
        """`vouch_around` for each of `keys` whose copy is still unvouched once the pages before it are done:
        a batch read checks its copies a page at a time, then reads them as one batch."""
        for key in keys:
            with self._lock:
                if not self._state.unvouched(key) or not self._eligible(key):
                    continue
            self.vouch_around(key)

    # -- the walk -----------------------------------------------------------------

    def _names_from(self, name: str) -> list[str]:
        with self._mu:
            i = bisect.bisect_left(self._names, name)
            return self._names[i : i + PAGE]

    def _run(self) -> None:
        while True:
            with self._mu:
                names, self._again = list(self._names), False
            step = max(PAGE, -(-len(names) // self._in_flight))
            segments = [names[i : i + step] for i in range(0, len(names), step)]
            walkers = [
                threading.Thread(target=self._walk_segment, args=(segment,), name="vouch-walk", daemon=True)
                for segment in segments
            ]
            for walker in walkers:
                walker.start()
            for walker in walkers:
                walker.join()
            with self._mu:
                if self._again and not self._closed:
                    continue
                self._progress.ended = self._clock()
                progress = self._progress
            with self._lock:
                left = self._state.unvouched_count()
            seconds = progress.ended - progress.began
            if left == 0:
                log.info(
                    "every cached copy is vouched for: %d checked in %.1f s (%d listings, %d dropped)",
                    progress.checked,
                    seconds,
                    progress.listings,
                    progress.dropped,
                )
            else:
                log.info(
                    "%d cached copies vouched for by listing in %.1f s (%d listings, %d dropped); %d are checked "
                    "at their first read (dirty, named by digest, uploaded in parts, only a peer can say, or "
                    "object storage did not list them)",
                    progress.kept,
                    seconds,
                    progress.listings,
                    progress.dropped,
                    left,
                )
            return

    def _walk_segment(self, names: list[str]) -> None:
        i, start_after = 0, before(names[0]) if names else ""
        while i < len(names):
            with self._mu:
                if self._closed or self._again:
                    return
            batch = names[i : i + PAGE]
            start_after = max(start_after, before(batch[0]))
            try:
                done, last = self._page(batch, start_after)
            except Exception as exc:  # reads check their copies alone (a HEAD each)
                with self._lock:
                    self._counters["vouch_list_errors"] += 1
                log.warning(
                    "listing object storage to vouch for cached copies failed; each is checked at its first read "
                    "instead: %s",
                    exc,
                )
                return
            if not done and not last:
                return  # nothing listed and nothing decided: no progress to make
            i += done
            if last:
                start_after = max(start_after, last)

    def _page(self, names: list[str], start_after: str) -> tuple[int, str]:
        """Decides what one listing page covers of `names` (sorted, after `start_after`); returns how many of
        `names` it covered and the last name it listed ("" when none)."""
        with self._mu:
            keys = [self._keys[name] for name in names]
            mine = [key for key in keys if key not in self._pending]
            event = threading.Event()
            for key in mine:
                self._pending[key] = event
        try:
            return self._decide_page(names, keys, set(mine), start_after)
        finally:
            with self._mu:
                for key in mine:
                    if self._pending.get(key) is event:
                        del self._pending[key]
            event.set()

    def _decide_page(self, names: list[str], keys: list[bytes], mine: set[bytes], start_after: str) -> tuple[int, str]:
        with self._lock:
            generation = self._generation
        if self._gate is not None and not self._gate(self._wait):
            with self._lock:
                self._counters["vouch_gate_timeouts"] += 1
            log.warning("no placement map to fence this node's peers by: listings vouch for nothing yet")
            return 0, ""  # decides nothing: the walk stops, and reads check their copies (fenced first)
        skipped = 0
        todo: list[tuple[str, bytes]] = []
        walks = self.walks
        with self._lock:
            for name, key in zip(names, keys, strict=True):
                if key not in mine or not self._state.unvouched(key):
                    continue
                if self._eligible(key) and not self._store.hashed_name(name) and (walks is None or walks(key)):
                    todo.append((name, key))
                else:
                    skipped += 1
        with self._mu:
            self._progress.asked += skipped
        if not todo:
            return len(names), ""
        copies: list[tuple[bytes, Copy, Read]] = []
        gone: list[bytes] = []
        named: list[tuple[bytes, Read]] = []
        for name, key in todo:
            peeked = self._peek(key)
            if peeked is None:
                gone.append(key)
                continue
            entry, ticket = peeked
            if content_addressed(key, entry.value):
                named.append((key, ticket))
                continue
            md5 = hashlib.md5(entry.value, usedforsecurity=False).hexdigest()
            copies.append((key, Copy(name, len(entry.value), md5), ticket))
        listed, more = self._store.list_after(start_after, PAGE) if copies else ([], False)
        done, found = covered(names, start_after, listed, more) if copies else (len(names), {})
        decided = set(names[:done])
        counts: Counter[Verdict] = Counter()
        with self._lock:
            if copies:
                self._counters["vouch_listings"] += 1
            if generation != self._generation:
                for _, _, ticket in copies:
                    self._end_read(ticket)
                for _, ticket in named:
                    self._end_read(ticket)
                return done, listed[-1].name if listed else ""  # copies unvouched anew meanwhile: walked again
            for key in gone:
                self._state.vouch(key)  # no copy left to check (as a read finds it)
            kept: list[bytes] = []
            for key, ticket in named:
                if self._end_read(ticket) and self._state.unvouched(key) and not self._state.dirty(key):
                    kept.append(key)  # its bytes are what its name says: no other value can be there
                    self._counters["vouch_by_content"] += 1
                    counts[Verdict.KEEP] += 1
            for key, copy, ticket in copies:
                unchanged = self._end_read(ticket)
                if copy.name not in decided or not unchanged or not self._state.unvouched(key):
                    continue  # not covered, or replaced meanwhile (a put or a fill vouches for its own copy)
                if self._state.dirty(key):
                    continue
                listed_entry = found.get(copy.name)
                verdict = decide(copy, listed_entry)
                counts[verdict] += 1
                if verdict is Verdict.KEEP:
                    assert listed_entry is not None
                    kept.append(key)
                    self._state.known_current(key)
                    self._versions.observe(stamp(int(listed_entry.modified * 1000) + 1000))
                    self._counters["vouch_listed"] += 1
                elif verdict is Verdict.DROP:
                    self._counters["vouch_list_drops"] += 1
                    try:
                        self._drop(key)
                    except CacheError as exc:
                        log.warning("a stale cached copy of %r could not be dropped: %s", key[:64], exc)
            self._state.vouch_many(kept)  # their marks in L2's file go in one write
        with self._mu:
            p = self._progress
            p.listings += 1 if copies else 0
            p.kept += counts[Verdict.KEEP]
            p.dropped += counts[Verdict.DROP]
            p.asked += counts[Verdict.ASK]
            p.checked += counts[Verdict.KEEP] + counts[Verdict.DROP] + len(gone)
        return done, listed[-1].name if listed else ""


@dataclass(frozen=True, slots=True)
class _Page:
    """One listing page `ListedPages` keeps."""

    after: str
    """The `StartAfter` it was listed from."""
    last: str
    """Its last name ("" when it listed none)."""
    more: bool
    found: dict[str, ListedObject]
    sent: float
    """When its request was sent (monotonic seconds)."""
    writes: int
    """`ListedPages` writes noted before its request was sent."""

    def covers(self, name: str) -> bool:
        """Whether the page decides `name`: shown, or gone (see `covered`)."""
        return name > self.after and (not self.more or (bool(self.last) and name <= self.last))


class ListedPages:
    """Listing pages kept a few seconds, to check the copies peers give a page at a time, not with a HEAD each.

    When a join or a drain gives a node keys, it reads their bytes from
    their previous owners (`cachesvc.server.peers`) and checks each copy
    against object storage before keeping it: the previous owner's copy may
    be older than the object. One listing page (the copy's name and up to
    999 after it) decides as many copies as it covers, by `decide`'s rule,
    and is kept `ttl` seconds for the copies that follow.

    A page shows object storage as it was when it was sent, so it decides
    nothing for a key this node wrote or deleted since (`wrote`, told once
    the write is done with object storage: a page sent after that shows it;
    one sent before is passed over and a new page listed); and no page sent
    before the last move is used (`moved`): until the move's peers are
    fenced (`gate`, as `BulkVouching` waits for), one of them may still take
    writes by the older map. After a move only this node takes writes of the
    keys it is given, so a kept page can miss nothing the cluster wrote. It
    can miss an object rewritten behind the cluster's back (straight into the
    bucket) within `ttl` of its listing, which a HEAD at the fill would see.

    Args:
        store: object storage that lists its objects.
        gate: waited for before each listing, with the seconds it may take (see `BulkVouching`); None: nothing.
        ttl: seconds a page is used after its request was sent.
        pages: pages kept at most (the oldest go first).
        wait: seconds a listing may wait for `gate`.
    """

    def __init__(
        self,
        store: NamedListingTier,
        gate: Callable[[float], bool] | None = None,
        *,
        ttl: float = 5.0,
        pages: int = 64,
        wait: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._gate = gate
        self._ttl = ttl
        self._max_pages = max(1, pages)
        self._wait = wait
        self._clock = clock
        self._mu = threading.Lock()
        self._listing = threading.Lock()
        """One listing at a time: the fills that wait for it find their names on its page."""
        self._pages: list[_Page] = []
        self._writes = 0
        self._written: OrderedDict[str, tuple[int, float]] = OrderedDict()
        """Names written since the oldest page a kept page could be: the count of writes then, and when."""
        self._moves = 0
        self._waiting: Counter[str] = Counter()
        """Names whose checks wait for the listing under way."""
        self.listings = 0

    def wrote(self, key: bytes) -> None:
        """A put or a delete of `key` is done with object storage (or failed not knowing): pages sent before
        decide nothing for it."""
        name = self._store.object_name(key)
        now = self._clock()
        with self._mu:
            self._writes += 1
            self._written[name] = (self._writes, now)
            self._written.move_to_end(name)
            while self._written:
                _, (_, at) = next(iter(self._written.items()))
                if now - at <= self._ttl:
                    break
                self._written.popitem(last=False)

    def moved(self) -> None:
        """The placement moved: every page sent before decides nothing (their keys' peers were not fenced)."""
        with self._mu:
            self._moves += 1
            self._pages.clear()

    def check(self, key: bytes, value: bytes | memoryview) -> Verdict:
        """What a listing page says of `value` as the object of `key`: KEEP, DROP, or ASK (a page could not
        be had or cannot tell: the caller checks the copy alone)."""
        name = self._store.object_name(key)
        if self._store.hashed_name(name):
            return Verdict.ASK
        page = self._page_for(name)
        if page is None:
            return Verdict.ASK
        md5 = hashlib.md5(value, usedforsecurity=False).hexdigest()
        return decide(Copy(name, len(value), md5), page.found.get(name))

    def _usable(self, name: str) -> _Page | None:
        """A kept page that decides `name` (mutex held)."""
        now = self._clock()
        self._pages = [page for page in self._pages if now - page.sent <= self._ttl]
        written = self._written.get(name)
        for page in self._pages:
            if page.covers(name) and (written is None or written[0] <= page.writes):
                return page
        return None

    def _page_for(self, name: str) -> _Page | None:
        with self._mu:
            page = self._usable(name)
        if page is not None:
            return page
        with self._mu:
            self._waiting[name] += 1
        try:
            if not self._listing.acquire(timeout=self._wait):
                return None
        finally:
            with self._mu:
                self._waiting[name] -= 1
                if not self._waiting[name]:
                    del self._waiting[name]
        try:
            with self._mu:
                page = self._usable(name)  # listed meanwhile by the fill before this one
                moves = self._moves
                # The lowest name a fill waits to see decided: a page from there serves it and those after.
                low = min((n for n in self._waiting if n < name and self._usable(n) is None), default=name)
            if page is not None:
                return page
            if self._gate is not None and not self._gate(self._wait):
                return None
            # On from the end of a page that stopped short of `low` (pages side by side, not overlapping, as the
            # fills of a move come in any order), for at most `HOPS` pages; then from `name` itself.
            short = [page.last for page in self._pages if page.more and page.last and page.last < low]
            after = max(short) if short else before(low)
            for hop in range(self.HOPS + 1):
                if hop == self.HOPS:
                    after = before(name)
                page = self._list(after, moves)
                if page is None or page.covers(name):
                    return page
                after = page.last
            return None
        finally:
            self._listing.release()

    HOPS = 2
    """Pages listed on from an earlier page's end before listing from a name itself."""

    def _list(self, after: str, moves: int) -> _Page | None:
        """One page listed after `after` and kept; None when a move came meanwhile (its `_moves` is not `moves`)."""
        with self._mu:
            writes, sent = self._writes, self._clock()
        listed, more = self._store.list_after(after, PAGE)
        page = _Page(after, listed[-1].name if listed else "", more, {e.name: e for e in listed}, sent, writes)
        with self._mu:
            self.listings += 1
            if self._moves != moves:
                return None  # the page may predate the move's fences
            self._pages.append(page)
            del self._pages[: -self._max_pages]
        return page
