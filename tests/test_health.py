"""Health and discovery as probes and tools see them: readiness that follows draining, reflection without a token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cachesvc.devcluster.shard import LocalShard

from conftest import wait_until

CACHE_SERVICE = "cachesvc.v1.CacheService"


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        status: int = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
        return status


def test_reflection_lists_and_describes_the_services_without_a_token(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "1MiB", env={"CACHESVC_SECURITY_TOKEN": "s3cret"})
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {CACHE_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        # What grpcurl does next: the service's methods and message types, from the server alone.
        pool = DescriptorPool(database)
        service = pool.FindServiceByName(CACHE_SERVICE)
        assert {"Get", "GetMany", "Put", "Stats", "Info"} <= {m.name for m in service.methods}
        assert [f.name for f in service.methods_by_name["Get"].input_type.fields][:1] == ["key"]
        # The data itself still needs the token.
        stats = channel.unary_unary(f"/{CACHE_SERVICE}/Stats")
        try:
            stats(b"", timeout=5)
            raise AssertionError("Stats without a token was served")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAUTHENTICATED


def test_readiness_is_off_while_a_node_drains(cache_server: Any, tmp_path: Path) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with LocalShard(1, tmp_path / "meta") as shard:
        shard.start()
        meta = shard.addresses[0]
        server = cache_server("--l1-bytes", "1MiB", "--meta", meta)
        wait_until(lambda: health_of(server.address, CACHE_SERVICE) == serving, 30, "the node to be ready")
        assert health_of(meta, "cachesvc.v1.MetaService") == serving

        cachectl = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", meta, "drain", server.address]
        assert subprocess.run(cachectl, capture_output=True, timeout=60).returncode == 0
        wait_until(lambda: health_of(server.address, CACHE_SERVICE) == not_serving, 10, "readiness to turn off")
        assert health_of(server.address) == serving  # alive all the same: a liveness probe must not restart it
        assert "ready: no (not in the placement map" in server.log()

        assert subprocess.run([*cachectl, "--cancel"], capture_output=True, timeout=60).returncode == 0
        wait_until(lambda: health_of(server.address, CACHE_SERVICE) == serving, 10, "readiness to come back")
