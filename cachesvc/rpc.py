"""The gRPC server plumbing every cachesvc service stands on: a cache server and a metadata node alike.

Building, binding, starting and running a gRPC server the same way for
each service: bounded handler threads and concurrent RPCs, the message-size
limits, no SO_REUSEPORT (so a port in use is an error, not a silently
shared port), the standard health service (`Health`: liveness and
readiness), server reflection (so `grpcurl` lists and calls the services
without .proto files), and TLS when a certificate is given. Its
interceptors: bearer tokens and their scopes
(`TokenAuth`), a bound on calls in their handlers (`Admission`), and
INVALID_ARGUMENT for bytes that do not parse (`MalformedRequests`). A
service process then runs `run_until_signalled`: until SIGTERM or Ctrl-C,
then a graceful stop that closes what the service opened, in order.

It stands below `cachesvc.server` and `cachesvc.meta` and imports neither.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cacheclient.meta import TenantEntry
from cacheclient.wire import AUTH_METADATA, ErrorKind, bearer_metadata, status_code
from cacheclient.wire.scopes import METHOD_SCOPES, PROPOSE_METHOD, PROPOSE_OP_SCOPES, Scope, propose_scope
from cachesvc.errors import MalformedRequest

__all__ = [
    "OPEN_METHOD_PREFIXES",
    "Admission",
    "Health",
    "MalformedRequests",
    "StopSignals",
    "TokenAuth",
    "bind_and_start",
    "new_server",
    "run_until_signalled",
]

log = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")
"""Methods any caller may use, token or not: health checks (probes carry no token) and reflection (the schema
is public; the data behind it is not)."""


_MAX_GUARDED = 4096
"""Guarded handlers `TokenAuth` keeps (one per tenant and method called)."""


class TokenAuth(grpc.ServerInterceptor):
    """Lets a call through only with a bearer token that grants its method's scope (`cacheclient.wire.scopes`).

    Health checks and reflection (`OPEN_METHOD_PREFIXES`) are open, and so
    is a method whose scope no token here guards. A method missing from the
    scope table is refused. A call without a token, or with one that is not
    this server's for that method's service (a client token on the Raft
    transport, the peer secret on a client RPC), gets UNAUTHENTICATED; a
    valid token without the method's scope (the data token on an admin
    RPC) gets PERMISSION_DENIED naming the scope it lacks. A Propose also
    needs the scope of each command it carries (`propose_scope`).

    A token that is none of these may be a tenant's (`tenants`): a tenant
    gets the data scope, through `guard`, which lets its calls reach its own
    keys only; a method of another scope is PERMISSION_DENIED naming the
    tenant.

    Args:
        tokens: scope -> the token that grants it. The admin token also
            grants data; without an admin token, the data token also grants
            admin. A scope no token grants is open (no tokens at all: every
            method in the table is open).
        scopes: full method name -> scope (default: the wire contract's table).
        tenants: the tenant an authorization header presents, or None
            (`cachesvc.tenancy.TenantTokens.of_header`).
        guard: (tenant, full method name, handler) -> the handler a tenant's
            call runs; None for a method no tenant may call.
    """

    def __init__(
        self,
        tokens: Mapping[Scope, str],
        scopes: Mapping[str, Scope] = METHOD_SCOPES,
        tenants: Callable[[str], TenantEntry | None] | None = None,
        guard: Callable[[TenantEntry, str, grpc.RpcMethodHandler], grpc.RpcMethodHandler | None] | None = None,
    ) -> None:
        def header(scope: Scope) -> str:
            token = tokens.get(scope, "")
            return dict(bearer_metadata(token))[AUTH_METADATA] if token else ""

        data, admin, peer = header(Scope.DATA), header(Scope.ADMIN), header(Scope.PEER)
        self._scopes = scopes
        # Scope -> (the headers that grant it, the headers a caller of its service may hold).
        self._grants: dict[Scope, tuple[tuple[str, ...], tuple[str, ...]]] = {
            Scope.PEER: ((peer,), (peer,)),
            Scope.DATA: ((data, admin), (data, admin)),
            Scope.ADMIN: ((admin,) if admin else (data,), (data, admin)),
        }
        self._open = {scope: not any(granting) for scope, (granting, _) in self._grants.items()}

        def unauthenticated(request: object, context: grpc.ServicerContext) -> None:
            context.abort(status_code(ErrorKind.AUTH), "missing or wrong bearer token")

        self._unauthenticated = grpc.unary_unary_rpc_method_handler(unauthenticated)
        self._tenants = tenants
        self._guard = guard
        # (tenant, method) -> (the handler guarded, its guarded form): built once, not on every call.
        self._guarded: dict[tuple[TenantEntry, str], tuple[Any, Any]] = {}

    def _check(self, scope: Scope, presented: str) -> str | None:
        """None when `presented` grants `scope`; else "" for an unknown token, the scope's name for one without it."""
        if self._open[scope]:
            return None
        granting, known = self._grants[scope]
        if any(h and hmac.compare_digest(presented, h) for h in granting):
            return None
        return scope.value if any(h and hmac.compare_digest(presented, h) for h in known) else ""

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        scope = self._scopes.get(method)
        if scope is None:
            return self._unauthenticated
        presented = str(dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA, ""))
        refused = self._check(scope, presented)
        if refused == "" and self._tenants is not None:
            tenant = self._tenants(presented)
            if tenant is not None:
                return self._tenant_call(tenant, scope, method, continuation, handler_call_details)
        if refused == "":
            return self._unauthenticated
        if refused is not None:
            return _denied(refused)
        handler = continuation(handler_call_details)
        if method == PROPOSE_METHOD and handler is not None and self._check(Scope.ADMIN, presented) is not None:
            return _checked_propose(handler)
        return handler

    def _tenant_call(
        self,
        tenant: TenantEntry,
        scope: Scope,
        method: str,
        continuation: Callable[..., Any],
        handler_call_details: Any,
    ) -> Any:
        name = method.rpartition("/")[2]
        if scope is not Scope.DATA or self._guard is None:
            return _refused(f"tenant {tenant.name!r} may not call {name}: a tenant's token grants data calls only")
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        known = self._guarded.get((tenant, method))
        if known is not None and known[0] is handler:
            guarded = known[1]
        else:
            guarded = self._guard(tenant, method, handler)
            if len(self._guarded) >= _MAX_GUARDED:
                self._guarded.clear()  # rotated tokens and renamed tenants leave entries behind: start again
            self._guarded[(tenant, method)] = (handler, guarded)
        if guarded is None:
            return _refused(f"tenant {tenant.name!r} may not call {name}: it reaches keys of every tenant")
        return guarded


