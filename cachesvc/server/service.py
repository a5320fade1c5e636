"""The CacheService servicer: decode, call the engine, encode.

Every handler runs inside `_rpc`, which turns the engine's typed errors into
the status code of the error's kind (`status.status_of`) with its message;
anything else is logged and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from cacheclient.wire import CHUNK_BYTES, INLINE_BYTES, MAX_KEY_BYTES, RESPONSE_BUDGET, boot_id, cache_pb2_grpc
from cacheclient.wire import TIER_OF_NAME as _TIER
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire.limits import MAX_PLAN_MESSAGE_KEYS
from cachesvc import __version__
from cachesvc.config import ServerConfig
from cachesvc.engine import Engine, Hit
from cachesvc.errors import CacheError, ChecksumMismatch, InvalidKey, LimitReached
from cachesvc.prefetch import Plan, Prefetcher
from cachesvc.server.status import status_of

__all__ = ["CacheServicer"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _rpc(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except CacheError as exc:
        context.abort(status_of(exc), str(exc))
    except TimeoutError as exc:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    except Exception as exc:
        log.exception("internal error")
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _lease_ttl(message: pb.PutRequest | pb.Chunk) -> dict[str, float | None]:
    """Lease and TTL of a put; 0 on the wire means the namespace's default."""
    return {"lease": message.lease_seconds or None, "ttl": message.ttl_seconds or None}


def _header(hit: Hit) -> dict[str, Any]:
    return {"found": True, "size": len(hit.value), "checksum": hit.checksum, "tier": _TIER[hit.tier]}


def _result(hit: Hit | None, inline_left: int) -> pb.GetResponse:
    if hit is None:
        return pb.GetResponse(found=False)
    if len(hit.value) > inline_left:
        return pb.GetResponse(**_header(hit), streamed=True)
    return pb.GetResponse(**_header(hit), value=hit.value)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VALUE_TAG = b"\x12"  # field 2 (value), wire type 2 (length-delimited)


def encode_get_response(hit: Hit | None) -> bytes:
    """The wire bytes of the GetResponse for `hit`, with the value copied once.

    The header fields are serialized by protobuf; the value field is appended
    by hand. Field order does not matter to a protobuf parser, so this is the
    same message `_result` would build.
    """
    if hit is None or len(hit.value) > INLINE_BYTES:
        return _result(hit, INLINE_BYTES).SerializeToString()
    header = pb.GetResponse(**_header(hit)).SerializeToString()
    if not hit.value:
        return header
    return b"".join((header, _VALUE_TAG, _varint(len(hit.value)), hit.value))


