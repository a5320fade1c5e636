"""Prometheus metrics of a cache server and of a metadata node, served at /metrics.

Each part is registered in one `CollectorRegistry` per process (a metadata
node's own collector, its Raft state, is in `cachesvc.meta.metrics`):

* `RpcMetrics`, a gRPC server interceptor: requests and their latency per
  service, method and status code (`cachesvc_rpc_requests_total`,
  `cachesvc_rpc_duration_seconds`). Only methods the server registered are
  counted, so the labels stay bounded.
* `CacheServerCollector`: the engine's own counters and tier usage, read
  from `Engine.stats()` (through the server's Stats answer) when Prometheus
  scrapes, so the hot paths count once (in the engine) and the exporter
  only renames. Counters without a name of
  their own here appear as `cachesvc_engine_events_total{event=...}`.

`serve_metrics(address, registry, token=...)` starts the HTTP endpoint (the
`prometheus-client` library's WSGI app and threading server, on a daemon
thread); a process serves metrics only when `metrics_listen` is set. The
metrics are what the admin-scoped Stats answer shows, so with a token the
endpoint answers only a scrape that presents it as a bearer
(`Authorization: Bearer TOKEN`, 401 otherwise): the server passes its admin
token (`security.admin_token`, else `security.token`), or none when the
config opens the endpoint on purpose (`metrics_open`, docs/security.md).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from cacheclient.wire import bearer_metadata
from cachesvc import logs

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "LATENCY_BUCKETS",
    "CacheServerCollector",
    "MetricsServer",
    "RpcMetrics",
    "new_registry",
    "serve_metrics",
]

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Seconds: a local round trip is about half a millisecond, an S3 fill tens of ms, a Raft write a few ms."""

UNTOTALLED_METHODS = frozenset({"Prefetch", "Stats", "Info", "KeyDigest"})
"""Left out of `RpcMetrics.totals` (what `cachectl top` shows): a prefetch plan lasts as long as its
caller wants, Stats and Info are the monitoring itself, and KeyDigest is each local KV index's
background sync (20 calls a second per client), not traffic."""


def new_registry() -> CollectorRegistry:
    """A registry of this process's metrics, with the library's process collector (CPU, memory, open files)."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

    disable_created_metrics()  # `_created` series only double what scrapers already know
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


# -- RPCs --------------------------------------------------------------------------------


class RpcMetrics(grpc.ServerInterceptor):
    """Counts every RPC and times it, by service, method and status code; put it first among the interceptors.

    Being first, it also sees calls a later interceptor refuses (a wrong
    token answers UNAUTHENTICATED). A streamed answer is timed until its
    last message; one the caller abandons counts as CANCELLED.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("service", "method", "code")
        self._requests = Counter(
            "cachesvc_rpc_requests", "RPCs served, by service, method and status code", labels, registry=registry
        )
        self._seconds = Histogram(
            "cachesvc_rpc_duration_seconds",
            "Time from a call's arrival to its status, by service, method and status code",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._lock = threading.Lock()
        self._calls = self._errors = 0
        self._seconds_sum = 0.0

    def totals(self) -> dict[str, int]:
        """Calls, calls that failed and their summed microseconds since start (`UNTOTALLED_METHODS` left out)."""
        with self._lock:
            return {"rpc_calls": self._calls, "rpc_errors": self._errors, "rpc_micros": int(self._seconds_sum * 1e6)}

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None  # no such method: gRPC answers UNIMPLEMENTED; an unbounded name never becomes a label
        service, _, method = details.method.lstrip("/").rpartition("/")
        record = self._recorder(service, method)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_timed_unary(handler.unary_unary, record))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_timed_unary(handler.stream_unary, record))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_timed_stream(handler.unary_stream, record))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_timed_stream(handler.stream_stream, record))
        return handler

    def _recorder(self, service: str, method: str) -> Callable[[grpc.StatusCode, float, grpc.ServicerContext], None]:
        counted = method not in UNTOTALLED_METHODS and not service.startswith("grpc.")

        def record(code: grpc.StatusCode, seconds: float, context: grpc.ServicerContext) -> None:
            self._requests.labels(service, method, code.name).inc()
            self._seconds.labels(service, method, code.name).observe(seconds)
            if counted:
                with self._lock:
                    self._calls += 1
                    self._errors += code is not grpc.StatusCode.OK
                    self._seconds_sum += seconds
            if code is not grpc.StatusCode.OK:
                # One line per failed call, under the caller's request id (logs.request_id).
                level = logging.DEBUG if code in _ROUTINE_FAILURES else logging.INFO
                if log.isEnabledFor(level):
                    details = context.details()
                    details = details.decode(errors="replace") if isinstance(details, bytes) else details or ""
                    log.log(level, "%s %s in %.1f ms: %s", method, code.name, seconds * 1e3, details[:300])

        return record


