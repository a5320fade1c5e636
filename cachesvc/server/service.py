"""The CacheService servicer: decode, call the engine, encode.

Each key of a logical get is read from the engine once, whatever its size: a
value that does not fit in the answer is held in `handoff.Handoffs` under a
token, and the follow-up stream is served from there. Batches are bounded
(`MAX_BATCH_KEYS`, `PUT_MANY_BYTES`, `GET_MANY_READ_BYTES` in the wire
contract); chunking, hand encoding and stream assembly live in `wire.codec`.

Every handler runs inside `_rpc`, which turns the engine's typed errors into
the status code of the error's kind (`status.status_of`) with its message;
anything else is logged and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import grpc

from cacheclient.wire import (
    INLINE_BYTES,
    MAX_KEY_BYTES,
    RESPONSE_BUDGET,
    boot_id,
    cache_pb2_grpc,
    codec,
    pack_digests,
)
from cacheclient.wire import TIER_OF_NAME as _TIER
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire.limits import GET_MANY_READ_BYTES, MAX_BATCH_KEYS, MAX_PLAN_MESSAGE_KEYS, PUT_MANY_BYTES
from cacheclient.wire.names import (
    READ_METADATA,
    READ_VERIFIED,
    RETRY_PUSHBACK_METADATA,
    ROUTE_FALLBACK,
    ROUTE_HANDOVER,
    ROUTE_METADATA,
    ROUTE_PEER,
)
from cacheclient.wire.record import checksum
from cacheclient.wire.status import ErrorKind
from cachesvc import __version__
from cachesvc.config import ServerConfig
from cachesvc.engine import Engine, Hit, WriteMode
from cachesvc.engine.keyindex import DigestAnswer
from cachesvc.engine.writeback import answer_within
from cachesvc.errors import (
    Abandoned,
    CacheError,
    ChecksumMismatch,
    InvalidKey,
    LeaseInDoubt,
    LimitReached,
    NotConfigured,
    NotOwner,
)
from cachesvc.prefetch import Plan, Prefetcher, Priority
from cachesvc.server.fences import Fences
from cachesvc.server.handoff import Handoffs
from cachesvc.server.handover import HandedOver
from cachesvc.server.ownership import Ownership
from cachesvc.server.staging import StagingSessions
from cachesvc.server.status import status_of
from cachesvc.server.table import FollowedTable
from cachesvc.tiers.base import PlacedFile

__all__ = ["CacheServicer"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _rpc(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except CacheError as exc:
        if isinstance(exc, NotOwner):
            context.set_trailing_metadata(exc.trailing_metadata())
        elif exc.kind is ErrorKind.LIMIT_EXCEEDED:
            # A limit of this request's own: the client's retries of overloaded calls must not repeat it.
            context.set_trailing_metadata(((RETRY_PUSHBACK_METADATA, "-1"),))
        context.abort(status_of(exc), str(exc))
    except TimeoutError as exc:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    except Exception as exc:
        log.exception("internal error")
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _lease_ttl(message: pb.PutRequest | pb.Chunk) -> dict[str, Any]:
    """Lease, TTL and durability of a put; 0 on the wire means the namespace's default."""
    return {"lease": message.lease_seconds or None, "ttl": message.ttl_seconds or None, "durable": message.durable}


def _header(hit: Hit) -> dict[str, Any]:
    return {"found": True, "size": len(hit.value), "checksum": hit.checksum, "tier": _TIER[hit.tier]}


class _Unread:
    """The mark of a key a GetMany leaves unread (deferred) because it read enough bytes."""


_UNREAD = _Unread()

_FIRST_READ_KEYS = 64
"""Keys in a batch's first engine read, before the average value size is known."""


