"""The CacheService servicer: decode, call the engine, encode.

Every handler runs inside `_rpc`, which turns the engine's typed errors into
the status code from `status.STATUS_OF` with the error's message; anything
else is logged and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import grpc

from cacheclient._proto import cache_pb2 as pb
from cacheclient._proto import cache_pb2_grpc
from cachesvc.engine import Engine, Hit
from cachesvc.errors import CacheError, ChecksumMismatch, InvalidKey
from cachesvc.server.status import status_of

__all__ = ["CHUNK_BYTES", "INLINE_BYTES", "CacheServicer"]

log = logging.getLogger(__name__)

INLINE_BYTES = 3 << 20
"""Values up to this size travel inside one message; larger ones are streamed."""
CHUNK_BYTES = 1 << 20
"""Stream chunk size (1 MiB streams about 2.5x faster than 1 MiB unary calls)."""
RESPONSE_BUDGET = 3 << 20
"""Bytes of values one GetMany response carries before deferring the rest."""

_TIER = {"l1": pb.TIER_L1, "l2": pb.TIER_L2, "l3": pb.TIER_L3}


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


def _result(hit: Hit | None, inline_left: int) -> pb.GetResponse:
    if hit is None:
        return pb.GetResponse(found=False)
    size = len(hit.value)
    if size > inline_left:
        return pb.GetResponse(found=True, size=size, checksum=hit.checksum, tier=_TIER[hit.tier], streamed=True)
    return pb.GetResponse(found=True, value=hit.value, size=size, checksum=hit.checksum, tier=_TIER[hit.tier])


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """Serves `cachesvc.v1.CacheService` from one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        with _rpc(context):
            return _result(self.engine.get(request.key), INLINE_BYTES)
        raise AssertionError("unreachable")

    def GetMany(self, request: pb.GetManyRequest, context: grpc.ServicerContext) -> pb.GetManyResponse:
        with _rpc(context):
            hits = self.engine.get_many(request.keys)
            budget = RESPONSE_BUDGET
            response = pb.GetManyResponse()
            for hit in hits:
                if hit is not None and len(hit.value) <= INLINE_BYTES and len(hit.value) > budget:
                    response.results.append(pb.GetResponse(deferred=True))
                    continue
                result = _result(hit, INLINE_BYTES)
                budget -= len(result.value)
                response.results.append(result)
            return response
        raise AssertionError("unreachable")

    def GetStream(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        with _rpc(context):
            hit = self.engine.get(request.key)
        if hit is None:
            yield pb.Chunk(found=False)
            return
        value = memoryview(hit.value)
        yield pb.Chunk(
            found=True, size=len(value), checksum=hit.checksum, tier=_TIER[hit.tier], data=value[:CHUNK_BYTES].tobytes()
        )
        for start in range(CHUNK_BYTES, len(value), CHUNK_BYTES):
            if not context.is_active():
                return
            yield pb.Chunk(data=value[start : start + CHUNK_BYTES].tobytes())

    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        with _rpc(context):
            checksum = request.checksum if request.HasField("checksum") else None
            self.engine.put(request.key, request.value, checksum)
        return pb.PutResponse()

    def PutMany(self, request: pb.PutManyRequest, context: grpc.ServicerContext) -> pb.PutManyResponse:
        with _rpc(context):
            items = [
                (item.key, item.value, item.checksum if item.HasField("checksum") else None) for item in request.items
            ]
            self.engine.put_many(items)
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
            self.engine.put(head.key, b"".join(parts), head.checksum)
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

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with _rpc(context):
            stats = self.engine.stats()
            return pb.StatsResponse(
                tiers=[pb.TierStats(**tier) for tier in stats["tiers"]],
                counters={k: int(v) for k, v in stats["counters"].items()},
            )
        raise AssertionError("unreachable")