_ROUTINE_FAILURES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Failures that are the caller's doing or part of routing (a stale map): logged at DEBUG, the rest at INFO."""

_Record = Callable[[grpc.StatusCode, float, grpc.ServicerContext], None]


def _code(context: grpc.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()  # set by abort() or set_code(); None when the handler set nothing
    return code if isinstance(code, grpc.StatusCode) else default


def _timed_unary(behavior: Callable[..., Any], record: _Record) -> Any:
    def timed(request: Any, context: grpc.ServicerContext) -> Any:
        token = logs.request_id.set(logs.request_id_of(context.invocation_metadata()))
        began = time.perf_counter()
        try:
            response = behavior(request, context)
        except BaseException:
            # abort() raises after setting the code; any other exception is answered UNKNOWN.
            record(_code(context, grpc.StatusCode.UNKNOWN), time.perf_counter() - began, context)
            raise
        else:
            record(_code(context, grpc.StatusCode.OK), time.perf_counter() - began, context)
            return response
        finally:
            logs.request_id.reset(token)

    return timed


def _timed_stream(behavior: Callable[..., Iterator[Any]], record: _Record) -> Any:
    def timed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        rid = logs.request_id_of(context.invocation_metadata())
        began = time.perf_counter()
        code = grpc.StatusCode.OK
        # A generator runs a step at a time, maybe not always on one thread's
        # context: the id is set for each step and cleared at each yield.
        logs.request_id.set(rid)
        try:
            for message in behavior(request, context):
                logs.request_id.set("")
                yield message
                logs.request_id.set(rid)
            code = _code(context, grpc.StatusCode.OK)
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = _code(context, grpc.StatusCode.UNKNOWN)
            raise
        finally:
            logs.request_id.set(rid)
            record(code, time.perf_counter() - began, context)
            logs.request_id.set("")

    return timed


# -- the cache server's engine -----------------------------------------------------------

# Engine counter -> (metric name without "cachesvc_" and "_total", help). Monotonic counts only.
_ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    "gets": ("gets", "Keys read (each key of a batch counts)"),
    "misses": ("misses", "Keys no tier held (object storage included)"),
    "puts": ("puts", "Keys written"),
    "puts_not_cached": ("puts_not_cached", "Puts written through to object storage but not kept in a cache tier"),
    "deletes": ("deletes", "Keys deleted"),
    "fills": ("s3_fills", "Values fetched from object storage (or a peer: see peer_fills) into the cache"),
    "fill_bytes": ("s3_fill_bytes", "Bytes fetched from object storage by fills"),
    "fills_joined": ("s3_fills_joined", "Reads that waited on another read's fetch of the same key"),
    "fills_not_cached": ("s3_fills_not_cached", "Fetched values not kept because the cache tiers were full"),
    "l3_errors": ("s3_errors", "Object-storage reads that failed (the read failed or fell back)"),
    "checksum_failures": ("corrupt_values_dropped", "Stored copies whose checksum failed; dropped and read again"),
    "writebacks": ("writeback_uploads", "Write-back values uploaded to object storage"),
    "writeback_errors": ("writeback_upload_errors", "Write-back uploads that failed (retried with backoff)"),
    "writeback_lost": ("writeback_lost", "Write-back values dropped before they were uploaded"),
    "prefetches": ("prefetch_keys", "Keys prefetch plans asked for"),
    "prefetched_bytes": ("prefetched_bytes", "Bytes fetched from object storage ahead of reads"),
    "leases": ("leases", "Puts that took a lease (pinned until read or expiry)"),
    "leases_released": ("leases_released", "Leases ended by a read with release"),
    "leases_expired": ("leases_expired", "Leases that ran out unread"),
    "ttl_expired": ("ttl_expired", "Keys forgotten when their time to live ended"),
    "promotions": ("promotions", "Values copied up to a faster tier on a hit"),
    "demotions": ("demotions", "Values moved down to a slower tier on eviction"),
    "l2_fills_behind": ("l2_fills_behind", "Fills written to L2 behind the reads they answered"),
    "l2_fills_behind_full": (
        "l2_fills_behind_full",
        "Fills whose reader wrote them to L2 itself: the writes behind reads had l2.fill_behind_bytes waiting",
    ),
    "l2_fills_later": ("l2_fills_later", "Fills copied from L1 to L2 once the server was quiet (l2.fill_idle_seconds)"),
    "handoffs": ("handoffs", "Values held for the stream that follows a streamed get"),
    "handoffs_dropped": ("handoffs_dropped", "Held values dropped before their stream came"),
    "handoff_misses": ("handoff_misses", "Streams whose held value was gone and read again"),
    "prefetch_plans_opened": ("prefetch_plans", "Prefetch plans opened"),
    "prefetch_plans_refused": ("prefetch_plans_refused", "Prefetch plans refused (max_prefetch_plans open)"),
    "peer_fills": ("peer_fills", "Values a miss read from the key's previous owner instead of object storage"),
    "peer_fill_bytes": ("peer_fill_bytes", "Bytes read from previous owners by peer fills"),
    "peer_misses": ("peer_misses", "Peer fills whose previous owner no longer held the key (object storage then)"),
    "peer_errors": ("peer_errors", "Peer fills whose previous owner did not answer (skipped for a while)"),
    "peer_reads": ("peer_reads", "Cache-only reads this node answered for peers filling keys it used to own"),
    "prefetch_useful": ("prefetch_useful_reads", "Planned reads whose prefetch had finished and brought the bytes"),
    "prefetch_late": ("prefetch_late_reads", "Planned reads that came before their prefetch finished (or started)"),
    "prefetch_wasted": ("prefetch_wasted_values", "Prefetched values a plan never read before it closed"),
    "prefetch_prefetched": (
        "prefetch_prefetched_values",
        "Values prefetches brought from object storage before their plan read them",
    ),
    "prefetch_evicted_before_use": (
        "prefetch_evicted_before_use_values",
        "Prefetched values evicted from the tier prefetches fill before their plan read them",
    ),
}

