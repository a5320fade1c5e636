"""`CacheClient`: the Python client of one cache server, or of a cluster of them.

`CacheClient(address)` talks to one server. `CacheClient(meta="HOST:PORT,...")`
talks to a cluster: it caches the metadata shard's placement map and sends
each key to the nodes that hold it (`cacheclient.router`), splitting batches
per node and issuing the parts at once. `CacheClient(nodes=[...])` does the
same over a fixed list of servers (equal shares, no shard). The methods and
their meaning are the same in both modes.

Batch-first: `get_many`/`put_many` are the primary calls, split into
messages under the gRPC size limit; `get`/`put` are batches of one. Every
call has a deadline. Values are verified against their xxh3-64 checksum on
arrival, so corrupt bytes raise instead of reaching the caller.

Memory: the first client in a process raises glibc's malloc thresholds
(`cacheclient.tune_malloc`), without which each 1 MiB get faults about 3 MiB
of memory back in from the kernel; set CACHECLIENT_TUNE_MALLOC=0 to leave
malloc alone.

Fork safety: the gRPC channel is created lazily and keyed on the process id,
and dropped in a child after `fork`, so a client used in a parent keeps
working in forked children (PyTorch DataLoader workers). The client pickles
without its channel, for `spawn` workers. Before a fork the parent collects
its garbage, and the child never collects what it inherited: a gRPC call
object finalized in a child can wait forever on a lock a parent thread held.
One caveat remains, from gRPC itself:
a fork while another thread of the parent is inside a gRPC call can hang or
crash the child, so keep parent-side calls away from the moment workers
start, or use the forkserver or spawn start method.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from cacheclient._malloc import tune_malloc
from cacheclient.cluster import Cluster
from cacheclient.errors import (
    CacheClientError,
    CorruptValueError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    from_rpc_error,
)
from cacheclient.process_local import ProcessLocal
from cacheclient.wire import (
    INLINE_BYTES,
    MAX_MESSAGE_BYTES,
    bearer_metadata,
    cache_pb2_grpc,
    codec,
)
from cacheclient.wire import TIER_NAMES as _TIER_NAMES
from cacheclient.wire import cache_pb2 as pb
from cacheclient.wire import checksum as _checksum
from cacheclient.wire.limits import MAX_BATCH_KEYS, MAX_PLAN_KEYS, MAX_PLAN_MESSAGE_KEYS, PUT_MANY_BYTES
from cacheclient.wire.names import REQUEST_ID_METADATA, new_request_id
from cacheclient.wire.placement import PlacementMap
from cacheclient.wire.record import checksum_of_pieces

if TYPE_CHECKING:
    from cacheclient.router import Router

__all__ = ["CacheClient", "Location", "PrefetchPlan"]

_PLAN_MESSAGE_BYTES = 1 << 20
"""Bytes of keys one message of a prefetch plan carries at most (well under the message limit)."""
_STREAM_FROM_BYTES = 256 << 10
"""Values a GetMany left waiting this large follow in a stream; smaller ones in further GetMany answers.

Measured here (L1 hits, 2 cores): from 256 KiB a stream message beats a
share of a unary answer; below it the per-message cost of a stream loses.
"""
_KEY_BYTES_PER_MESSAGE = MAX_MESSAGE_BYTES // 2
"""Bytes of keys one batched request carries at most (the rest of a message is headroom)."""
_GET_MANY_STREAM = f"/{pb.DESCRIPTOR.services_by_name['CacheService'].full_name}/GetManyStream"


@dataclass
class _Connection:
    """One process's channel to the server and the stub over it (not frozen: a test replaces `get_many_stream`)."""

    channel: grpc.Channel
    stub: Any
    get_many_stream: Any
    """GetManyStream answering the serialized chunks (bytes): the client parses them (`codec.stream_value_views`)."""


def _close_connection(connection: _Connection) -> None:
    connection.channel.close()


OVERLOAD_RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "cachesvc.v1.CacheService"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 3,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
)
"""gRPC's own retries of a call a server refused as overloaded (RESOURCE_EXHAUSTED, `max_inflight_calls`):
up to 4 more attempts, each after a random wait of up to 0.05, 0.15, 0.45 and 1 s. A refusal no retry can
fix (a value over a size limit, a full tier) carries `grpc-retry-pushback-ms: -1`, which stops them; a call
whose request is over gRPC's retry buffer (256 KiB: a large put) is not retried either."""


