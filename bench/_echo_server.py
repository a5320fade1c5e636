"""The floor of our stack for `bench/tiers.py`: a bare gRPC server that returns stored bytes.

One process, one generic service `bench.Echo` with two unary methods:

* `Raw`: the request is a payload name (ASCII); the response is the stored
  payload itself, with identity (de)serializers: gRPC and nothing else.
* `Proto`: the request is a `cachesvc.v1.GetRequest` whose key names a
  payload; the response is a `cachesvc.v1.GetResponse` built per call the way
  the cache's servicer builds it (value, size, precomputed checksum, tier).
  This adds protobuf encoding to the floor and no cache logic.

The server is built with the cache server's options: the same thread-pool
size, malloc thresholds, message-size limits, `so_reuseport` and concurrent-RPC cap.

Usage: python bench/_echo_server.py --listen 127.0.0.1:PORT --payload-dir DIR [--workers 16]
Every file in DIR is a payload, named by its file name. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import xxhash

from cacheclient import tune_malloc
from cacheclient.wire import MAX_MESSAGE_BYTES
from cacheclient.wire import cache_pb2 as pb

SERVICE = "bench.Echo"


def _identity(data: bytes) -> bytes:
    return data


def build_server(listen: str, payloads: dict[bytes, bytes], workers: int) -> tuple[grpc.Server, int]:
    """A started echo server on `listen` and its port."""
    checksums = {name: xxhash.xxh3_64_intdigest(value) for name, value in payloads.items()}

    def raw(request: bytes, context: grpc.ServicerContext) -> bytes:
        return payloads[request]

    def proto(request: Any, context: grpc.ServicerContext) -> Any:
        value = payloads[request.key]
        return pb.GetResponse(
            found=True, value=value, size=len(value), checksum=checksums[request.key], tier=pb.TIER_L1
        )

    handlers = {
        "Raw": grpc.unary_unary_rpc_method_handler(raw, request_deserializer=_identity, response_serializer=_identity),
        "Proto": grpc.unary_unary_rpc_method_handler(
            proto, request_deserializer=pb.GetRequest.FromString, response_serializer=pb.GetResponse.SerializeToString
        ),
    }
    server = grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=workers * 8,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--payload-dir", required=True, type=Path)
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    tune_malloc()  # as `cachesvc serve` does, so the floor runs on the same allocator settings
    payloads = {p.name.encode(): p.read_bytes() for p in sorted(args.payload_dir.iterdir()) if p.is_file()}
    server, _ = build_server(args.listen, payloads, args.workers)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    server.stop(1.0).wait()


if __name__ == "__main__":
    main()