def _chunks(key: bytes, hit: Hit | None, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
    """One value as stream chunks: the first carries the key and header."""
    if hit is None:
        yield pb.Chunk(key=key, found=False)
        return
    value = memoryview(hit.value)
    yield pb.Chunk(key=key, **_header(hit), data=value[:CHUNK_BYTES].tobytes())
    for start in range(CHUNK_BYTES, len(value), CHUNK_BYTES):
        if not context.is_active():
            return
        yield pb.Chunk(data=value[start : start + CHUNK_BYTES].tobytes())


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """Serves `cachesvc.v1.CacheService` from one engine."""

    def __init__(self, engine: Engine, prefetcher: Prefetcher, cfg: ServerConfig) -> None:
        self.engine = engine
        self.prefetcher = prefetcher
        self.cfg = cfg

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        with _rpc(context):
            return _result(self.engine.get(request.key, release=request.release), INLINE_BYTES)
        raise AssertionError("unreachable")

    def GetEncoded(self, request: pb.GetRequest, context: grpc.ServicerContext) -> bytes:
        """`Get`, answered with the serialized GetResponse built by hand (see `encode_get_response`)."""
        with _rpc(context):
            return encode_get_response(self.engine.get(request.key, release=request.release))
        raise AssertionError("unreachable")

    def GetMany(self, request: pb.GetManyRequest, context: grpc.ServicerContext) -> pb.GetManyResponse:
        with _rpc(context):
            hits = self.engine.get_many(request.keys, release=request.release)
            budget = RESPONSE_BUDGET
            response = pb.GetManyResponse()
            results = response.results
            for hit in hits:
                # add(...) builds each result in place: append() would copy the value again.
                if hit is None:
                    results.add(found=False)
                elif len(hit.value) > INLINE_BYTES:
                    results.add(**_header(hit), streamed=True)
                elif len(hit.value) > budget:
                    results.add(deferred=True)
                else:
                    budget -= len(hit.value)
                    results.add(**_header(hit), value=hit.value)
            return response
        raise AssertionError("unreachable")

    def GetStream(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        with _rpc(context):
            hit = self.engine.get(request.key, release=request.release)
        yield from _chunks(request.key, hit, context)

    def GetManyStream(self, request: pb.GetManyRequest, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        with _rpc(context):
            hits = self.engine.get_many(request.keys, release=request.release)
        for key, hit in zip(request.keys, hits, strict=True):
            if not context.is_active():
                return
            yield from _chunks(key, hit, context)

    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        with _rpc(context):
            checksum = request.checksum if request.HasField("checksum") else None
            self.engine.put(request.key, request.value, checksum, **_lease_ttl(request))
        return pb.PutResponse()

    def PutMany(self, request: pb.PutManyRequest, context: grpc.ServicerContext) -> pb.PutManyResponse:
        with _rpc(context):
            items = [
                (item.key, item.value, item.checksum if item.HasField("checksum") else None) for item in request.items
            ]
            # The client sends one lease/TTL for the whole batch.
            self.engine.put_many(items, **(_lease_ttl(request.items[0]) if request.items else {}))
        return pb.PutManyResponse()

    def PutStream(self, request_iterator: Iterator[pb.Chunk], context: grpc.ServicerContext) -> pb.PutResponse:
        with _rpc(context):
            head = next(request_iterator, None)
            if head is None:
                raise InvalidKey("PutStream: empty stream; the first chunk must carry the key")
            self.engine.check_key(head.key)
            self.engine.check_size(head.size)
            parts = [head.data]
            received = len(head.data)
            for chunk in request_iterator:
                received += len(chunk.data)
                # Stop reading as soon as the stream passes what it announced,
                # so a lying client cannot make the server buffer without bound.
                if received > head.size:
                    self.engine.check_size(received)
                    raise ChecksumMismatch(f"PutStream: received more than the announced {head.size} bytes")
                parts.append(chunk.data)
            if received != head.size:
                raise ChecksumMismatch(f"PutStream: received {received} of the announced {head.size} bytes")
            self.engine.put(head.key, b"".join(parts), head.checksum, **_lease_ttl(head))
        return pb.PutResponse()

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        with _rpc(context):
            return pb.DeleteResponse(existed=self.engine.delete(request.key))
        raise AssertionError("unreachable")

    def Contains(self, request: pb.ContainsRequest, context: grpc.ServicerContext) -> pb.ContainsResponse:
        with _rpc(context):
            tier = self.engine.contains(request.key, cached_only=request.cached_only)
            return pb.ContainsResponse(found=tier is not None, tier=_TIER.get(tier or "", pb.TIER_UNSPECIFIED))
        raise AssertionError("unreachable")

    def ContainsMany(self, request: pb.ContainsManyRequest, context: grpc.ServicerContext) -> pb.ContainsManyResponse:
        with _rpc(context):
            response = pb.ContainsManyResponse()
            for key in request.keys:
                tier = self.engine.contains(key, cached_only=request.cached_only)
                response.results.add(found=tier is not None, tier=_TIER.get(tier or "", pb.TIER_UNSPECIFIED))
            return response
        raise AssertionError("unreachable")

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with _rpc(context):
            stats = self.engine.stats()
            return pb.StatsResponse(
                tiers=[pb.TierStats(**tier) for tier in stats["tiers"]],
                counters={k: int(v) for k, v in stats["counters"].items()},
            )
        raise AssertionError("unreachable")

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        with _rpc(context):
            return pb.EvictResponse(existed=self.engine.evict(request.key))
        raise AssertionError("unreachable")

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        with _rpc(context):
            limit = min(request.limit or LIST_LIMIT, LIST_LIMIT)
            if request.bucket and self.cfg.s3.bucket and request.bucket != self.cfg.s3.bucket:
                raise InvalidKey(
                    f"List: bucket {request.bucket!r} is not the one this server caches ({self.cfg.s3.bucket!r})"
                )
            entries, truncated = self.engine.list_page(request.prefix, request.start_after, limit)
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
                plan.start(first.window_bytes, first.keys, list(first.sizes) or None)
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
        l2 = self.engine.l2
        return pb.InfoResponse(
            version=__version__,
            hostname=socket.gethostname(),
            boot_id=boot_id(),
            l2_path=str(Path(self.cfg.l2.path).resolve()) if l2 is not None else "",
            l2_map_size=getattr(l2.tier, "map_size", 0) if l2 is not None else 0,
            max_value_bytes=self.engine.max_value_bytes,
            s3_endpoint=self.cfg.s3.endpoint,
            s3_bucket=self.cfg.s3.bucket,
            s3_prefix=self.cfg.s3.prefix,
        )


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