# Engine value -> (metric name without "cachesvc_", help). Levels that go up and down.
_ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "writeback_queue": ("writeback_queue_keys", "Keys waiting in the write-back queue"),
    "dirty_keys": ("writeback_dirty_keys", "Cached keys not yet uploaded to object storage"),
    "pinned_keys": ("leases_pinned_keys", "Keys pinned by a lease"),
    "ttl_keys": ("ttl_keys", "Keys with a time to live"),
    "fills_in_flight": ("s3_fills_in_flight", "Object-storage fetches running now"),
    "l2_fills_behind_bytes": ("l2_fills_behind_bytes", "Bytes of fills waiting to be written to L2 behind reads"),
    "l2_fills_deferred": (
        "l2_fills_deferred",
        "Fills whose L2 copy waits for the server to be quiet (l2.fill_idle_seconds)",
    ),
    "handoff_held_bytes": ("handoff_held_bytes", "Bytes of values held for streams"),
    "prefetch_plans_open": ("prefetch_plans_open", "Prefetch plans open now"),
    "placement_version": ("placement_version", "Version of the placement map this server follows (0: none)"),
}

# Engine values reported through the tier metrics.
_PER_TIER_PREFIXES = ("hits_", "evictions_", "hit_bytes_")
# Each prefetch plan's own counters, named by a plan number that grows as long as the server runs:
# only in the Stats answer (the sums over plans are metrics).
_PER_PLAN_PREFIX = "prefetch_plan_"
# Values exported under a name of their own, or not at all (the RPC totals: see RpcMetrics).
_NAMED = frozenset(_ENGINE_COUNTERS) | frozenset(_ENGINE_GAUGES) | {
    "rpc_calls", "rpc_errors", "rpc_micros", "l3_fetches", "l3_fetch_micros",
}  # fmt: skip


