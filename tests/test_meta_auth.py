"""The metadata shard, authenticated and bounded: three `cachesvc meta` processes with a client token and a peer secret.

Every method of both services (read from the service descriptors, so a new
RPC is covered without touching this file) is refused without a token and
with a wrong one, and accepted with its own; a client token cannot reach
the Raft transport; health and reflection stay open; a proposal or Raft
batch over its configured size is refused with RESOURCE_EXHAUSTED naming
the limit, and the node keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from cacheclient import CacheClient
from cacheclient.errors import AuthError, LimitExceededError
from cacheclient.wire import LIMIT_METADATA, bearer_metadata
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire import meta_pb2_grpc as pb_grpc
from cachesvc.config import ConfigError, load_meta_node_config
from cachesvc.meta.local import LocalShard
from cachesvc.meta.raft.messages import MessageType

from conftest import wait_until

pytestmark = pytest.mark.timeout(60)

TOKEN = "client-token-for-tests"
PEER_TOKEN = "peer-secret-for-tests"
MAX_PROPOSAL = 1 << 20
MAX_RAFT_BATCH = 2 << 20
META_SERVICE = pb.DESCRIPTOR.services_by_name["MetaService"]
RAFT_SERVICE = pb.DESCRIPTOR.services_by_name["RaftTransport"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalShard]:
    s = LocalShard(
        3,
        tmp_path_factory.mktemp("shard"),
        token=TOKEN,
        peer_token=PEER_TOKEN,
        args=["--max-proposal-bytes", str(MAX_PROPOSAL), "--max-raft-message-bytes", str(MAX_RAFT_BATCH)],
    )
    try:
        s.start()
        # A leader is elected and committed only if the peers accept each other's secret.
        s.leader(timeout=15.0)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def channel(shard: LocalShard) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(shard.addresses[0]) as ch:
        yield ch


def _call(
    channel: grpc.Channel, service: str, method: str, request: bytes, metadata: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    """The status of one raw unary call (raw bytes: no method's request type is assumed)."""
    call = channel.unary_unary(f"/{service}/{method}", request_serializer=None, response_deserializer=None)
    try:
        call(request, timeout=5.0, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _methods(service: object) -> list[str]:
    names = [m.name for m in service.methods]  # type: ignore[attr-defined]
    assert names, "a service without methods: the descriptor was not read"
    return names


NO_TOKEN: tuple[tuple[str, str], ...] = ()
WRONG = bearer_metadata("not-the-token")


@pytest.mark.parametrize("method", _methods(META_SERVICE))
def test_every_meta_rpc_needs_the_client_token(channel: grpc.Channel, method: str) -> None:
    service = META_SERVICE.full_name
    for metadata in (NO_TOKEN, WRONG, bearer_metadata(PEER_TOKEN)):
        assert _call(channel, service, method, b"", metadata) is grpc.StatusCode.UNAUTHENTICATED, metadata
    # An empty request is valid for every method; what matters is that auth let it through.
    assert _call(channel, service, method, b"", bearer_metadata(TOKEN)) is not grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("method", _methods(RAFT_SERVICE))
def test_every_raft_rpc_needs_the_peer_secret(channel: grpc.Channel, method: str) -> None:
    service = RAFT_SERVICE.full_name
    # The client token above all: a client must not be able to append entries.
    for metadata in (NO_TOKEN, WRONG, bearer_metadata(TOKEN)):
        assert _call(channel, service, method, b"", metadata) is grpc.StatusCode.UNAUTHENTICATED, metadata
    assert _call(channel, service, method, b"", bearer_metadata(PEER_TOKEN)) is grpc.StatusCode.OK


def test_a_forged_append_with_the_client_token_changes_nothing(shard: LocalShard, channel: grpc.Channel) -> None:
    client = shard.client()
    before = client.status(shard.addresses[0])
    forged = pb.RaftBatch(
        messages=[
            pb.RaftMessage(
                type=MessageType.APPEND, src=2, dst=1, term=before["term"] + 100, entries=[pb.RaftEntry(data=b"x")]
            )
        ]
    )
    status = _call(channel, RAFT_SERVICE.full_name, "Send", forged.SerializeToString(), bearer_metadata(TOKEN))
    assert status is grpc.StatusCode.UNAUTHENTICATED
    assert client.status(shard.addresses[0])["term"] == before["term"]


def test_meta_client_with_and_without_token(shard: LocalShard) -> None:
    with shard.client(token=None, timeout=2.0) as anonymous, pytest.raises(AuthError):
        anonymous.list_manifests()
    with shard.client(token="wrong", timeout=2.0) as wrong, pytest.raises(AuthError):
        wrong.put_manifest("auth/denied", s3_prefix="p")
    with shard.client() as client:
        client.put_manifest("auth/ok", s3_prefix="p")
        assert "auth/ok" in client.list_manifests()
        assert "auth/denied" not in client.list_manifests()


def test_health_and_reflection_need_no_token(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", META_SERVICE.full_name, RAFT_SERVICE.full_name):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    reflection = "grpc.reflection.v1alpha.ServerReflection"
    stream = channel.stream_stream(f"/{reflection}/ServerReflectionInfo")
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = list(stream(iter([request.SerializeToString()]), timeout=5.0))
    names = [s.name for s in reflection_pb2.ServerReflectionResponse.FromString(answer).list_services_response.service]
    assert META_SERVICE.full_name in names


def test_an_oversized_proposal_is_refused_and_the_node_keeps_serving(shard: LocalShard) -> None:
    with shard.client(timeout=5.0) as client:
        with pytest.raises(LimitExceededError, match="max_proposal_bytes") as refused:
            client.put_manifest("big", s3_prefix="x" * (MAX_PROPOSAL + 1))
        assert str(MAX_PROPOSAL) in str(refused.value)
        client.put_manifest("small-after-big", s3_prefix="p")
        assert client.get_manifest("small-after-big") is not None
        assert "big" not in client.list_manifests()
    for i, address in shard.address.items():
        assert shard.procs[i].alive(), f"meta node {i} exited"
        assert client.status(address)["id"] == i


def test_an_oversized_raft_batch_is_refused(shard: LocalShard, channel: grpc.Channel) -> None:
    batch = pb.RaftBatch(
        messages=[pb.RaftMessage(type=MessageType.APPEND, entries=[pb.RaftEntry(data=b"\0" * (MAX_RAFT_BATCH + 1))])]
    )
    call = channel.unary_unary(f"/{RAFT_SERVICE.full_name}/Send")
    with pytest.raises(grpc.RpcError) as refused:
        call(batch.SerializeToString(), timeout=5.0, metadata=bearer_metadata(PEER_TOKEN))
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_raft_message_bytes" in (refused.value.details() or "")
    assert dict(refused.value.trailing_metadata() or ())[LIMIT_METADATA] == "max_raft_message_bytes"
    assert shard.client().status(shard.addresses[0])["id"] == 1


def test_a_client_token_needs_a_distinct_peer_secret(tmp_path: Path) -> None:
    base = {
        "CACHESVC_META_NODE_ID": "1",
        "CACHESVC_META_NODE_PEERS": "1=127.0.0.1:1",
        "CACHESVC_META_NODE_DATA_DIR": str(tmp_path),
    }
    with pytest.raises(ConfigError, match="peer_token: required"):
        load_meta_node_config(env={**base, "CACHESVC_META_NODE_SECURITY_TOKEN": "t"})
    with pytest.raises(ConfigError, match="must differ"):
        load_meta_node_config(
            env={**base, "CACHESVC_META_NODE_SECURITY_TOKEN": "t", "CACHESVC_META_NODE_SECURITY_PEER_TOKEN": "t"}
        )
    cfg = load_meta_node_config(
        env={**base, "CACHESVC_META_NODE_SECURITY_TOKEN": "t", "CACHESVC_META_NODE_SECURITY_PEER_TOKEN": "p"}
    )
    assert cfg.redacted()["security"] == {"token": "***", "tls_cert": "", "tls_key": "", "peer_token": "***"}
    node = cfg.node_config()
    assert node.peer_token == "p"
    assert "peer_token" not in repr(node)


def test_a_full_log_is_compacted_and_what_cannot_fit_is_refused_without_killing_a_node(tmp_path: Path) -> None:
    shard = LocalShard(3, tmp_path, args=["--log-map-bytes", "4MiB", "--max-proposal-bytes", "3MiB"])
    try:
        shard.start()
        shard.leader(timeout=15.0)
        value = "v" * (600 << 10)
        with shard.client(timeout=10.0) as client:
            # 30 x 600 KiB through a 4 MiB log: only compaction of applied entries makes room.
            for i in range(30):
                client.put_manifest("big", s3_prefix=f"{i}{value}")
            assert client.get_manifest("big").s3_prefix.startswith("29")  # type: ignore[union-attr]
            # An entry the log cannot hold even once compacted is refused, naming the setting.
            leader_id, _ = shard.leader()
            huge = pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest(name="huge", s3_prefix="h" * (5 << 19))))
            with grpc.insecure_channel(shard.address[leader_id]) as ch, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.MetaServiceStub(ch).Propose(pb.ProposeRequest(commands=[huge]), timeout=5.0)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "raft log full" in (refused.value.details() or "")
            assert "log_map_bytes" in (refused.value.details() or "")
            client.put_manifest("small-after-full", s3_prefix="p")
            assert client.get_manifest("huge") is None
        for i in shard.ids:
            assert shard.procs[i].alive(), f"meta node {i} exited:\n{shard.procs[i].tail()}"
    finally:
        shard.stop()


def test_cache_servers_and_routing_clients_present_the_token_to_the_shard(shard: LocalShard, cache_server: Any) -> None:
    server = cache_server(
        "--meta", ",".join(shard.addresses), "--l1-bytes", "1MiB", env={"CACHESVC_SECURITY_TOKEN": TOKEN}
    )
    with shard.client() as client:
        wait_until(lambda: server.address in client.placement(refresh=True).nodes, 15.0, "the cache server to register")
    with CacheClient(meta=shard.addresses, token=TOKEN, timeout=10.0) as routed:
        routed.put("auth/key", b"value")
        assert routed.get("auth/key") == b"value"