def _refused(message: str) -> grpc.RpcMethodHandler:
    def deny(request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


def _denied(scope: str, what: str = "this call") -> grpc.RpcMethodHandler:
    def deny(request: object, context: grpc.ServicerContext) -> None:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{what} needs the {scope} scope; the token presented does not grant it (use the {scope} token)",
        )

    return grpc.unary_unary_rpc_method_handler(deny)


def _checked_propose(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` (a Propose) for a caller without the admin scope: refused when a command needs it."""
    inner = handler.unary_unary

    def propose(request: Any, context: grpc.ServicerContext) -> Any:
        if propose_scope(request) is Scope.ADMIN:
            ops = sorted(
                {
                    cmd.WhichOneof("op")
                    for cmd in request.commands
                    if PROPOSE_OP_SCOPES.get(cmd.WhichOneof("op")) is Scope.ADMIN
                }
            )
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{', '.join(ops)} needs the admin scope; the token presented does not grant it (use the admin token)",
            )
        return inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        propose, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class Admission(grpc.ServerInterceptor):
    """At most `limit` calls in their handlers at once; one more is answered RESOURCE_EXHAUSTED at once.

    Without this a call past the handler threads waits in the thread pool's
    queue, unbounded but for gRPC's cap on concurrent RPCs, behind calls that
    may wait seconds on object storage, and so does a health check. Here a
    call over the limit is refused as soon as a thread picks it up, with a
    message that names the limit and no `LIMIT_METADATA`: overloaded now, a
    retry after a backoff can succeed. The server keeps threads beyond
    `limit` (`new_server`'s `spare_threads`), so the refusals, and the
    methods exempt from the limit (health checks, reflection, Stats, Info:
    `exempt`), always find one. Give this interceptor after the ones that
    refuse calls themselves (`TokenAuth`): their refusals are not counted.

    Args:
        limit: calls in their handlers at once, over every method not exempt.
        exempt: full method names (and prefixes ending in "/") never limited
            nor counted: health, reflection and cheap status calls, and calls
            with their own limit and threads (prefetch plans).
        setting: the config key of `limit`, named in the refusal.
    """

    def __init__(self, limit: int, exempt: Collection[str] = (), setting: str = "max_inflight_calls") -> None:
        if limit <= 0:
            raise ValueError(f"{setting}: must be positive, got {limit}")
        self.limit = limit
        self._exempt = frozenset(m for m in exempt if not m.endswith("/"))
        self._exempt_prefixes = tuple(m for m in exempt if m.endswith("/"))
        self._setting = setting
        self._lock = threading.Lock()
        self._in_flight = 0
        self._refused = 0

    def counters(self) -> dict[str, int]:
        """calls_in_flight (in their handlers now, of those limited) and calls_refused_overloaded (so far)."""
        with self._lock:
            return {"calls_in_flight": self._in_flight, "calls_refused_overloaded": self._refused}

    def _enter(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            admitted = self._in_flight < self.limit
            if admitted:
                self._in_flight += 1
            else:
                self._refused += 1
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server overloaded: {self.limit} calls in flight, the limit ({self._setting}={self.limit}); "
                "retry after a backoff, or send to another replica",
            )

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method in self._exempt or method.startswith(self._exempt_prefixes):
            return handler
        return self._limited(handler)

    def _limited(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` counted while it runs (a streamed answer: until its last message), refused over the limit."""
        enter, leave = self._enter, self._leave
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        def unary(inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
            def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
                enter(context)
                try:
                    return inner(request, context)
                finally:
                    leave()

            return behaviour

        def streamed(
            inner: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
        ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
            def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                enter(context)
                try:
                    yield from inner(request, context)
                finally:
                    leave()

            return behaviour

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(streamed(handler.unary_stream), **codec)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codec)
        return grpc.stream_stream_rpc_method_handler(streamed(handler.stream_stream), **codec)


class _Unparsed:
    """A request whose bytes did not parse: why not (the parser's message names the message type)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class MalformedRequests(grpc.ServerInterceptor):
    """Answers a request whose bytes do not parse INVALID_ARGUMENT, with the parser's message.

    gRPC itself answers INTERNAL ("Exception deserializing request!"),
    which the wire contract's table reads as a bug in the server, so a
    client would report a server bug for its own bad bytes. Here the request
    parses in the handler's thread instead: a unary request that does not is
    refused before the handler runs; in a request stream, the message that
    does not raises `MalformedRequest` (kind INVALID_REQUEST) where the
    handler reads it, so the handler's own error mapping answers it (and
    this interceptor does when the handler lets it through). `new_server`
    puts this interceptor outermost.
    """

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _parsing_in_handler(handler)


def _parsing_in_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:
            return _Unparsed(str(exc) or type(exc).__name__)

    def refuse(request: Any, context: grpc.ServicerContext) -> None:
        if isinstance(request, _Unparsed):
            context.abort(status_code(ErrorKind.INVALID_REQUEST), f"malformed request: {request.why}")

    def parsed(requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            if isinstance(request, _Unparsed):
                raise MalformedRequest(f"malformed request: {request.why}")
            yield request

    def unary(inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            refuse(request, context)
            return inner(request, context)

        return behaviour

    def unary_streamed(
        inner: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            refuse(request, context)
            yield from inner(request, context)

        return behaviour

    # A handler that lets MalformedRequest through (one without an error mapping: reflection's) is answered here.
    def stream_unary(inner: Callable[[Iterator[Any], grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def behaviour(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                return inner(parsed(requests), context)
            except MalformedRequest as exc:
                context.abort(status_code(ErrorKind.INVALID_REQUEST), str(exc))

        return behaviour

    def stream_stream(inner: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
        def behaviour(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from inner(parsed(requests), context)
            except MalformedRequest as exc:
                context.abort(status_code(ErrorKind.INVALID_REQUEST), str(exc))

        return behaviour

    codec = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(unary_streamed(handler.unary_stream), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(stream_unary(handler.stream_unary), **codec)
    return grpc.stream_stream_rpc_method_handler(stream_stream(handler.stream_stream), **codec)


class Health:
    """The standard gRPC health service of one server: liveness and readiness.

    The overall status (service "") is liveness: SERVING from the start
    until the server begins to stop. Each service's own name (for example
    "cachesvc.v1.CacheService") is readiness: SERVING while the server
    should be sent traffic; `set_ready(False, why)` turns it off (a cache
    node that is draining, or not yet in the placement map), and it turns
    off when the server begins to stop. Point a liveness probe at "" and a
    readiness probe at the service's name.
    """

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()
        self._services: list[str] = []
        self._ready = True
        self._lock = threading.Lock()

    def serve(self, service_names: Sequence[str]) -> None:
        """Answers for `service_names` from now on: SERVING overall, and each as ready or not (`set_ready`)."""
        with self._lock:
            self._services = list(service_names)
            ready = self._ready
        self.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._publish(ready)

    def set_ready(self, ready: bool, why: str = "") -> None:
        """Readiness of every service; a change is logged with `why`."""
        with self._lock:
            changed, self._ready = ready != self._ready, ready
        if changed:
            log.info("ready: %s", "yes" if ready else f"no ({why})" if why else "no")
        self._publish(ready)

    @property
    def ready(self) -> bool:
        return self._ready

    def stopping(self) -> None:
        """Every status NOT_SERVING, for good: the server is about to stop."""
        self.servicer.enter_graceful_shutdown()

    def _publish(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._lock:
            services = list(self._services)
        for name in services:
            self.servicer.set(name, status)


def new_server(
    workers: int,
    max_message_bytes: int,
    *,
    thread_name_prefix: str,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    long_lived_rpcs: int = 0,
    spare_threads: int = 0,
) -> grpc.Server:
    """A server with `workers` handler threads (and 8x that many RPCs at most in flight).

    A request that does not parse is answered INVALID_ARGUMENT (`MalformedRequests`, outermost).

    Args:
        long_lived_rpcs: how many RPCs that last as long as their caller
            wants (prefetch plans) may be open at once. A handler holds its
            thread for its whole RPC, so the server gets one more thread (and
            one more RPC in flight) for each; the service must refuse more
            than this many, and then `workers` threads always remain for
            every other call.
        spare_threads: threads beyond these, kept free by an `Admission`
            that admits at most `workers` calls: for health checks, status
            calls and quick refusals while every worker is busy.
    """
    return grpc.server(
        ThreadPoolExecutor(
            max_workers=workers + long_lived_rpcs + spare_threads, thread_name_prefix=thread_name_prefix
        ),
        interceptors=[MalformedRequests(), *interceptors],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=workers * 8 + long_lived_rpcs,
    )


def bind_and_start(
    server: grpc.Server,
    address: str,
    *,
    service_names: Sequence[str],
    tls_cert: str = "",
    tls_key: str = "",
    health_service: Health | None = None,
) -> int:
    """Adds the health and reflection services, binds `address` (TLS with a certificate), starts; returns the port.

    Args:
        service_names: the services the server registered (their health
            status is their readiness; reflection describes them).
        health_service: the `Health` to answer checks with (one of its own when None).

    Raises:
        OSError: `address` cannot be bound (the message names it).
    """
    health_service = health_service if health_service is not None else Health()
    health_pb2_grpc.add_HealthServicer_to_server(health_service.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        if tls_cert:
            credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: address in use or not available")
    server.start()
    health_service.serve(service_names)
    return port


class StopSignals:
    """SIGTERM and SIGINT, caught from the moment this is made until `restore`.

    Make it before a server starts listening: a supervisor that sees the port
    open may send SIGTERM at once, and a signal that arrives before the
    handlers are in place would kill the process without a clean stop.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous = {sig: signal.signal(sig, self._caught) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _caught(self, signum: int, frame: object) -> None:
        self.event.set()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_until_signalled(
    server: grpc.Server,
    *,
    grace: float,
    signals: StopSignals | None = None,
    ready: Callable[[], object] | None = None,
    check: Callable[[], object] | None = None,
    before_stop: Sequence[Callable[[], object]] = (),
    close: Sequence[Callable[[], object]] = (),
) -> None:
    """Serves until SIGTERM or SIGINT, then shuts down gracefully. Call it from the main thread.

    On a signal: each `before_stop` step runs in order while RPCs are still
    served (leave a membership, hand leadership over); then the server takes
    no new calls and gives those in flight `grace` seconds; then each `close`
    step runs in order (an engine after the server that calls into it). A
    step that raises is logged and the next one still runs.

    Args:
        server: a started server.
        grace: seconds in-flight RPCs get to finish.
        signals: the handlers the caller installed before starting the server
            (made here when None).
        ready: called once the signal handlers are in place.
        check: called about every half second while serving; when it raises,
            the server stops at once (no grace, no `before_stop`), the `close`
            steps run, and the exception propagates.
        before_stop: steps before the server stops, in order.
        close: steps after the server stopped, in order.
    """
    signals = signals if signals is not None else StopSignals()
    stop = signals.event
    stopped = False
    try:
        if ready is not None:
            ready()
        # Wake up now and then: a signal handler only runs between bytecodes of
        # the main thread, never inside an untimed wait.
        while not stop.wait(0.5):
            if check is not None:
                check()
        log.info("shutting down")
        _run_steps(before_stop)
        server.stop(grace).wait()
        stopped = True
    finally:
        if not stopped:
            server.stop(0).wait()
        _run_steps(close)
        signals.restore()
    log.info("stopped")


def _run_steps(steps: Sequence[Callable[[], object]]) -> None:
    for step in steps:
        try:
            step()
        except Exception:
            log.exception("shutdown step %s failed", getattr(step, "__qualname__", step))
