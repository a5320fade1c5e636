"""`NodeClient`: the client of one cache server, over one gRPC channel per process.

It speaks the cache service's RPCs to one address and nothing else: no
placement, no routing. `CacheClient` stands on it (over a transport: one
node, or a routed cluster of them), and so do the server's own calls to its
peers. It imports only the floor: the wire contract, the typed errors,
`ProcessLocal` and malloc tuning.

Batches are split into messages under the gRPC size limit; `get`/`put` are
batches of one. Every call has a deadline. Values are verified against
their xxh3-64 checksum on arrival, so corrupt bytes raise instead of
reaching the caller.

Memory: the first channel in a process raises glibc's malloc thresholds
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
start, or use the forkserver or spawn start method. (The calls the client's
own background threads make are waited for before a fork:
`cacheclient.process_local.background_call`.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from cacheclient._batches import (
    KEY_BYTES_PER_MESSAGE,
    STREAM_FROM_BYTES,
    Gathered,
    PutValue,
    as_key,
    joined,
    next_batch,
    view,
)
from cacheclient._malloc import tune_malloc
from cacheclient.errors import CacheClientError, CorruptValueError, UnavailableError, from_rpc_error
from cacheclient.node_plan import NodePrefetchPlan
from cacheclient.process_local import ProcessLocal, keep_grpc_initialised
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
from cacheclient.wire.limits import MAX_BATCH_KEYS, PUT_MANY_BYTES
from cacheclient.wire.names import REQUEST_ID_METADATA, new_request_id
from cacheclient.wire.record import checksum_of_pieces

__all__ = ["OVERLOAD_RETRY_CONFIG", "Location", "NodeClient"]

_SERVICE = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
_GET_MANY_STREAM = f"/{_SERVICE}/GetManyStream"


@dataclass
class _Connection:
    """One process's channel to the server and the stub over it (not frozen: a test replaces `get_many_stream`)."""

    channel: grpc.Channel
    stub: Any
    get_many_stream: Any
    """GetManyStream answering the serialized chunks (bytes): the client parses them (`codec.stream_value_views`)."""
    put: Any
    """Put taking the serialized request (`codec.put_request_bytes`)."""
    put_many: Any
    """PutMany taking the serialized request (`codec.put_many_request_bytes`)."""


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


