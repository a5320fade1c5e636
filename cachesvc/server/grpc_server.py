"""Building, binding, starting and running a gRPC server the same way for every cachesvc service.

Bounded handler threads and concurrent RPCs, the message-size limits, no
SO_REUSEPORT (so a port in use is an error, not a silently shared port), the
standard health service, and TLS when a certificate is given. A service
process then runs `run_until_signalled`: until SIGTERM or Ctrl-C, then a
graceful stop that closes what the service opened, in order.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["bind_and_start", "new_server", "run_until_signalled"]

log = logging.getLogger(__name__)


def new_server(
    workers: int,
    max_message_bytes: int,
    *,
    thread_name_prefix: str,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    long_lived_rpcs: int = 0,
) -> grpc.Server:
    """A server with `workers` handler threads (and 8x that many RPCs at most in flight).

    Args:
        long_lived_rpcs: how many RPCs that last as long as their caller
            wants (prefetch plans) may be open at once. A handler holds its
            thread for its whole RPC, so the server gets one more thread (and
            one more RPC in flight) for each; the service must refuse more
            than this many, and then `workers` threads always remain for
            every other call.
    """
    return grpc.server(
        ThreadPoolExecutor(max_workers=workers + long_lived_rpcs, thread_name_prefix=thread_name_prefix),
        interceptors=list(interceptors),
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
) -> int:
    """Adds the health service, binds `address` (TLS when a certificate is given), starts; returns the port.

    Raises:
        OSError: `address` cannot be bound (the message names it).
    """
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
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
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return port


def run_until_signalled(
    server: grpc.Server,
    *,
    grace: float,
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
        ready: called once the signal handlers are in place.
        check: called about every half second while serving; when it raises,
            the server stops at once (no grace, no `before_stop`), the `close`
            steps run, and the exception propagates.
        before_stop: steps before the server stops, in order.
        close: steps after the server stopped, in order.
    """
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")


def _run_steps(steps: Sequence[Callable[[], object]]) -> None:
    for step in steps:
        try:
            step()
        except Exception:
            log.exception("shutdown step %s failed", getattr(step, "__qualname__", step))
