"""Building, binding and starting a gRPC server the same way for every cachesvc service.

Bounded handler threads and concurrent RPCs, the message-size limits, no
SO_REUSEPORT (so a port in use is an error, not a silently shared port), the
standard health service, and TLS when a certificate is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["bind_and_start", "new_server"]


def new_server(
    workers: int,
    max_message_bytes: int,
    *,
    thread_name_prefix: str,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> grpc.Server:
    """A server with `workers` handler threads (and 8x that many RPCs at most in flight)."""
    return grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix),
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=workers * 8,
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