def _next_read_keys(done: int, read_bytes: int, want_bytes: int) -> int:
    """Keys in the next engine read of a batch: as many as `want_bytes` hold at the average size read so far."""
    if done == 0:
        return _FIRST_READ_KEYS
    if read_bytes == 0:
        return MAX_BATCH_KEYS
    return max(1, want_bytes * done // read_bytes)


def _metadata(context: grpc.ServicerContext) -> dict[str, str]:
    """The call's invocation metadata, by name."""
    return dict(context.invocation_metadata() or ())


def _from_peer(context: grpc.ServicerContext) -> bool:
    """Whether the call is a cache node's peer fill (`ROUTE_PEER`): answered from the cache tiers alone."""
    return any(name == ROUTE_METADATA and value == ROUTE_PEER for name, value in context.invocation_metadata() or ())


def _ended(context: grpc.ServicerContext) -> Future[None]:
    """Done once the RPC ends: answered, cancelled by its caller, or past its deadline (`Engine.iter_many`'s `stop`)."""
    ended: Future[None] = Future()

    def end() -> None:
        if not ended.done():
            ended.set_result(None)

    if not context.add_callback(end):
        end()  # the RPC has already ended
    return ended


def digest_response(request: pb.KeyDigestRequest, read: Callable[..., DigestAnswer]) -> pb.KeyDigestResponse:
    """The answer to a KeyDigest `request`, on the wire, from `read(prefix, epoch, since_seq, snapshot,
    snapshot_after, max_entries)` (`Engine.key_digest`)."""
    answer = read(
        request.prefix, request.epoch, request.since_seq, request.snapshot, request.snapshot_after, request.max_entries
    )
    return pb.KeyDigestResponse(
        epoch=answer.epoch,
        seq=answer.seq,
        full=answer.full,
        reset=answer.reset,
        added=pack_digests(answer.added),
        removed=pack_digests(answer.removed),
        more=answer.more,
        next_after=answer.next_after,
    )


def _check_batch(method: str, count: int) -> None:
    if count > MAX_BATCH_KEYS:
        raise LimitReached(
            f"{method}: {count} keys is over the limit of MAX_BATCH_KEYS={MAX_BATCH_KEYS}; split the batch"
        )


def _value_chunks(key: bytes, hit: Hit | None, context: grpc.ServicerContext) -> Iterator[bytes]:
    """One value as serialized stream chunks, while the caller listens: the first carries the key and header.

    Serialized here (`codec.encoded_value_chunks`): each value byte is copied
    once, where protobuf would copy it into the message and again out of it.
    """
    if hit is None:
        yield pb.Chunk(key=key, found=False).SerializeToString()
        return
    for chunk in codec.encoded_value_chunks(pb.Chunk(key=key, **_header(hit)), hit.value):
        if not context.is_active():
            return
        yield chunk


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """Serves `cachesvc.v1.CacheService` from one engine."""

    def __init__(
        self,
        engine: Engine,
        prefetcher: Prefetcher,
        cfg: ServerConfig,
        ownership: Ownership | None = None,
        rpc_totals: Callable[[], Mapping[str, int]] | None = None,
        fences: Fences | None = None,
    ) -> None:
        """A servicer of `engine`; with `ownership`, it refuses keys it does not own; with `fences`, it fences
        a moved key's earlier owners before it takes its first write (`cachesvc.server.fences`).

        Args:
            rpc_totals: calls served, failed and their microseconds so far
                (`cachesvc.metrics.RpcMetrics.totals`), added to the Stats answer.
        """
        self.engine = engine
        self.prefetcher = prefetcher
        self.cfg = cfg
        self.ownership = ownership
        self.fences = fences
        self.rpc_totals = rpc_totals
        self.handoffs: Handoffs[Hit] = Handoffs(cfg.handoff_bytes, cfg.handoff_seconds)
        self.arena_socket = ""
        """Where co-located clients get the shared L1 arena (told by Info; "" for none)."""
        self.staging: StagingSessions | None = None
        """Co-located clients' writes (their counters are in the Stats answer)."""
        self.table = FollowedTable(cfg.namespaces)
        """The namespaces Info reports: the config file's, or the shard's the server follows."""

    def stats(self) -> dict[str, Any]:
        """What the Stats RPC and /metrics report.

        The engine's tiers and counters, with the prefetcher's, the stream
        hand-off's and the RPC totals added.
        """
        stats = self.engine.stats()
        stats["counters"].update(self.handoffs.counters)
        stats["counters"]["handoff_held_bytes"] = self.handoffs.held_bytes
        stats["counters"].update(self.prefetcher.counters())
        if self.rpc_totals is not None:
            stats["counters"].update(self.rpc_totals())
        if self.fences is not None:
            stats["counters"].update(self.fences.counters())
        if self.ownership is not None:
            stats["counters"]["refused_behind_map"] = self.ownership.refused_behind_map
            held = self.ownership.placement
            stats["counters"]["placement_version"] = 0 if held is None else held.version
        if self.staging is not None:
            stats["counters"].update(self.staging.stats())
        return stats

    def _route(
        self, context: grpc.ServicerContext, keys: Sequence[bytes], *, read: bool, presence: bool = False
    ) -> None:
        """Raises `NotOwner` when a routing client sent keys this server must not serve, and `Withheld` for a
        value read of a write-back key whose newest value may be on a node that is down (see `ownership`).
        Before serving the call, fences the keys' earlier owners when the placement moved (see `fences`)."""
        if self.ownership is not None:
            self._route_by(_metadata(context), keys, read=read, presence=presence)

    def _route_by(self, metadata: dict[str, str], keys: Sequence[bytes], *, read: bool, presence: bool = False) -> None:
        """`_route` for a call that carried `metadata`."""
        if self.ownership is not None:
            self.ownership.check(keys, metadata, self._suspect if read else None, write=not read)
            route = metadata.get(ROUTE_METADATA)
            # A fallback read (the owners did not answer) checks what it serves against object storage instead.
            if self.fences is not None and route != ROUTE_PEER and not (read and route == ROUTE_FALLBACK):
                self.fences.before_serving(keys)
            if read and not presence and route != ROUTE_PEER and metadata.get(READ_METADATA) != READ_VERIFIED:
                self.ownership.withhold(keys, self._write_back, check_fresh=True)

    @contextlib.contextmanager
    def _writing(self, metadata: dict[str, str], keys: Sequence[bytes]) -> Iterator[None]:
        """Routes a write (`_route_by`) and holds it as under way until it is done, so that a peer fencing this
        node meanwhile waits for it (`Fences.writing`): its ownership is checked once more inside, where a
        fence that came since the first check has moved the map (or raised its floor)."""
        self._route_by(metadata, keys, read=False)
        if self.fences is None or self.ownership is None or metadata.get(ROUTE_METADATA) == ROUTE_PEER:
            yield
            return
        with self.fences.writing():
            self.ownership.check(keys, metadata, None, write=True)
            yield

    def _write_back(self, key: bytes) -> bool:
        return self.engine.write_mode(key) is WriteMode.WRITE_BACK

    def _suspect(self, key: bytes) -> None:
        """A fallback read of `key`, which this server does not own by its map: a copy cached here is checked
        against S3 first (one HEAD in the read): the owner may have taken a newer write, or a delete, since."""
        if self.engine.contains(key, cached_only=True) is not None:
            self.engine.unvouch([key])

    # -- reads: each key of a logical get is read from the engine once ------

    def _get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> tuple[pb.GetResponse, bytes]:
        """Reads one key: the answer's header, and the value when it travels inline (else b"").

        A peer's read (`ROUTE_PEER`) is answered from the cache tiers alone.
        """
        if _from_peer(context):
            hit = self.engine.get_cached(request.key)
        else:
            hit = self.engine.get(request.key, release=request.release)
        if hit is None:
            return pb.GetResponse(found=False), b""
        if len(hit.value) <= INLINE_BYTES:
            return pb.GetResponse(**_header(hit)), hit.value
        token = self.handoffs.hold([(request.key, hit, len(hit.value))])
        return pb.GetResponse(**_header(hit), streamed=True, handoff=token), b""

    def _reads(
        self,
        keys: Sequence[bytes],
        release: bool,
        max_bytes: int | None = None,
        *,
        cached_only: bool = False,
        stop: Future[None] | None = None,
    ) -> Iterator[Hit | None]:
        """The hits of `keys` in order, read a slice of about GET_MANY_READ_BYTES of values at a time.

        All keys are checked before any is read. Within a slice each hit
        comes as soon as it is read (`Engine.iter_many`: a stream's first
        values go out while later fills are in flight). Stops before the next
        slice once `max_bytes` of values are read, so a batch of large values
        never sits in memory whole. Once `stop` is done (the RPC ended: its
        caller cancelled it or its deadline passed) no further fill starts and
        a wait for one ends at once (`Abandoned`).
        """
        for key in keys:
            self.engine.check_key(key)
        done = read_bytes = 0
        while done < len(keys) and (max_bytes is None or read_bytes < max_bytes):
            if stop is not None and stop.done():
                raise Abandoned("the caller left before its reads finished")
            want = GET_MANY_READ_BYTES if max_bytes is None else max_bytes - read_bytes
            end = min(len(keys), done + _next_read_keys(done, read_bytes, want))
            if cached_only:
                hits: Iterable[Hit | None] = [self.engine.get_cached(key) for key in keys[done:end]]
            else:
                hits = self.engine.iter_many(keys[done:end], release=release, stop=stop)
            done = end
            for hit in hits:
                if hit is not None:
                    read_bytes += len(hit.value)
                yield hit

    def _hits(
        self,
        keys: Sequence[bytes],
        request: pb.GetRequest | pb.GetManyRequest,
        context: grpc.ServicerContext,
        max_bytes: int | None = None,
    ) -> Iterator[Hit | _Unread | None]:
        """The hit of each key, in order: from the request's hand-off, else read (lazily, a slice at a time).

        Past `max_bytes` of values read, the keys still to read are `_UNREAD`.
        """
        held = self.handoffs.take(request.handoff, keys) if request.handoff else [None] * len(keys)
        missing = [key for key, hit in zip(keys, held, strict=True) if hit is None]
        if request.handoff and missing:
            # Only what the token holds was checked when it was read: any other key (a token that
            # is unknown, expired or names other keys) is read now, and checked like any read.
            self._route(context, missing, read=True)
        cached_only = _from_peer(context)
        reads = self._reads(missing, request.release, max_bytes, cached_only=cached_only, stop=_ended(context))
        for hit in held:
            yield hit if hit is not None else next(reads, _UNREAD)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        with _rpc(context):
            self._route(context, [request.key], read=True)
            response, value = self._get(request, context)
            response.value = value
            return response
        raise AssertionError("unreachable")

    def GetEncoded(self, request: pb.GetRequest, context: grpc.ServicerContext) -> bytes:
        """`Get`, answered with the serialized GetResponse, its value copied once (`codec.get_response_bytes`)."""
        with _rpc(context):
            self._route(context, [request.key], read=True)
            return codec.get_response_bytes(*self._get(request, context))
        raise AssertionError("unreachable")

    def GetMany(self, request: pb.GetManyRequest, context: grpc.ServicerContext) -> pb.GetManyResponse:
        with _rpc(context):
            keys = request.keys
            _check_batch("GetMany", len(keys))
            if not request.handoff:  # a follow-up reads nothing again
                self._route(context, keys, read=True)
            response = pb.GetManyResponse()
            results = response.results
            inline_left = min(RESPONSE_BUDGET, INLINE_BYTES)
            held: list[tuple[bytes, Hit, int]] = []
            for key, hit in zip(keys, self._hits(keys, request, context, GET_MANY_READ_BYTES), strict=True):
                # add(...) builds each result in place: append() would copy the value again.
                if isinstance(hit, _Unread):
                    results.add(deferred=True)
                elif hit is None:
                    results.add(found=False)
                elif len(hit.value) <= inline_left:
                    inline_left -= len(hit.value)
                    results.add(**_header(hit), value=hit.value)
                else:
                    results.add(**_header(hit), streamed=True)
                    held.append((key, hit, len(hit.value)))
            if held:
                response.handoff = self.handoffs.hold(held)
            return response
        raise AssertionError("unreachable")

    def GetStream(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The value's chunks, serialized (the server registers it with no response serializer)."""
        with _rpc(context):
            if not request.handoff:
                self._route(context, [request.key], read=True)
        yield from self._stream([request.key], request, context)

    def GetManyStream(self, request: pb.GetManyRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The values' chunks, serialized (the server registers it with no response serializer)."""
        with _rpc(context):
            _check_batch("GetManyStream", len(request.keys))
            if not request.handoff:
                self._route(context, request.keys, read=True)
        yield from self._stream(request.keys, request, context)

    def _stream(
        self, keys: Sequence[bytes], request: pb.GetRequest | pb.GetManyRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        hits = self._hits(keys, request, context)
        for key in keys:
            with _rpc(context):
                hit = next(hits)
            assert not isinstance(hit, _Unread)  # no byte limit on a stream
            if not context.is_active():
                return
            yield from _value_chunks(key, hit, context)

    # -- writes ---------------------------------------------------------

    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        with _rpc(context):
            checksum = request.checksum if request.HasField("checksum") else None
            with self._writing(_metadata(context), [request.key]), answer_within(context.time_remaining()):
                self.engine.put(request.key, request.value, checksum, **_lease_ttl(request))
        return pb.PutResponse()

    def PutMany(self, request: pb.PutManyRequest, context: grpc.ServicerContext) -> pb.PutManyResponse:
        with _rpc(context):
            _check_batch("PutMany", len(request.items))
            size = sum(len(item.value) for item in request.items)
            if size > PUT_MANY_BYTES:
                raise LimitReached(
                    f"PutMany: {size} bytes of values is over the limit of PUT_MANY_BYTES={PUT_MANY_BYTES}; "
                    "split the batch"
                )
            items = [
                (item.key, item.value, item.checksum if item.HasField("checksum") else None) for item in request.items
            ]
            metadata = _metadata(context)
            if metadata.get(ROUTE_METADATA) == ROUTE_HANDOVER:
                self._handed_over(items)
                return pb.PutManyResponse()
            # The client sends one lease/TTL for the whole batch.
            keys = [item.key for item in request.items]
            with self._writing(metadata, keys), answer_within(context.time_remaining()):
                self.engine.put_many(items, **(_lease_ttl(request.items[0]) if request.items else {}))
        return pb.PutManyResponse()

    def _handed_over(self, items: Sequence[tuple[bytes, bytes, int | None]]) -> None:
        """Copies a key's previous owner hands over after a move (`cachesvc.server.handover`): each filled into
        the cache as a read would fill it (checked against object storage; a key cached, or written meanwhile,
        keeps what it has). Not a write: nothing here is acknowledged as stored."""
        handed = self.engine.fill_source("handover")
        if not isinstance(handed, HandedOver):
            raise NotConfigured("PutMany: a handover needs a cluster node with peer fill (meta.peer_fill)")
        placement = self.ownership.placement if self.ownership is not None else None
        checked: list[tuple[bytes, bytes, int]] = []
        for key, value, sum_ in items:
            self.engine.check_key(key)
            if placement is not None and self.ownership is not None and not self.ownership.owns(placement, key):
                continue  # moved on since: its owner reads it when asked
            if not self.engine.handed_over(key):
                continue  # a write-back key (a sender with an older table): its first read asks the previous owner
            actual = checksum(value)
            if sum_ is not None and sum_ != actual:
                raise ChecksumMismatch(f"PutMany: the value handed over for key {key[:64]!r} fails its checksum")
            checked.append((key, value, actual))
        handed.take(checked)
        try:
            for key, _, _ in checked:
                try:
                    self.engine.prefetch(key)
                except CacheError as exc:  # left to the key's first read, which asks the previous owner as before
                    log.debug("a copy handed over for %r was not taken: %s", key[:64], exc)
        finally:
            # A copy its prefetch did not take (the key was cached, or written meanwhile) is not kept for a
            # later fill: by then it may be older than a value the cluster took since.
            handed.discard([key for key, _, _ in checked])

    def PutStream(self, request_iterator: Iterator[pb.Chunk], context: grpc.ServicerContext) -> pb.PutResponse:
        with _rpc(context):
            try:
                put = codec.read_put_stream(
                    request_iterator, check_key=self.engine.check_key, check_size=self.engine.check_size
                )
            except codec.StreamError as exc:
                raise ChecksumMismatch(f"PutStream: {exc}") from None
            with self._writing(_metadata(context), [put.key]), answer_within(context.time_remaining()):
                self.engine.put(put.key, put.value, put.checksum, lease=put.lease, ttl=put.ttl, durable=put.durable)
        return pb.PutResponse()

    def put_staged(
        self,
        metadata: dict[str, str],
        items: Sequence[tuple[bytes, bytes | PlacedFile, int]],
        lease: float | None,
        ttl: float | None,
        durable: bool,
    ) -> None:
        """A co-located client's values, copied out of its staging area or written in place in L2
        (`cachesvc.server.staging`): written as a PutMany carrying `metadata` would be."""
        _check_batch("staged put", len(items))
        if self.ownership is not None and self.ownership.in_doubt():
            raise LeaseInDoubt(
                f"{self.ownership.address} has not reached the metadata shard for half its lease: "
                "its keys may have moved; write over gRPC"
            )
        with self._writing(metadata, [key for key, _, _ in items]):
            self.engine.put_many(items, lease=lease, ttl=ttl, durable=durable)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        with _rpc(context):
            if _from_peer(context):
                # The key's new owner deletes it: drop what is cached here, never object storage.
                return pb.DeleteResponse(existed=self.engine.drop_cached(request.key))
            with self._writing(_metadata(context), [request.key]):
                return pb.DeleteResponse(existed=self.engine.delete(request.key))
        raise AssertionError("unreachable")

    def Contains(self, request: pb.ContainsRequest, context: grpc.ServicerContext) -> pb.ContainsResponse:
        with _rpc(context):
            self._route(context, [request.key], read=True, presence=True)
            return self._presence(request.key, request.cached_only)
        raise AssertionError("unreachable")

    def ContainsMany(self, request: pb.ContainsManyRequest, context: grpc.ServicerContext) -> pb.ContainsManyResponse:
        with _rpc(context):
            _check_batch("ContainsMany", len(request.keys))
            self._route(context, request.keys, read=True, presence=True)
            if request.release:
                self.engine.release(request.keys)
            response = pb.ContainsManyResponse()
            response.results.extend(self._presence(key, request.cached_only) for key in request.keys)
            return response
        raise AssertionError("unreachable")

    def _presence(self, key: bytes, cached_only: bool) -> pb.ContainsResponse:
        """Where `key` is held, whether object storage has its newest value, and whether L2 has a copy."""
        engine = self.engine
        tier = engine.contains(key, cached_only=cached_only)
        if tier is None:
            return pb.ContainsResponse(found=False)
        uploaded = engine.l3 is not None and (tier == engine.l3.name or engine.uploaded(key))
        on_disk = engine.l2 is not None and engine.l2.tier.contains(key)
        return pb.ContainsResponse(
            found=True,
            tier=_TIER.get(tier, pb.TIER_UNSPECIFIED),
            uploaded=uploaded,
            on_disk=on_disk,
            version=0 if engine.l3 is not None and tier == engine.l3.name else engine.cached_version(key),
        )

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with _rpc(context):
            stats = self.stats()
            return pb.StatsResponse(
                tiers=[pb.TierStats(**tier) for tier in stats["tiers"]],
                counters={k: int(v) for k, v in stats["counters"].items()},
            )
        raise AssertionError("unreachable")

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        with _rpc(context):
            self._route(context, [request.key], read=False)
            return pb.EvictResponse(existed=self.engine.evict(request.key))
        raise AssertionError("unreachable")

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        with _rpc(context):
            limit = min(request.limit or LIST_LIMIT, LIST_LIMIT)
            if request.bucket and self.cfg.s3.bucket and request.bucket != self.cfg.s3.bucket:
                raise InvalidKey(
                    f"List: bucket {request.bucket!r} is not the one this server caches ({self.cfg.s3.bucket!r})"
                )
            entries, truncated = self.engine.list_page(
                request.prefix, request.start_after, limit, cached=request.cached
            )
            return pb.ListResponse(
                entries=[pb.ListEntry(key=key, size=size) for key, size in entries], truncated=truncated
            )
        raise AssertionError("unreachable")

    def Prefetch(
        self, request_iterator: Iterator[pb.PrefetchRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.PrefetchProgress]:
        # An open plan holds this handler thread until it ends; the server
        # has a thread for each of the prefetcher's max_plans beyond its
        # handler threads, so demand reads never wait behind plans.
        with _rpc(context):
            plan = self.prefetcher.open()
        context.add_callback(plan.close)
        try:
            with _rpc(context):
                try:
                    first = next(request_iterator, None)
                except grpc.RpcError:
                    return  # the caller went away
                if first is None:
                    return
                _check_plan_part(first)
                plan.start(first.window_bytes, first.keys, list(first.sizes) or None, Priority.of_wire(first.priority))
            threading.Thread(
                target=_read_plan_rest, args=(request_iterator, plan), name="prefetch-plan", daemon=True
            ).start()
            for progress in self.prefetcher.run(plan, context.is_active):
                yield pb.PrefetchProgress(
                    planned=progress.planned,
                    fetched=progress.fetched,
                    consumed=progress.consumed,
                    window_used_bytes=progress.window_used_bytes,
                    failed=progress.failed,
                    done=progress.done,
                )
            if plan.error is not None:
                context.abort(status_of(plan.error), str(plan.error))
        finally:
            plan.close()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        l2 = self.engine.tier_info().get("l2", {})
        probed, error = False, ""
        if request.probe_object_storage and self.engine.l3 is not None:
            probed, error = True, self._probe_object_storage()
        return pb.InfoResponse(
            object_storage_probed=probed,
            object_storage_error=error,
            version=__version__,
            hostname=socket.gethostname(),
            boot_id=boot_id(),
            # A server that rechecks its copies on a schedule cannot mark them for direct readers: not named.
            l2_path="" if self.engine.checks_freshness else str(l2.get("path", "")),
            l2_map_size=int(l2.get("map_size", 0)),
            max_value_bytes=self.engine.max_value_bytes,
            arena_socket=self.arena_socket,
            s3_endpoint=self.cfg.s3.endpoint,
            s3_bucket=self.cfg.s3.bucket,
            s3_prefix=self.cfg.s3.prefix,
            namespaces=[
                pb.NamespaceInfo(prefix=ns.prefix.encode(), write_mode=ns.write_mode, replicas=ns.replicas)
                for ns in self.table.namespaces
            ],
        )

    def KeyDigest(self, request: pb.KeyDigestRequest, context: grpc.ServicerContext) -> pb.KeyDigestResponse:
        with _rpc(context):
            return digest_response(request, self.engine.key_digest)
        raise AssertionError("unreachable")

    def Fence(self, request: pb.FenceRequest, context: grpc.ServicerContext) -> pb.FenceResponse:
        with _rpc(context):
            if not request.version:
                raise InvalidKey("Fence: version must be a placement map version (> 0)")
            if self.fences is None:
                raise NotConfigured("Fence: this server is not a cluster node (no metadata shard configured)")
            placement = self.fences.fenced(request.version, request.epoch)
            if placement is None:
                return pb.FenceResponse()
            return pb.FenceResponse(version=placement.version, epoch=placement.epoch)
        raise AssertionError("unreachable")

    def _probe_object_storage(self) -> str:
        """ "" when object storage lists (at most one key, within its timeouts), else why not."""
        try:
            self.engine.list_page(b"", b"", 1)
        except CacheError as exc:
            return str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""


LIST_LIMIT = 10_000


def _check_plan_part(message: pb.PrefetchRequest) -> None:
    """Raises unless one message of a plan is well formed and within MAX_PLAN_MESSAGE_KEYS keys."""
    if len(message.keys) > MAX_PLAN_MESSAGE_KEYS:
        raise LimitReached(
            f"Prefetch: at most {MAX_PLAN_MESSAGE_KEYS} keys per message (MAX_PLAN_MESSAGE_KEYS), "
            f"got {len(message.keys)}; send the plan in several messages"
        )
    if message.sizes and len(message.sizes) != len(message.keys):
        raise InvalidKey(f"Prefetch: {len(message.sizes)} sizes for {len(message.keys)} keys")
    for key in message.keys:
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidKey(f"Prefetch: key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def _read_plan_rest(messages: Iterator[pb.PrefetchRequest], plan: Plan) -> None:
    """Feeds a plan's later messages (more keys, progress) to it; a bad one ends the plan with its error."""
    try:
        for message in messages:
            _check_plan_part(message)
            if message.keys:
                plan.extend(message.keys, list(message.sizes) or None)
            if message.consumed:
                plan.consumed(message.consumed)
    except CacheError as exc:
        plan.fail(exc)
    except grpc.RpcError:
        pass  # the caller went away
    finally:
        plan.close()  # the caller closed its side: the plan ends
