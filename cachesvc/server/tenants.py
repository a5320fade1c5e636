"""What a tenant's call to a cache server may reach: the keys under its prefixes, and nothing else.

`guard(tenant, method, handler)` (`cachesvc.rpc.TokenAuth`'s guard) wraps
the handler of each data method a tenant calls: a key outside its prefixes
answers PERMISSION_DENIED naming the tenant (a batch with one such key is
refused whole; so is a prefetch plan or a put stream, at the message that
names it); `List` lists only under the tenant's prefixes (a listing of ""
shows its own keys, none of another tenant's); `KeyDigest` (the local KV
index) is refused outside them; and `Info` does not name the L2 file (it
holds every tenant's values, and a process that maps it can read all of
it: a tenant's co-located client reads L2 over gRPC). It names the shared
L1's socket, which hands a tenant's token its own tenant's arena only
(`cachesvc.tiers.tenant_arenas`; docs/security.md). Methods of the admin
scope never reach here: `TokenAuth` refuses them for tenants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from cacheclient.meta import TenantEntry
from cacheclient.wire import cache_pb2 as pb
from cachesvc.tenancy import owns, prefixes_of, refusal

__all__ = ["guard"]

_SERVICE = "/cachesvc.v1.CacheService/"


def _one(request: Any) -> list[bytes]:
    return [request.key]


def _many(request: Any) -> list[bytes]:
    return list(request.keys)


def _items(request: pb.PutManyRequest) -> list[bytes]:
    return [item.key for item in request.items]


_KEYS_OF: dict[str, Callable[[Any], list[bytes]]] = {
    "Get": _one,
    "GetStream": _one,
    "Put": _one,
    "Delete": _one,
    "Contains": _one,
    "GetMany": _many,
    "GetManyStream": _many,
    "ContainsMany": _many,
    "PutMany": _items,
}
"""Unary requests: the keys each names (a GetMany follow-up by hand-off token names none: its keys were checked)."""


def _check(tenant: TenantEntry, prefixes: tuple[bytes, ...], keys: list[bytes], context: grpc.ServicerContext) -> None:
    for key in keys:
        if not key.startswith(prefixes):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(tenant, f"reach key {key[:200]!r}"))


def guard(tenant: TenantEntry, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler | None:
    """`handler` as `tenant` may call it; None for a method no tenant may call."""
    name = method.removeprefix(_SERVICE)
    keys_of = _KEYS_OF.get(name)
    if keys_of is not None:
        return _replace(handler, _unary_checked(tenant, prefixes_of(tenant), keys_of, handler))
    if name == "PutStream":
        inner_su = handler.stream_unary

        def put_stream(requests: Iterator[pb.Chunk], context: grpc.ServicerContext) -> Any:
            checked = _Checked(tenant, requests, context, lambda c: [c.key] if c.key else [])
            answer = inner_su(iter(checked), context)
            checked.abort_if_refused()
            return answer

        return _replace(handler, stream_unary=put_stream)
    if name == "Prefetch":
        inner_ss = handler.stream_stream

        def prefetch(requests: Iterator[pb.PrefetchRequest], context: grpc.ServicerContext) -> Iterator[Any]:
            checked = _Checked(tenant, requests, context, lambda m: list(m.keys))
            for progress in inner_ss(iter(checked), context):
                checked.abort_if_refused()
                yield progress
            checked.abort_if_refused()

        return _replace(handler, stream_stream=prefetch)
    if name == "List":
        return _replace(handler, unary_unary=_listing(tenant, handler.unary_unary))
    if name == "KeyDigest":
        inner = handler.unary_unary

        def digest(request: pb.KeyDigestRequest, context: grpc.ServicerContext) -> Any:
            if not owns(tenant, request.prefix):
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, refusal(tenant, f"follow keys under {request.prefix!r}")
                )
            return inner(request, context)

        return _replace(handler, unary_unary=digest)
    if name == "Info":
        inner_info = handler.unary_unary

        def info(request: pb.InfoRequest, context: grpc.ServicerContext) -> Any:
            answer: pb.InfoResponse = inner_info(request, context)
            answer.l2_path = ""  # one file of every tenant's values: a tenant's client reads L2 over gRPC
            return answer

        return _replace(handler, unary_unary=info)
    return None


def _unary_checked(
    tenant: TenantEntry,
    prefixes: tuple[bytes, ...],
    keys_of: Callable[[Any], list[bytes]],
    handler: grpc.RpcMethodHandler,
) -> dict[str, Any]:
    if handler.response_streaming:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            _check(tenant, prefixes, keys_of(request), context)
            return inner_us(request, context)

        return {"unary_stream": unary_stream}
    inner_uu = handler.unary_unary

    def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
        _check(tenant, prefixes, keys_of(request), context)
        return inner_uu(request, context)

    return {"unary_unary": unary_unary}


class _Checked:
    """A request stream of a tenant's that ends before the first message naming a key not its own.

    The handler reading it sees the stream end there (what it took so far was the tenant's own); the
    refusal is answered from the handler's thread (`abort_if_refused`): an abort raised inside the
    handler's reading would be taken for its own failure. The first message is checked before the
    handler starts, so a stream that begins with another tenant's key is refused at once.
    """

    def __init__(
        self,
        tenant: TenantEntry,
        requests: Iterator[Any],
        context: grpc.ServicerContext,
        keys_of: Callable[[Any], list[bytes]],
    ) -> None:
        self._tenant = tenant
        self._requests = requests
        self._context = context
        self._keys_of = keys_of
        self.refused = ""
        self._first = next(requests, None)
        if self._first is not None:
            _check(tenant, prefixes_of(tenant), keys_of(self._first), context)

    def __iter__(self) -> Iterator[Any]:
        if self._first is None:
            return
        yield self._first
        for message in self._requests:
            foreign = next((k for k in self._keys_of(message) if not owns(self._tenant, k)), None)
            if foreign is not None:
                self.refused = refusal(self._tenant, f"reach key {foreign[:200]!r}")
                return
            yield message

    def abort_if_refused(self) -> None:
        if self.refused:
            self._context.abort(grpc.StatusCode.PERMISSION_DENIED, self.refused)


def _listing(tenant: TenantEntry, inner: Callable[..., Any]) -> Callable[..., Any]:
    """List for `tenant`: under a prefix of its own as asked; under a wider one, its own prefixes in turn."""

    def list_keys(request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        if owns(tenant, request.prefix):
            return inner(request, context)  # type: ignore[no-any-return]
        answer = pb.ListResponse()
        after = request.start_after
        for prefix in sorted(p.encode() for p in tenant.prefixes if p.encode().startswith(request.prefix)):
            if after and after > prefix and not after.startswith(prefix):
                continue  # every key under it comes before `after`
            part = pb.ListRequest()
            part.CopyFrom(request)
            part.prefix = prefix
            if request.limit:
                part.limit = request.limit - len(answer.entries)
            found: pb.ListResponse = inner(part, context)
            answer.entries.extend(found.entries)
            if found.truncated or (request.limit and len(answer.entries) >= request.limit):
                answer.truncated = True  # the caller's next page starts after the last key shown
                break
        return answer

    return list_keys


def _replace(
    handler: grpc.RpcMethodHandler, replaced: dict[str, Any] | None = None, **kinds: Any
) -> grpc.RpcMethodHandler:
    """`handler` with some of its behaviours replaced; its (de)serializers kept."""
    kinds.update(replaced or {})
    return handler._replace(**kinds)  # type: ignore[attr-defined, no-any-return]
