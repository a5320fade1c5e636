"""`CacheClient`: the Python client of one cache server, or of a cluster of them.

`CacheClient(address)` talks to one server. `CacheClient(meta="HOST:PORT,...")`
talks to a cluster: it caches the metadata shard's placement map and sends
each key to the nodes that hold it, splitting batches per node and issuing
the parts at once. `CacheClient(nodes=[...])` does the same over a fixed list
of servers (equal shares, no shard). The methods and their meaning are the
same in both modes.

The client is a front over a transport (`cacheclient.transport`): it checks
arguments and turns keys into bytes, and the transport carries each call,
to one server (`OneNode`, over a `cacheclient.node.NodeClient`) or routed
over the cluster (`cacheclient.routing.Router`). `cache.cluster` is the
typed view of the servers behind it (placement map, per-node clients, shard).

Batch-first: `get_many`/`put_many` are the primary calls, split into
messages under the gRPC size limit; `get`/`put` are batches of one. Every
call has a deadline. Values are verified against their xxh3-64 checksum on
arrival, so corrupt bytes raise instead of reaching the caller.

Memory and fork safety are the node client's (`cacheclient.node`): glibc's
malloc thresholds are raised on first connect (CACHECLIENT_TUNE_MALLOC=0
leaves them), channels are made lazily in each process and dropped in a
forked child, and the client pickles without them (for `spawn` workers).
A fork while another thread of the parent is inside a gRPC call can hang or
crash the child, so keep parent-side calls away from the moment workers
start, or use the forkserver or spawn start method.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from cacheclient._batches import Gathered, PutValue, as_key, joined, view, writable_bytes
from cacheclient._lmdb_reader import L2Reader, colocated_reader
from cacheclient.cluster import Cluster
from cacheclient.colocated import Colocated
from cacheclient.errors import InvalidRequestError
from cacheclient.meta import MetaClient
from cacheclient.node import Location, NodeClient
from cacheclient.node_plan import PrefetchPlan
from cacheclient.routing import Router
from cacheclient.transport import OneNode, Transport
from cacheclient.wire.names import READ_METADATA, READ_VERIFIED
from cacheclient.wire.placement import PlacementMap

__all__ = ["CacheClient", "Location", "PrefetchPlan", "connect"]


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
        colocated: read a server's shared L1 directly when the server runs
            on this machine (`cacheclient.colocated`): None (the default) when
            it does, False never; True (one server only) or fail. In a
            cluster, each key from a replica on this machine, when it is one.
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
        colocated: bool | None = None,
    ) -> None:
        if sum(x is not None for x in (address, meta, nodes)) != 1:
            raise InvalidRequestError("CacheClient takes one of: an address, meta= (the metadata shard), nodes=")
        self.timeout = timeout
        self._l2: L2Reader | None = None
        self._l2_asked = False
        """The co-located L2 reader of `get_into`, once asked for (`_l2_asked`)."""
        self._token = token
        self._tls_ca = tls_ca
        self._transport: Transport
        if address is not None:
            self.address = address
            node = NodeClient(address, timeout=timeout, token=token, tls_ca=tls_ca)
            # On this machine, reads come straight from the server's shared L1 (cacheclient.colocated).
            self._transport = OneNode(node) if colocated is False else Colocated(node, required=colocated is True)
            return
        shown = meta if isinstance(meta, str) or meta is None else ",".join(meta)
        self.address = f"meta={shown}" if meta is not None else ",".join(nodes or ())
        self._transport = Router(
            functools.partial(NodeClient, timeout=timeout, token=token, tls_ca=tls_ca),
            meta=(
                MetaClient(meta, timeout=min(timeout, 10.0), token=token, tls_ca=tls_ca) if meta is not None else None
            ),
            static=PlacementMap.static(list(nodes)) if nodes is not None else None,
            timeout=timeout,
            concurrency=concurrency,
            replicas={as_key(prefix): r for prefix, r in replicas.items()} if replicas is not None else None,
            colocated=colocated is not False,
        )

    def __repr__(self) -> str:
        return f"CacheClient({self.address!r})"

    def verified_reads(self) -> CacheClient:
        """This client, over the same connections, for keys whose values the caller checks against their names.

        For content-addressed keys (the name is a digest of the bytes, as a
        checkpoint's chunks are): every stored value of such a key is the
        value, so a write-back key that nodes withhold while a node that may
        hold a newer value is down (`FAILED_PRECONDITION`, see the cluster
        guide) is served from what the node has, or from object storage.
        Closing either client closes both's connections.
        """
        reader = object.__new__(CacheClient)
        reader.__dict__.update(self.__dict__)
        reader._transport = self._transport.with_metadata(((READ_METADATA, READ_VERIFIED),))
        return reader

    @property
    def cluster(self) -> Cluster:
        """The servers this client reaches: its placement map, a client per node, the metadata shard.

        A client of one server sees a cluster of that node alone.
        """
        return Cluster(self._transport)

    @property
    def transport(self) -> Transport:
        """How this client's calls reach the servers: one node (`OneNode`) or routed (`Router`)."""
        return self._transport

    def close(self) -> None:
        """Closes the channel (every channel, in a cluster); the client reconnects if used again."""
        self._transport.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ----------------------------------------------------------

    def get(self, key: bytes | str, *, release: bool = False, timeout: float | None = None) -> bytes | None:
        """The value of `key`, or None if no tier holds it.

        Args:
            release: drop the lease a `put(..., lease=...)` took on the key once read.
        """
        return self._transport.get(as_key(key), release=release, timeout=timeout)

    def get_many(
        self, keys: Sequence[bytes | str], *, release: bool = False, timeout: float | None = None
    ) -> list[bytes | None]:
        """The values of `keys`, in order (None for each miss), in as few round trips as the sizes allow.

        Each server reads each key once; values too large for its answer
        follow in a stream (`NodeClient.get_many` says how). Batches larger
        than one request may carry are split; in a cluster, each node's
        share is asked at once.

        Args:
            release: drop the leases taken by the puts of these keys once read.
        """
        return self._transport.get_many([as_key(k) for k in keys], release=release, timeout=timeout)

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
            yield key, None if pieces is None else joined(pieces)

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
            yield key, None if pieces is None else view(pieces)

    def _iter_pieces(
        self, keys: Sequence[bytes | str], *, release: bool, timeout: float | None
    ) -> Iterator[tuple[bytes, list[memoryview] | None]]:
        """(key, the value's chunk data or None), in order: one stream per batch of keys (`iter_many`).

        A caller that checks every byte it uses itself asks the transport with `verify=False`
        (`KVCache`: a tensor record checks every tensor's bytes).
        """
        wanted = [as_key(k) for k in keys]
        return self._transport.iter_pieces(wanted, release=release, timeout=timeout, verify=True)

    def get_into(
        self, key: bytes | str, buffer: Any, *, release: bool = False, timeout: float | None = None
    ) -> int | None:
        """Copies the value of `key` into `buffer`; returns its length in bytes, or None on a miss.

        `buffer` is anything writable and contiguous: a bytearray, a
        memoryview, a numpy array, a CPU torch tensor (page-locked ones
        included); the value fills its first bytes. On the server's machine a
        value in the server's L2 is read straight from its file into
        `buffer` (one copy) and verified there; otherwise the value's chunks
        are copied in as they arrive from the server, each verified first.

        Raises:
            InvalidRequestError: `buffer` is not writable or not contiguous,
                or is smaller than the value (nothing of it is then used).
        """
        wanted = as_key(key)
        into = writable_bytes(buffer)
        local = self._local_l2()
        if local is not None and not release:
            try:
                got = local.get_into(wanted, into)
            except Exception:  # lmdb.Error and OSError alike: the server still answers
                self._l2 = None
                got = None
            if got is not None:
                if isinstance(got, memoryview):
                    return len(got)
                raise InvalidRequestError(
                    f"a buffer of {len(into)} bytes cannot take the {len(got)}-byte value of {wanted[:64]!r}"
                )
        for _, pieces in self._transport.iter_pieces([wanted], release=release, timeout=timeout, verify=True):
            if pieces is None:
                return None
            size = sum(len(piece) for piece in pieces)
            if size > len(into):
                raise InvalidRequestError(
                    f"a buffer of {len(into)} bytes cannot take the {size}-byte value of {wanted[:64]!r}"
                )
            offset = 0
            for piece in pieces:
                into[offset : offset + len(piece)] = piece
                offset += len(piece)
            return size
        return None

    def _local_l2(self) -> L2Reader | None:
        """A reader of the server's L2 when this client's one server runs on this machine (asked once)."""
        if not self._l2_asked:
            self._l2_asked = True
            if isinstance(self._transport, Colocated):
                self._l2 = colocated_reader(self, self.address)
        return self._l2

    def get_with_tier(self, key: bytes | str, *, timeout: float | None = None) -> tuple[bytes, str] | None:
        """(value, tier that answered: "l1", "l2" or "l3"), or None on a miss."""
        return self._transport.get_with_tier(as_key(key), timeout=timeout)

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
        """Stores `value` under `key`; values over one message are streamed (a co-located client writes them
        into its staging area instead, `cacheclient.staged`).

        Args:
            lease: seconds to pin the value in the cache (no eviction) until a
                `get(..., release=True)` reads it or the lease ends.
            ttl: seconds after which the cache forgets the value.
            durable: the value survives the server being killed once `put`
                returns (in object storage, or on the server's disk too); a
                server that can do neither for the key refuses the put
                (`CacheClientError`, FAILED_PRECONDITION).
        """
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
        """Stores every (key, value); batches are validated by the server before any is written.

        `lease`, `ttl` and `durable` apply to every item, as in `put`.
        """
        pairs = list(items.items()) if isinstance(items, dict) else list(items)
        # A contiguous byte view goes as it is: a co-located put copies it into shared memory once; so do the
        # pieces of a `Gathered` value (a KV block straight out of an engine's pages).
        wanted = [(as_key(k), v if isinstance(v, bytes | Gathered) or _byte_view(v) else bytes(v)) for k, v in pairs]
        self._transport.put_many(wanted, lease=lease, ttl=ttl, timeout=timeout, durable=durable)

    def delete(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Removes `key` from every tier, object storage included; returns whether it existed."""
        return self._transport.delete(as_key(key), timeout=timeout)

    # -- where keys are -------------------------------------------------

    def contains(self, key: bytes | str, *, cached_only: bool = False, timeout: float | None = None) -> bool:
        """Whether a tier holds `key` (not counted as an access)."""
        return self._transport.contains(as_key(key), cached_only=cached_only, timeout=timeout)

    def contains_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[bool]:
        """`contains` for many keys, in order, in one round trip per `MAX_BATCH_KEYS` keys."""
        wanted = [as_key(k) for k in keys]
        return self._transport.contains_many(wanted, cached_only=cached_only, timeout=timeout)

    def locate_many(
        self, keys: Sequence[bytes | str], *, cached_only: bool = False, timeout: float | None = None
    ) -> list[Location | None]:
        """Where each key is held and how safe its newest value is, in order (None for a key no tier holds).

        Not counted as an access. Without `cached_only`, a key the cache
        tiers miss is looked up in object storage (one request there per key).
        """
        wanted = [as_key(k) for k in keys]
        return self._transport.locate_many(wanted, cached_only=cached_only, timeout=timeout)

    def evict(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Drops `key` from the cache tiers only; object storage keeps it. Returns whether it was cached."""
        return self._transport.evict(as_key(key), timeout=timeout)

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
        """(key, size) of every object in the server's object storage under `prefix`, in key order.

        In a cluster, every node caches the same object storage: the first that answers lists it.

        Args:
            bucket: the bucket the caller means; the server refuses
                (`InvalidRequestError`) when it caches another one.
            start_after: list the keys after this one (the last key seen, to resume).
            page_size: keys fetched per request, as the iteration goes.
            cached: list the keys the cache tiers hold instead (in a cluster,
                every node's, each key once). A server without object storage
                lists these either way.
        """
        yield from self._transport.list(
            as_key(prefix) if prefix else b"",
            bucket=bucket,
            start_after=as_key(start_after) if start_after else b"",
            page_size=page_size,
            cached=cached,
            timeout=timeout,
        )

    # -- the servers ----------------------------------------------------

    def info(self, *, probe_object_storage: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """The server's version, host identity and L2 location (for the co-located fast path).

        In a cluster: the first node that answers.

        Args:
            probe_object_storage: also have the server check that its object
                storage answers; "object_storage" is then "ok", the reason it
                did not answer, or "" when the server has none (and always ""
                without a probe).
        """
        return self._transport.info(probe_object_storage=probe_object_storage, timeout=timeout)

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
        In a cluster, the plan is split over the keys' owners.

        Args:
            keys: the keys in the order they will be read.
            window_bytes: most bytes fetched ahead and not yet read, at once.
            sizes: the values' sizes, when known; they keep the window exact.
            priority: "low", "normal" or "high": while several plans are open on a
                server, a higher plan's fetches start before any of a lower one's;
                plans of one priority take turns.

        Raises:
            InvalidRequestError: a bad key, window or sizes.
            LimitExceededError: more than `MAX_PLAN_KEYS` keys, or the server
                already runs its `max_prefetch_plans` plans.
            DeadlineError: the server did not take the plan within the timeout.
        """
        wanted = [as_key(k) for k in keys]
        return self._transport.prefetch(wanted, window_bytes=window_bytes, sizes=sizes, priority=priority)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Per-tier usage and engine counters; in a cluster, summed over the nodes, each node's under "nodes"."""
        return self._transport.stats(timeout=timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the server (every node of the placement map) accepts connections, or raises UnavailableError."""
        self._transport.wait_ready(timeout)


def connect(
    cache: CacheClient | str,
    *,
    timeout: float = 30.0,
    token: str | None = None,
    tls_ca: bytes | str | None = None,
    colocated: bool | None = None,
) -> CacheClient:
    """The client for `cache`: the client itself when given one (a cluster's, say), else a client of the server
    at that "host:port" with these settings."""
    if isinstance(cache, CacheClient):
        return cache
    return CacheClient(cache, timeout=timeout, token=token, tls_ca=tls_ca, colocated=colocated)


def _byte_view(value: object) -> bool:
    return isinstance(value, memoryview) and value.contiguous and value.nbytes == len(value)