class NodeClient:
    """A client of the one cache server at `address` ("host:port"); see the module docstring.

    Args:
        address: the server's host:port.
        timeout: default deadline of each call, in seconds.
        token: bearer token, when the server requires one.
        tls_ca: PEM bytes or a path of the CA that signed the server's
            certificate; enables TLS.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.token = token
        self.tls_ca = tls_ca
        self._metadata: tuple[tuple[str, str], ...] = bearer_metadata(token) if token else ()
        self._connection = ProcessLocal(self._connect, _close_connection)

    def __repr__(self) -> str:
        return f"NodeClient({self.address!r})"

    def with_metadata(self, metadata: tuple[tuple[str, str], ...]) -> NodeClient:
        """This client, over the same connection, with `metadata` added to every call.

        The routing names the map version and a fallback this way; a server
        asking a peer names itself as the reader.
        """
        client = object.__new__(NodeClient)
        client.__dict__.update(self.__dict__)
        client._metadata = self._metadata + metadata
        return client

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
            # A node that restarted is reached again within 2 s (gRPC's backoff
            # grows to 120 s): a routed write goes to every replica and fails
            # while one of them is not reached.
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        keep_grpc_initialised()
        if self.tls_ca is not None:
            ca = self.tls_ca
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
        # Puts take their requests serialized: the values' bytes are copied once, into the message.
        put = channel.unary_unary(f"/{_SERVICE}/Put", response_deserializer=pb.PutResponse.FromString)
        put_many = channel.unary_unary(f"/{_SERVICE}/PutMany", response_deserializer=pb.PutManyResponse.FromString)
        return _Connection(channel, cache_pb2_grpc.CacheServiceStub(channel), get_many_stream, put, put_many)

    def _service(self) -> Any:
        return self._connection.get().stub

    def _call_kwargs(self, timeout: float | None) -> dict[str, Any]:
        """A call's deadline and metadata: this client's, and a fresh request id (last; see `_failed`)."""
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": (*self._metadata, (REQUEST_ID_METADATA, new_request_id())),
        }

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call of this client carries (its token's header, the routing's)."""
        return self._metadata

    def _failed(self, exc: grpc.RpcError, kwargs: dict[str, Any]) -> CacheClientError:
        """The typed error of a call made with `kwargs`, naming its request id (the server logs it too)."""
        return from_rpc_error(exc, self.address, kwargs["metadata"][-1][1])

    def close(self) -> None:
        """Closes this process's channel; the client reconnects if used again."""
        self._connection.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rpc(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary call of the cache service by its name ("KeyDigest"), with this client's deadline and metadata.

        Raises:
            CacheClientError: the server's refusal or failure, typed (`cacheclient.errors`).
        """
        kwargs = self._call_kwargs(timeout)
        try:
            return getattr(self._service(), method)(request, **kwargs)
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None

    # -- reads ----------------------------------------------------------

    def get(
        self,
        key: bytes | str,
        *,
        release: bool = False,
        timeout: float | None = None,
        shared: Callable[[bytes, int], bytes | None] | None = None,
    ) -> bytes | None:
        """The value of `key`, or None (`CacheClient.get`); a value too large for the answer follows in a stream.

        Args:
            shared: for a co-located caller, asked for a value too large for
                the answer (with its key and the answer's checksum) before it
                is streamed: the server's shared L1, where the Get published
                it (`cacheclient.colocated`). None: stream it.
        """
        key = as_key(key)
        response = self.rpc("Get", pb.GetRequest(key=key, release=release), timeout)
        if shared is not None and response.found and response.streamed:
            value = shared(key, response.checksum)
            if value is not None:
                return value  # the hand-off the server holds for the stream runs out by itself
        return self._value(key, response, timeout)

    def get_many(
        self,
        keys: Sequence[bytes | str],
        *,
        release: bool = False,
        timeout: float | None = None,
        shared: Callable[[bytes, int], bytes | None] | None = None,
    ) -> list[bytes | None]:
        """The values of `keys`, in order (None for each miss), in as few round trips as the sizes allow.

        The server reads each key once. Values that do not fit in its answer
        wait there under a hand-off token: large ones follow in one stream,
        small ones in further answers. Keys it has not read yet (past
        `GET_MANY_READ_BYTES`) are asked again. Batches larger than one
        request may carry are split here.

        Args:
            release: drop the leases taken by the puts of these keys once read.
            shared: as `get`'s, asked for each value large enough to stream
                before it is streamed; the rest stream as before.
        """
        wanted = [as_key(k) for k in keys]
        results: list[bytes | None] = [None] * len(wanted)
        pending = list(range(len(wanted)))
        while pending:
            batch = next_batch(pending, lambda i: len(wanted[i]) + 8, KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS)
            pending = self._get_many(wanted, batch, results, release, timeout, shared) + pending[len(batch) :]
        return results

    def _get_many(
        self,
        wanted: list[bytes],
        batch: list[int],
        results: list[bytes | None],
        release: bool,
        timeout: float | None,
        shared: Callable[[bytes, int], bytes | None] | None = None,
    ) -> list[int]:
        """One GetMany of `wanted[batch]` and the follow-ups of its hand-off, into `results`; the deferred indexes.

        Follow-ups name the hand-off token and read nothing again: the first
        read took the values (and released their leases).
        """
        deferred: list[int] = []
        handoff = b""
        while batch:
            request = pb.GetManyRequest(keys=[wanted[i] for i in batch], release=release, handoff=handoff)
            response = self.rpc("GetMany", request, timeout)
            small: list[int] = []
            large: list[int] = []
            for i, result in zip(batch, response.results, strict=True):
                if result.deferred:
                    # Unread past the server's byte budget. In a follow-up,
                    # only a value the server no longer held, read again.
                    (small if handoff else deferred).append(i)
                elif result.streamed:
                    if result.size < STREAM_FROM_BYTES:
                        small.append(i)
                    elif shared is None or (found := shared(wanted[i], result.checksum)) is None:
                        large.append(i)
                    else:
                        results[i] = found  # as get's: the hand-off the server holds for it runs out by itself
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
        """(key, value or None) for each key, in order, as they stream in (`CacheClient.iter_many`)."""
        for key, pieces in self.iter_pieces(keys, release=release, timeout=timeout):
            yield key, None if pieces is None else joined(pieces)

    def iter_many_views(
        self, keys: Sequence[bytes | str], *, release: bool = False, timeout: float | None = None
    ) -> Iterator[tuple[bytes, memoryview | None]]:
        """`iter_many` with each value a read-only memoryview (`CacheClient.iter_many_views`)."""
        for key, pieces in self.iter_pieces(keys, release=release, timeout=timeout):
            yield key, None if pieces is None else view(pieces)

    def iter_pieces(
        self, keys: Sequence[bytes | str], *, release: bool, timeout: float | None, verify: bool = True
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """(key, the value's chunk data or None), in order: one stream per batch of keys (`iter_many`).

        The pieces are views of the messages they came in, for a reader that
        copies them where they belong (`view` and `joined` make a value of them).

        Args:
            verify: check each value against the checksum it travelled with. Only for a
                caller that checks every byte it uses itself (`KVCache`: a tensor record checks every tensor's bytes).
        """
        wanted = [as_key(k) for k in keys]
        start = 0
        while start < len(wanted):
            batch = next_batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
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
            yield key, None if pieces is None else joined(pieces)

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
        key = as_key(key)
        response = self.rpc("Get", pb.GetRequest(key=key), timeout)
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
        durable: bool = False,
    ) -> None:
        """Stores `value` under `key` (`CacheClient.put`): a batch of one."""
        self.put_many([(key, value)], lease=lease, ttl=ttl, timeout=timeout, durable=durable)

    def put_many(
        self,
        items: Iterable[tuple[bytes | str, PutValue]] | dict[Any, bytes],
        *,
        lease: float | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
        durable: bool = False,
    ) -> None:
        """Stores every (key, value) (`CacheClient.put_many`).

        A value over `INLINE_BYTES` goes in a PutStream of its own; the rest in
        PutMany batches under `PUT_MANY_BYTES`, or one Put when there is one,
        serialized by hand: each value byte is copied once, into the request
        (a `Gathered` value's pieces too, never joined first).
        """
        pairs = list(items.items()) if isinstance(items, dict) else list(items)
        extra: dict[str, Any] = {"lease_seconds": lease or 0.0, "ttl_seconds": ttl or 0.0, "durable": durable}
        small: list[tuple[pb.PutRequest, Sequence[bytes | memoryview], int]] = []
        for key, value in pairs:
            key = as_key(key)
            pieces: Sequence[bytes | memoryview] = value.pieces if isinstance(value, Gathered) else (bytes(value),)
            size = sum(len(p) for p in pieces)
            if size > INLINE_BYTES:
                self._put_stream(key, b"".join(pieces), timeout, **extra)
            else:
                small.append((pb.PutRequest(key=key, checksum=checksum_of_pieces(pieces), **extra), pieces, size))
        if len(small) == 1:
            head, pieces, _ = small[0]
            self._put_call("put", codec.put_request_bytes(head, pieces), timeout)
            return
        indexes = list(range(len(small)))
        while indexes:
            batch = next_batch(
                indexes, lambda i: len(small[i][0].key) + small[i][2] + 16, PUT_MANY_BYTES, MAX_BATCH_KEYS
            )
            request = codec.put_many_request_bytes([small[i][:2] for i in batch])
            self._put_call("put_many", request, timeout)
            indexes = indexes[len(batch) :]

    def _put_call(self, method: str, request: bytes, timeout: float | None) -> None:
        """A Put or PutMany ("put", "put_many") of its serialized request, with this client's deadline and metadata."""
        kwargs = self._call_kwargs(timeout)
        try:
            getattr(self._connection.get(), method)(request, **kwargs)
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None

    def _put_stream(self, key: bytes, value: bytes, timeout: float | None, **extra: Any) -> None:
        head = pb.Chunk(key=key, size=len(value), checksum=_checksum(value), **extra)
        kwargs = self._call_kwargs(timeout)
        try:
            self._service().PutStream(codec.value_chunks(head, value), **kwargs)
        except grpc.RpcError as exc:
            raise self._failed(exc, kwargs) from None

    def delete(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Removes `key` from every tier and object storage (`CacheClient.delete`); whether it existed."""
        return bool(self.rpc("Delete", pb.DeleteRequest(key=as_key(key)), timeout).existed)

    def contains(self, key: bytes | str, *, cached_only: bool = False, timeout: float | None = None) -> bool:
        """Whether a tier holds `key` (`CacheClient.contains`)."""
        request = pb.ContainsRequest(key=as_key(key), cached_only=cached_only)
        return bool(self.rpc("Contains", request, timeout).found)

    def contains_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[bool]:
        """`contains` for many keys, in order: one ContainsMany per batch of keys."""
        wanted = [as_key(k) for k in keys]
        found: list[bool] = []
        while len(found) < len(wanted):
            start = len(found)
            batch = next_batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            request = pb.ContainsManyRequest(keys=[wanted[i] for i in batch], cached_only=cached_only)
            found.extend(r.found for r in self.rpc("ContainsMany", request, timeout).results)
        return found

    def release(self, keys: Sequence[bytes | str], *, timeout: float | None = None) -> None:
        """Ends the lease a put took on each key here, as a read with `release=True` does, without reading it.

        One ContainsMany (cached only, with release) per batch of keys; a key
        with no lease here is left as it is.
        """
        wanted = [as_key(k) for k in keys]
        start = 0
        while start < len(wanted):
            batch = next_batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            request = pb.ContainsManyRequest(keys=[wanted[i] for i in batch], cached_only=True, release=True)
            self.rpc("ContainsMany", request, timeout)
            start += len(batch)

    def locate_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[Location | None]:
        """Where each key is held, in order (`CacheClient.locate_many`): one ContainsMany per batch of keys."""
        wanted = [as_key(k) for k in keys]
        located: list[Location | None] = []
        while len(located) < len(wanted):
            start = len(located)
            batch = next_batch(
                range(start, len(wanted)), lambda i: len(wanted[i]) + 8, KEY_BYTES_PER_MESSAGE, MAX_BATCH_KEYS
            )
            request = pb.ContainsManyRequest(keys=[wanted[i] for i in batch], cached_only=cached_only)
            located.extend(
                Location(_TIER_NAMES.get(r.tier, "?"), r.uploaded, r.on_disk, r.version) if r.found else None
                for r in self.rpc("ContainsMany", request, timeout).results
            )
        return located

    def evict(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Drops `key` from the cache tiers only (`CacheClient.evict`); whether it was cached."""
        return bool(self.rpc("Evict", pb.EvictRequest(key=as_key(key)), timeout).existed)

    def list(
        self,
        prefix: bytes | str = b"",
        *,
        bucket: str = "",
        start_after: bytes | str = b"",
        page_size: int = 10_000,
        cached: bool = False,
        timeout: float | None = None,
    ) -> Iterator[tuple[bytes, int]]:
        """(key, size) under `prefix` in the server's object storage, in key order (`CacheClient.list`).

        With `cached`, or from a server without object storage: the keys its
        cache tiers hold. Pages of `page_size` keys are fetched as the iteration goes.
        """
        after = as_key(start_after) if start_after else b""
        while True:
            request = pb.ListRequest(
                prefix=as_key(prefix) if prefix else b"",
                start_after=after,
                limit=page_size,
                bucket=bucket,
                cached=cached,
            )
            response = self.rpc("List", request, timeout)
            for entry in response.entries:
                yield entry.key, entry.size
            if not response.truncated or not response.entries:
                return
            after = response.entries[-1].key

    def info(self, *, probe_object_storage: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """The server's version, host identity, L2 location and namespaces (`CacheClient.info`)."""
        r = self.rpc("Info", pb.InfoRequest(probe_object_storage=probe_object_storage), timeout)
        return {
            "object_storage": (r.object_storage_error or "ok") if r.object_storage_probed else "",
            "version": r.version,
            "hostname": r.hostname,
            "boot_id": r.boot_id,
            "l2_path": r.l2_path,
            "l2_map_size": r.l2_map_size,
            "arena_socket": r.arena_socket,
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
    ) -> NodePrefetchPlan:
        """Hands the server a plan of keys to read, in order (`CacheClient.prefetch`): one Prefetch stream.

        Raises:
            InvalidRequestError: a bad key, window or sizes.
            LimitExceededError: more than `MAX_PLAN_KEYS` keys, or the server
                already runs its `max_prefetch_plans` plans.
            DeadlineError: the server did not take the plan within the timeout.
        """
        kwargs = self._call_kwargs(None)
        kwargs["timeout"] = None  # a plan lives as long as the epoch
        return NodePrefetchPlan(
            [as_key(k) for k in keys],
            window_bytes,
            sizes,
            priority,
            start=lambda requests: self._service().Prefetch(requests, **kwargs),
            failed=lambda exc: self._failed(exc, kwargs),
            address=self.address,
            timeout=self.timeout,
        )

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Per-tier usage ("tiers") and engine counters ("counters")."""
        response = self.rpc("Stats", pb.StatsRequest(), timeout)
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
        """Blocks until the server accepts connections, or raises UnavailableError."""
        try:
            grpc.channel_ready_future(self._connection.get().channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"{self.address}: not reachable after {timeout:.0f}s") from None


class Location(NamedTuple):
    """Where a cache server holds a key (`CacheClient.locate_many`)."""

    tier: str
    """The fastest tier holding it: "l1", "l2" or "l3"."""
    uploaded: bool
    """Object storage holds the newest value (false while a write-back value awaits upload)."""
    on_disk: bool
    """The server's L2 holds a copy, which survives a restart of the server."""
    version: int = 0
    """The version the server's cached copy carries (its hybrid logical clock stamp); 0 when unknown."""

    @property
    def durable(self) -> bool:
        """A copy survives the server being killed: on its disk or in object storage."""
        return self.uploaded or self.on_disk