class CacheServerCollector(Collector):
    """A cache server's counters and tiers, read at scrape time from what its Stats RPC answers.

    Args:
        stats: `CacheServicer.stats`: {"tiers": [...], "counters": {...}},
            the engine's (`Engine.stats()`) with the prefetcher's and the
            stream hand-off's counters added.
    """

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        values: dict[str, int] = dict(stats["counters"])
        yield from _tier_metrics(stats["tiers"], values)
        yield SummaryMetricFamily(
            "cachesvc_s3_fetch_seconds",
            "Object-storage reads by fills (demand and prefetch): how many, and their summed seconds",
            count_value=values.get("l3_fetches", 0),
            sum_value=values.get("l3_fetch_micros", 0) / 1e6,
        )
        events = CounterMetricFamily(
            "cachesvc_engine_events", "Engine counters without a metric of their own, by name", labels=["event"]
        )
        # Every named metric appears from the first scrape on, at 0 until it moves.
        for name, (metric, help_text) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"cachesvc_{metric}", help_text, value=values.get(name, 0))
        for name, (metric, help_text) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"cachesvc_{metric}", help_text, value=values.get(name, 0))
        for name, value in sorted(values.items()):
            if name not in _NAMED and not name.startswith((*_PER_TIER_PREFIXES, _PER_PLAN_PREFIX, _TENANT_PREFIX)):
                events.add_metric([name], value)
        yield events
        yield from _tenant_metrics(values)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on the engine's tiers; collected at scrape time only


_TENANT_PREFIX = "tenant_"
"""Stats counters of tenants (`cachesvc.policy.tenants.tenant_counters`): "tenant_WHAT/TIER/NAME",
"tenant_misses/NAME"."""