class CacheClient:
    """A client of one cache server at `address` ("host:port"), or of a cluster (`meta=` or `nodes=`).

    Give exactly one of `address`, `meta` and `nodes`.

    Args:
        address: the server's host:port.
        meta: the metadata shard's nodes, "HOST:PORT,..." or a list: route
            each key to its owner by the shard's placement map.
        nodes: a fixed list of cache servers' host:port: route each key by
            a static placement over them (equal shares).
        timeout: default deadline of each call, in seconds.
        token: bearer token, when the server requires one.
        tls_ca: PEM bytes or a path of the CA that signed the server's
            certificate; enables TLS. With `meta`, the shard's nodes are
            reached over TLS with it too (one CA for the cluster).
        replicas: in a cluster, how many nodes hold the keys under each
            prefix (`{"kv/": 2}`); None (the default): as the servers'
            `[[namespaces]] replicas` say, learned from a node on first use.
        concurrency: in a cluster, most per-node requests of one call in flight at once.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        meta: str | Sequence[str] | None = None,
        nodes: Sequence[str] | None = None,
        timeout: float = 30.0,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        replicas: dict[str, int] | None = None,
        concurrency: int = 8,
    ) -> None:
        if sum(x is not None for x in (address, meta, nodes)) != 1:
            raise InvalidRequestError("CacheClient takes one of: an address, meta= (the metadata shard), nodes=")
        self.timeout = timeout
        self._token = token
        self._tls_ca = tls_ca
        self._metadata: tuple[tuple[str, str], ...] = bearer_metadata(token) if token else ()
        self._router: Router | None = None
        if address is not None:
            self.address = address
        else:
            self._router = self._new_router(meta, nodes, replicas, concurrency)
            shown = meta if isinstance(meta, str) or meta is None else ",".join(meta)
            self.address = f"meta={shown}" if meta is not None else ",".join(nodes or ())
        self._connection = ProcessLocal(self._connect, _close_connection)

    def _new_router(
        self,
        meta: str | Sequence[str] | None,
        nodes: Sequence[str] | None,
        replicas: dict[str, int] | None,
        concurrency: int,
    ) -> Router:
        from cacheclient.meta import MetaClient, PlacementMap
        from cacheclient.router import Router

        return Router(
            self._node_client,
            meta=(
                MetaClient(meta, timeout=min(self.timeout, 10.0), token=self._token, tls_ca=self._tls_ca)
                if meta is not None
                else None
            ),
            static=PlacementMap.static(list(nodes)) if nodes is not None else None,
            timeout=self.timeout,
            concurrency=concurrency,
            replicas={_key(prefix): r for prefix, r in replicas.items()} if replicas is not None else None,
        )

    def _node_client(self, node: str) -> CacheClient:
        """A client of one node of this client's cluster, with its settings."""
        return CacheClient(node, timeout=self.timeout, token=self._token, tls_ca=self._tls_ca)

    def __repr__(self) -> str:
        return f"CacheClient({self.address!r})"

    @property
    def router(self) -> Router | None:
        """The router of a cluster client (its placement map, per-node clients); None for one server."""
        return self._router

    @property
    def cluster(self) -> Cluster:
        """The servers this client reaches: its placement map, a client per node, the metadata shard."""
        if self._router is not None:
            return Cluster(self._router)  # type: ignore[arg-type]
        return Cluster(_OneNode(self))  # type: ignore[arg-type]

    def _with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> CacheClient:
        """This client, over the same connection, with `metadata` added to every call (the router's routing)."""
        view = object.__new__(CacheClient)
        view.__dict__.update(self.__dict__)
        view._metadata = self._metadata + metadata
        return view

    # -- channel lifecycle ----------------------------------------------

    def _connect(self) -> _Connection:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A channel of its own in each process: a global subchannel pool
            # would hand a forked child the parent's sockets ("Wrong file
            # descriptor generation").
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.service_config", OVERLOAD_RETRY_CONFIG),
        ]
        if self._tls_ca is not None:
            ca = self._tls_ca
            if isinstance(ca, str):
                with open(ca, "rb") as f:
                    ca = f.read()
            channel = grpc.secure_channel(self.address, grpc.ssl_channel_credentials(ca), options)
        else:
            channel = grpc.insecure_channel(self.address, options)
        if os.environ.get("CACHECLIENT_TUNE_MALLOC", "1") != "0":
            tune_malloc()
        # No response deserializer: a value's bytes stay in the message they came in.
        get_many_stream = channel.unary_stream(
            _GET_MANY_STREAM, request_serializer=pb.GetManyRequest.SerializeToString, response_deserializer=None
        )
        return _Connection(channel, cache_pb2_grpc.CacheServiceStub(channel), get_many_stream)

    def _service(self) -> Any:
        return self._connection.get().stub

    def _call_kwargs(self, timeout: float | None) -> dict[str, Any]:
        """A call's deadline and metadata: this client's, and a fresh request id (last; see `_failed`)."""
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": (*self._metadata, (REQUEST_ID_METADATA, new_request_id())),
        }

    def _failed(self, exc: grpc.RpcError, kwargs: dict[str, Any]) -> CacheClientError:
        """The typed error of a call made with `kwargs`, naming its request id (the server logs it too)."""
        return from_rpc_error(exc, self.address, kwargs["metadata"][-1][1])

    def close(self) -> None:
        """Closes the channel (every channel, in a cluster); the client reconnects if used again."""
        if self._router is not None:
            self._router.close()
        self._connection.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rpc(self, method: str, request: Any, timeout: float | None) -> Any:
        kwargs = self._call_kwargs(timeout)
        try:
            return getattr(self._service(), method)(request, **kwargs)
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None

    # -- reads ----------------------------------------------------------

    def get(self, key: bytes | str, *, release: bool = False, timeout: float | None = None) -> bytes | None:
        """The value of `key`, or None if no tier holds it.

        Args:
            release: drop the lease a `put(..., lease=...)` took on the key once read.
        """
        key = _key(key)
        if self._router is not None:
            return self._router.get_many([key], release=release, timeout=timeout)[0]
        response = self._rpc("Get", pb.GetRequest(key=key, release=release), timeout)
        return self._value(key, response, timeout)

    def get_many(
        self, keys: Sequence[bytes | str], *, release: bool = False, timeout: float | None = None
    ) -> list[bytes | None]:
        """The values of `keys`, in order (None for each miss), in as few round trips as the sizes allow.

        The server reads each key once. Values that do not fit in its answer
        wait there under a hand-off token: large ones follow in one stream,
        small ones in further answers. Keys it has not read yet (past
        `GET_MANY_READ_BYTES`) are asked again. Batches larger than one
        request may carry are split here.

        Args:
            release: drop the leases taken by the puts of these keys once read.
        """
        wanted = [_key(k) for k in keys]
        if self._router is not None:
            return self._router.get_many(wanted, release=release, timeout=timeout)
        results: list[bytes | None] = [None] * len(wanted)
        pending = list(range(len(wanted)))
        while pending:
            batch = _batch(pending, lambda i: len(wanted[i]) + 8, _KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS)
            pending = self._get_many(wanted, batch, results, release, timeout) + pending[len(batch) :]
        return results

    def _get_many(
        self, wanted: list[bytes], batch: list[int], results: list[bytes | None], release: bool, timeout: float | None
    ) -> list[int]:
        """One GetMany of `wanted[batch]` and the follow-ups of its hand-off, into `results`; the deferred indexes.

        Follow-ups name the hand-off token and read nothing again: the first
        read took the values (and released their leases).
        """
        deferred: list[int] = []
        handoff = b""
        while batch:
            request = pb.GetManyRequest(keys=[wanted[i] for i in batch], release=release, handoff=handoff)
            response = self._rpc("GetMany", request, timeout)
            small: list[int] = []
            large: list[int] = []
            for i, result in zip(batch, response.results, strict=True):
                if result.deferred:
                    # Unread past the server's byte budget. In a follow-up,
                    # only a value the server no longer held, read again.
                    (small if handoff else deferred).append(i)
                elif result.streamed:
                    (large if result.size >= _STREAM_FROM_BYTES else small).append(i)
                else:
                    results[i] = self._inline(wanted[i], result)
            if large:
                keys = [wanted[i] for i in large]
                stream = self._stream(keys, release=False, handoff=response.handoff, timeout=timeout)
                for i, (_, value) in zip(large, stream, strict=True):
                    results[i] = value
            if small == batch:
                raise CacheClientError(f"{self.address}: GetMany answered none of its {len(batch)} keys")
            batch, handoff, release = small, response.handoff, False
        return deferred

    def iter_many(
        self, keys: Sequence[bytes | str], *, release: bool = False, timeout: float | None = None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value or None) for each key, in order, as the values stream in.

        One server stream per `MAX_BATCH_KEYS` keys: the fastest way to move
        many large values (KV-cache blocks), and a consumer can start on the
        first value while the rest arrive. Each value is verified before it is
        yielded.
        """
        for key, pieces in self._iter_pieces(keys, release=release, timeout=timeout):
            yield key, None if pieces is None else _joined(pieces)

    def iter_many_views(
        self, keys: Sequence[bytes | str], *, release: bool = False, timeout: float | None = None
    ) -> Iterator[tuple[bytes, memoryview | None]]:
        """`iter_many` with each value a read-only memoryview: not copied when it came in one message.

        A value of up to `CHUNK_BYTES` is a view of the gRPC message it
        arrived in (no protobuf parse or copy of its bytes on the client);
        a larger one is joined from its chunks once. Each value is verified
        against its checksum before it is yielded. Copy what you keep: the
        cheapest reader copies each view straight to where it belongs
        (`cacheclient.kv.KVCache` copies KV blocks into the result's tensors).
        """
        for key, pieces in self._iter_pieces(keys, release=release, timeout=timeout):
            yield key, None if pieces is None else _view(pieces)

    def _iter_pieces(
        self, keys: Sequence[bytes | str], *, release: bool, timeout: float | None, verify: bool = True
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """(key, the value's chunk data or None), in order: one stream per batch of keys (`iter_many`).

        Args:
            verify: check each value against the checksum it travelled with. Only for a
                caller that checks every byte it uses itself (`KVCache`: a checksum per layer).
        """
        wanted = [_key(k) for k in keys]
        if self._router is not None:
            for key, value in self._router.iter_many(wanted, release=release, timeout=timeout):
                yield key, None if value is None else [memoryview(value)]
            return
        start = 0
        while start < len(wanted):
            batch = _batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, _KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            keys_now = [wanted[i] for i in batch]
            yield from self._stream_pieces(keys_now, release=release, handoff=b"", timeout=timeout, verify=verify)
            start += len(batch)

    def _stream(
        self, keys: list[bytes], *, release: bool, handoff: bytes, timeout: float | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value or None) for `keys` from one GetManyStream, each value checked, in order.

        Args:
            handoff: the token of the read that answered these keys streamed;
                b"" to read them now.
        """
        for key, pieces in self._stream_pieces(keys, release=release, handoff=handoff, timeout=timeout):
            yield key, None if pieces is None else _joined(pieces)

    def _stream_pieces(
        self, keys: list[bytes], *, release: bool, handoff: bytes, timeout: float | None, verify: bool = True
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """`_stream`, each value as the data of its chunks: views of the messages, checked, not yet copied.

        The stream's messages come unparsed; `codec.stream_value_views`
        reads each chunk's small fields and leaves its data in place, and the
        checksum runs over the pieces where they lie.
        """
        kwargs = self._call_kwargs(timeout)
        request = pb.GetManyRequest(keys=keys, release=release, handoff=handoff)
        call = self._connection.get().get_many_stream(request, **kwargs)
        expected = iter(keys)
        try:
            for head, pieces in codec.stream_value_views(call):
                if head.key != next(expected, None):
                    raise CorruptValueError(f"{self.address}: the stream answered key {head.key[:64]!r} out of order")
                if verify and pieces is not None and checksum_of_pieces(pieces) != head.checksum:
                    raise CorruptValueError(
                        f"{self.address}: streamed value for key {head.key[:64]!r} failed its checksum"
                    )
                yield head.key, pieces
            missing = next(expected, None)
            if missing is not None:
                raise CorruptValueError(f"{self.address}: the stream ended before key {missing[:64]!r}")
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None
        except codec.StreamError as exc:
            raise CorruptValueError(f"{self.address}: {exc}") from None
        finally:
            call.cancel()  # a consumer that stops early ends the stream; no-op once it is done

    def get_with_tier(self, key: bytes | str, *, timeout: float | None = None) -> tuple[bytes, str] | None:
        """(value, tier that answered: "l1", "l2" or "l3"), or None on a miss."""
        key = _key(key)
        if self._router is not None:
            return self._router.get_with_tier(key, timeout=timeout)
        response = self._rpc("Get", pb.GetRequest(key=key), timeout)
        value = self._value(key, response, timeout)
        return None if value is None else (value, _TIER_NAMES.get(response.tier, "?"))

    def _value(self, key: bytes, response: Any, timeout: float | None) -> bytes | None:
        """The value a GetResponse answers, streamed through its hand-off when it did not fit."""
        if response.found and response.streamed:
            # The Get read it already (and released its lease).
            [(_, value)] = self._stream([key], release=False, handoff=response.handoff, timeout=timeout)
            return value
        return self._inline(key, response)

    def _inline(self, key: bytes, response: Any) -> bytes | None:
        if not response.found:
            return None
        value: bytes = response.value
        if _checksum(value) != response.checksum:
            raise CorruptValueError(f"{self.address}: value for key {key[:64]!r} failed its checksum in transit")
        return value

    # -- writes ---------------------------------------------------------

    def put(
        self,
        key: bytes | str,
        value: bytes,
        *,
        lease: float | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
    ) -> None:
        """Stores `value` under `key`; values over one message are streamed.

        Args:
            lease: seconds to pin the value in the cache (no eviction) until a
                `get(..., release=True)` reads it or the lease ends.
            ttl: seconds after which the cache forgets the value.
        """
        self.put_many([(key, value)], lease=lease, ttl=ttl, timeout=timeout)

    def put_many(
        self,
        items: Iterable[tuple[bytes | str, bytes]] | dict[Any, bytes],
        *,
        lease: float | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
    ) -> None:
        """Stores every (key, value); batches are validated by the server before any is written.

        `lease` and `ttl` apply to every item, as in `put`.
        """
        pairs = list(items.items()) if isinstance(items, dict) else list(items)
        if self._router is not None:
            self._router.put_many([(_key(k), bytes(v)) for k, v in pairs], lease=lease, ttl=ttl, timeout=timeout)
            return
        extra = {"lease_seconds": lease or 0.0, "ttl_seconds": ttl or 0.0}
        small: list[pb.PutRequest] = []
        for key, value in pairs:
            key, value = _key(key), bytes(value)
            if len(value) > INLINE_BYTES:
                self._put_stream(key, value, timeout, **extra)
            else:
                small.append(pb.PutRequest(key=key, value=value, checksum=_checksum(value), **extra))
        if len(small) == 1:
            self._rpc("Put", small[0], timeout)
            return
        indexes = list(range(len(small)))
        while indexes:
            batch = _batch(
                indexes, lambda i: len(small[i].key) + len(small[i].value) + 16, PUT_MANY_BYTES, MAX_BATCH_KEYS
            )
            self._rpc("PutMany", pb.PutManyRequest(items=[small[i] for i in batch]), timeout)
            indexes = indexes[len(batch) :]

    def _put_stream(self, key: bytes, value: bytes, timeout: float | None, **extra: Any) -> None:
        head = pb.Chunk(key=key, size=len(value), checksum=_checksum(value), **extra)
        kwargs = self._call_kwargs(timeout)
        try:
            self._service().PutStream(codec.value_chunks(head, value), **kwargs)
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None

    def delete(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Removes `key` from every tier, object storage included; returns whether it existed."""
        if self._router is not None:
            return self._router.delete(_key(key), timeout=timeout)
        return bool(self._rpc("Delete", pb.DeleteRequest(key=_key(key)), timeout).existed)

    def contains(self, key: bytes | str, *, cached_only: bool = False, timeout: float | None = None) -> bool:
        """Whether a tier holds `key` (not counted as an access)."""
        if self._router is not None:
            return self._router.contains_many([_key(key)], cached_only=cached_only, timeout=timeout)[0]
        request = pb.ContainsRequest(key=_key(key), cached_only=cached_only)
        return bool(self._rpc("Contains", request, timeout).found)

    def contains_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[bool]:
        """`contains` for many keys, in order, in one round trip per `MAX_BATCH_KEYS` keys."""
        wanted = [_key(k) for k in keys]
        if self._router is not None:
            return self._router.contains_many(wanted, cached_only=cached_only, timeout=timeout)
        found: list[bool] = []
        while len(found) < len(wanted):
            start = len(found)
            batch = _batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, _KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            request = pb.ContainsManyRequest(keys=[wanted[i] for i in batch], cached_only=cached_only)
            found.extend(r.found for r in self._rpc("ContainsMany", request, timeout).results)
        return found

    def locate_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[Location | None]:
        """Where each key is held and how safe its newest value is, in order (None for a key no tier holds).

        Not counted as an access. Without `cached_only`, a key the cache
        tiers miss is looked up in object storage (one request there per key).
        """
        wanted = [_key(k) for k in keys]
        if self._router is not None:
            return self._router.locate_many(wanted, cached_only=cached_only, timeout=timeout)
        located: list[Location | None] = []
        while len(located) < len(wanted):
            start = len(located)
            batch = _batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, _KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            request = pb.ContainsManyRequest(keys=[wanted[i] for i in batch], cached_only=cached_only)
            located.extend(
                Location(_TIER_NAMES.get(r.tier, "?"), r.uploaded, r.on_disk) if r.found else None
                for r in self._rpc("ContainsMany", request, timeout).results
            )
        return located

    def evict(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Drops `key` from the cache tiers only; object storage keeps it. Returns whether it was cached."""
        if self._router is not None:
            return self._router.evict(_key(key), timeout=timeout)
        return bool(self._rpc("Evict", pb.EvictRequest(key=_key(key)), timeout).existed)

    def list(
        self,
        prefix: bytes | str = b"",
        *,
        bucket: str = "",
        start_after: bytes | str = b"",
        page_size: int = 10_000,
        timeout: float | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """(key, size) of every object in the server's object storage under `prefix`, in key order.

        Args:
            bucket: the bucket the caller means; the server refuses
                (`InvalidRequestError`) when it caches another one.
            start_after: list the keys after this one (the last key seen, to resume).
            page_size: keys fetched per request, as the iteration goes.
        """
        if self._router is not None:
            # Every node caches the same object storage: the first that answers lists it.
            node = self._router.any_node(lambda c: (c.info(timeout=timeout), c)[1])
            yield from node.list(prefix, bucket=bucket, start_after=start_after, page_size=page_size, timeout=timeout)
            return
        after = _key(start_after) if start_after else b""
        while True:
            request = pb.ListRequest(
                prefix=_key(prefix) if prefix else b"", start_after=after, limit=page_size, bucket=bucket
            )
            response = self._rpc("List", request, timeout)
            for entry in response.entries:
                yield entry.key, entry.size
            if not response.truncated or not response.entries:
                return
            after = response.entries[-1].key

    def info(self, *, probe_object_storage: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """The server's version, host identity and L2 location (for the co-located fast path).

        In a cluster: the first node that answers.

        Args:
            probe_object_storage: also have the server check that its object
                storage answers; "object_storage" is then "ok", the reason it
                did not answer, or "" when the server has none (and always ""
                without a probe).
        """
        if self._router is not None:
            return self._router.any_node(lambda c: c.info(probe_object_storage=probe_object_storage, timeout=timeout))
        r = self._rpc("Info", pb.InfoRequest(probe_object_storage=probe_object_storage), timeout)
        return {
            "object_storage": (r.object_storage_error or "ok") if r.object_storage_probed else "",
            "version": r.version,
            "hostname": r.hostname,
            "boot_id": r.boot_id,
            "l2_path": r.l2_path,
            "l2_map_size": r.l2_map_size,
            "max_value_bytes": r.max_value_bytes,
            "s3_endpoint": r.s3_endpoint,
            "s3_bucket": r.s3_bucket,
            "s3_prefix": r.s3_prefix,
            "namespaces": [
                {"prefix": ns.prefix, "write_mode": ns.write_mode, "replicas": ns.replicas} for ns in r.namespaces
            ],
        }

    def prefetch(
        self,
        keys: Sequence[bytes | str],
        *,
        window_bytes: int,
        sizes: Sequence[int] | None = None,
        priority: str = "normal",
    ) -> PrefetchPlan:
        """Hands the server a plan of keys to read, in order; it fetches ahead of the reads.

        The server learns progress from the reads it serves, so workers in
        other processes need not report it. Close the returned plan (or use it
        as a context manager) when the reads are done; the server then stops.

        Args:
            keys: the keys in the order they will be read.
            window_bytes: most bytes fetched ahead and not yet read, at once.
            sizes: the values' sizes, when known; they keep the window exact.
            priority: "low", "normal" or "high".

        Raises:
            InvalidRequestError: a bad key, window or sizes.
            LimitExceededError: more than `MAX_PLAN_KEYS` keys, or the server
                already runs its `max_prefetch_plans` plans.
            DeadlineError: the server did not take the plan within the timeout.
        """
        if self._router is not None:
            wanted = [_key(k) for k in keys]
            return self._router.prefetch(wanted, window_bytes=window_bytes, sizes=sizes, priority=priority)
        return PrefetchPlan(self, [_key(k) for k in keys], window_bytes, sizes, priority)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Per-tier usage and engine counters; in a cluster, summed over the nodes, each node's under "nodes"."""
        if self._router is not None:
            return self._router.stats(timeout=timeout)
        response = self._rpc("Stats", pb.StatsRequest(), timeout)
        return {
            "tiers": [
                {
                    "name": t.name,
                    "used_bytes": t.used_bytes,
                    "capacity_bytes": t.capacity_bytes,
                    "entries": t.entries,
                    "hits": t.hits,
                    "evictions": t.evictions,
                    "policy": t.policy,
                }
                for t in response.tiers
            ],
            "counters": dict(response.counters),
        }

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the server (every node of the placement map) accepts connections, or raises UnavailableError."""
        if self._router is not None:
            self._router.wait_ready(timeout)
            return
        try:
            grpc.channel_ready_future(self._connection.get().channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            from cacheclient.errors import UnavailableError

            raise UnavailableError(f"{self.address}: not reachable after {timeout:.0f}s") from None


class _OneNode:
    """The cluster of a client of one server: that node alone, no shard (temporary, until the transports)."""

    shard = None

    def __init__(self, client: CacheClient) -> None:
        self._client = client

    def placement(self, *, refresh: bool = False, timeout: float | None = None) -> PlacementMap:
        return PlacementMap.static([self._client.address])

    def node(self, address: str) -> CacheClient:
        return self._client


class Location(NamedTuple):
    """Where a cache server holds a key (`CacheClient.locate_many`)."""

    tier: str
    """The fastest tier holding it: "l1", "l2" or "l3"."""
    uploaded: bool
    """Object storage holds the newest value (false while a write-back value awaits upload)."""
    on_disk: bool
    """The server's L2 holds a copy, which survives a restart of the server."""

    @property
    def durable(self) -> bool:
        """A copy survives the server being killed: on its disk or in object storage."""
        return self.uploaded or self.on_disk


def _view(pieces: list[memoryview]) -> memoryview:
    """A value from its chunks' data: the one chunk's view as it is, or the chunks joined once."""
    return pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))


def _joined(pieces: list[memoryview]) -> bytes:
    """A value's bytes from its chunks' data: one copy."""
    return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)


def _key(key: bytes | str) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    raise InvalidRequestError(f"key must be bytes or str, got {type(key).__name__}")


def _batch(indexes: Sequence[int], size_of: Callable[[int], int], max_bytes: int, max_keys: int) -> list[int]:
    """The longest prefix of `indexes`, at most `max_keys` long, whose sizes add up to at most `max_bytes` (min 1)."""
    total = 0
    for n, i in enumerate(indexes):
        total += size_of(i)
        if n > 0 and (n >= max_keys or total > max_bytes):
            return list(indexes[:n])
    return list(indexes)


_PRIORITIES = {"low": pb.PRIORITY_LOW, "normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH}


class PrefetchPlan:
    """A prefetch plan running on the server; see `CacheClient.prefetch`."""

    def __init__(
        self,
        client: CacheClient,
        keys: list[bytes],
        window_bytes: int,
        sizes: Sequence[int] | None,
        priority: str,
    ) -> None:
        if priority not in _PRIORITIES:
            raise InvalidRequestError(f"priority must be one of {', '.join(_PRIORITIES)}, got {priority!r}")
        if sizes is not None and len(sizes) != len(keys):
            raise InvalidRequestError(f"sizes has {len(sizes)} entries for {len(keys)} keys")
        if len(keys) > MAX_PLAN_KEYS:
            raise LimitExceededError(
                f"a prefetch plan holds at most {MAX_PLAN_KEYS} keys (MAX_PLAN_KEYS), got {len(keys)}; "
                "split it into several plans"
            )
        import queue

        self._outbox: queue.Queue[pb.PrefetchRequest | None] = queue.Queue()
        self._priority = _PRIORITIES[priority]
        self._send_keys(keys, sizes, window_bytes, self._priority, first=True)
        self._planned = len(keys)
        self.progress: dict[str, Any] = {"planned": len(keys), "fetched": 0, "consumed": 0, "done": False}
        self.error: CacheClientError | None = None
        self._client = client
        self._answered = threading.Event()
        kwargs = self._kwargs = client._call_kwargs(None)
        kwargs["timeout"] = None  # a plan lives as long as the epoch
        self._call = client._service().Prefetch(iter(self._outbox.get, None), **kwargs)
        self._reader = threading.Thread(target=self._read_progress, name="prefetch-progress", daemon=True)
        self._reader.start()
        # The server answers at once, with progress or a refusal (a bad plan,
        # max_prefetch_plans reached): a refused plan raises here, not later.
        if not self._answered.wait(client.timeout):
            self.close()
            raise DeadlineError(f"{client.address}: no answer to a prefetch plan within {client.timeout:g}s")
        if self.error is not None:
            raise self.error

    def _read_progress(self) -> None:
        try:
            for p in self._call:
                self.progress = {
                    "planned": p.planned,
                    "fetched": p.fetched,
                    "consumed": p.consumed,
                    "window_used_bytes": p.window_used_bytes,
                    "failed": p.failed,
                    "done": p.done,
                }
                self._answered.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = self._client._failed(exc, self._kwargs)
        finally:
            self._answered.set()

    def _send_keys(
        self,
        keys: list[bytes],
        sizes: Sequence[int] | None,
        window_bytes: int,
        priority: pb.Priority,
        *,
        first: bool = False,
    ) -> None:
        # Messages stay well under the gRPC limit even with the longest keys;
        # the first message goes even with no keys (it sets the window).
        per_message = min(MAX_PLAN_MESSAGE_KEYS, _PLAN_MESSAGE_BYTES // (max(map(len, keys), default=0) + 16))
        for start in range(0, max(len(keys), int(first)), per_message):
            self._outbox.put(
                pb.PrefetchRequest(
                    keys=keys[start : start + per_message],
                    sizes=list(sizes[start : start + per_message]) if sizes is not None else [],
                    window_bytes=window_bytes if start == 0 else 0,
                    priority=priority,
                )
            )

    @property
    def planned(self) -> int:
        """Keys in the plan: those it started with and every `extend` since."""
        return self._planned

    def extend(self, keys: Sequence[bytes | str], sizes: Sequence[int] | None = None) -> None:
        """Appends keys to the plan, read after every key already in it (a loop's next pass).

        The server learns them in order after the keys sent before; its
        progress counts them once it has (`progress["planned"]`). Keys the
        plan already holds may come again: each occurrence is a read.

        Args:
            keys: the keys, in the order they will be read.
            sizes: their values' sizes, when known; they keep the window exact.

        Raises:
            InvalidRequestError: sizes that do not match keys.
            LimitExceededError: the plan would hold more than `MAX_PLAN_KEYS`
                keys; the plan is unchanged (start another).
        """
        wanted = [_key(k) for k in keys]
        if sizes is not None and len(sizes) != len(wanted):
            raise InvalidRequestError(f"sizes has {len(sizes)} entries for {len(wanted)} keys")
        if self._planned + len(wanted) > MAX_PLAN_KEYS:
            raise LimitExceededError(
                f"a prefetch plan holds at most {MAX_PLAN_KEYS} keys (MAX_PLAN_KEYS); it has {self._planned} "
                f"and {len(wanted)} more were added: start another plan"
            )
        if not wanted:
            return
        self._planned += len(wanted)
        self._send_keys(wanted, sizes, 0, self._priority)

    def consumed(self, n: int) -> None:
        """Tells the server the first `n` keys of the plan have been read."""
        self._outbox.put(pb.PrefetchRequest(consumed=n))

    def wait(self, timeout: float) -> bool:
        """Waits until the server reports every key fetched (or failed); returns whether it did."""
        import time

        deadline = time.monotonic() + timeout
        while not self.progress.get("done") and self._reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return bool(self.progress.get("done"))

    def close(self) -> None:
        """Ends the plan: the server stops fetching for it."""
        self._outbox.put(None)
        self._call.cancel()
        self._reader.join(5.0)

    def __enter__(self) -> PrefetchPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