def _tenant_metrics(counters: Mapping[str, int]) -> Iterator[Metric]:
    """cachesvc_tenant_{bytes,hits,misses,evictions,quota_bytes} by tenant (and tier, but for misses)."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "bytes": GaugeMetricFamily(
            "cachesvc_tenant_bytes", "A tenant's bytes in a cache tier of this node", labels=["tenant", "tier"]
        ),
        "hits": CounterMetricFamily(
            "cachesvc_tenant_hits", "A tenant's reads a tier answered", labels=["tenant", "tier"]
        ),
        "evictions": CounterMetricFamily(
            "cachesvc_tenant_evictions", "A tenant's keys evicted from a tier", labels=["tenant", "tier"]
        ),
        "misses": CounterMetricFamily(
            "cachesvc_tenant_misses", "A tenant's reads no cache tier answered", labels=["tenant"]
        ),
        "quota": GaugeMetricFamily(
            "cachesvc_tenant_quota_bytes",
            "A tenant's quota in a cache tier of this node: the cluster's times the node's share of the placement",
            labels=["tenant", "tier"],
        ),
    }
    for name, value in sorted(counters.items()):
        if not name.startswith(_TENANT_PREFIX):
            continue
        what, _, rest = name[len(_TENANT_PREFIX) :].partition("/")
        family = families.get(what)
        if family is None:
            continue
        if what == "misses":
            family.add_metric([rest], value)
        else:
            tier, _, tenant = rest.partition("/")
            family.add_metric([tenant, tier], value)
    yield from families.values()


def _tier_metrics(tiers: list[dict[str, Any]], counters: Mapping[str, int]) -> Iterator[Metric]:
    def family(kind: Any, name: str, help_text: str) -> Any:
        return kind(f"cachesvc_tier_{name}", help_text, labels=["tier"])

    hits = family(CounterMetricFamily, "hits", "Reads a tier answered")
    misses = family(
        CounterMetricFamily, "misses", "Reads that reached a tier and were not answered there (went on down, or missed)"
    )
    hit_bytes = family(CounterMetricFamily, "hit_bytes", "Bytes of values a tier answered reads with")
    evictions = family(CounterMetricFamily, "evictions", "Values a tier's policy evicted")
    used = family(GaugeMetricFamily, "used_bytes", "Bytes a tier holds, as its budget counts them")
    capacity = family(GaugeMetricFamily, "capacity_bytes", "A tier's budget in bytes (0: unbounded, object storage)")
    entries = family(GaugeMetricFamily, "entries", "Keys a tier holds (0 for object storage: not counted)")
    # Every read counts in `gets` and, in the same step under the engine's
    # lock, in the hits of the tier that answered it; what no tier above
    # answered reached the next one, so these differences never go back.
    reached = counters.get("gets", 0)
    for tier in tiers:
        name = tier["name"]
        tier_hits = counters.get(f"hits_{name}", tier["hits"])
        hits.add_metric([name], tier_hits)
        is_last = tier is tiers[-1]
        misses.add_metric([name], counters.get("misses", 0) if is_last else max(0, reached - tier_hits))
        reached -= tier_hits
        hit_bytes.add_metric([name], counters.get(f"hit_bytes_{name}", 0))
        evictions.add_metric([name], tier["evictions"])
        used.add_metric([name], tier["used_bytes"])
        capacity.add_metric([name], tier["capacity_bytes"])
        entries.add_metric([name], tier["entries"])
    yield from (hits, misses, hit_bytes, evictions, used, capacity, entries)


# -- the endpoint ------------------------------------------------------------------------


class MetricsServer:
    """The HTTP endpoint serving a registry at /metrics; `close()` stops it."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class _QuietHandler(WSGIRequestHandler):
    """A request handler that logs nothing per scrape (the library's server is as quiet)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _with_bearer(app: WSGIApplication, token: str) -> WSGIApplication:
    """`app`, answered only to a request whose Authorization header is "Bearer `token`" (401 otherwise)."""
    ((_, expected_value),) = bearer_metadata(token)  # the gRPC services' form of the same credential
    expected = expected_value.encode()

    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Any:
        presented = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(presented, expected):
            return app(environ, start_response)
        body = b"metrics need the admin token: Authorization: Bearer TOKEN\n"
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("Content-Length", str(len(body))), ("WWW-Authenticate", "Bearer")],
        )
        return [body]

    return guarded


def serve_metrics(address: str, registry: CollectorRegistry, *, token: str = "") -> MetricsServer:
    """Serves `registry` at http://ADDRESS/metrics on a daemon thread (port 0 picks one).

    Args:
        address: HOST:PORT to listen on.
        registry: what to serve.
        token: with one, a scrape must present it (`Authorization: Bearer
            TOKEN`) or is answered 401; empty: anyone who reaches `address`.

    Raises:
        OSError: `address` cannot be bound (the message names it).
    """
    host, _, port = address.rpartition(":")

    class Server(ThreadingWSGIServer):
        """The library's threading server, with the address family of `host` (IPv4 or IPv6)."""

    app = make_wsgi_app(registry)
    if token:
        app = _with_bearer(app, token)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        Server.address_family = family
        httpd = make_server(str(sockaddr[0]), int(port), app, Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from None
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    server = MetricsServer(httpd, thread)
    log.info("metrics on http://%s:%d/metrics%s", host, server.port, " (bearer token required)" if token else "")
    return server
