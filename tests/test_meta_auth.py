"""The metadata shard and a cache server, authenticated and bounded, with data and admin tokens and a peer secret.

Every method of the metadata node's two services and of the cache service
(read from the service descriptors, so a new RPC is covered without
touching this file) is refused without a token and with a wrong one, and
accepted or refused by its scope in the one table (`cacheclient.wire.scopes`,
itself checked against the descriptors): the admin token passes every
client RPC, the data token only the data ones (PERMISSION_DENIED naming the
scope otherwise); a Propose carrying a membership change needs the admin
token; a client token cannot reach the Raft transport; health and
reflection stay open; a proposal or Raft batch over its configured size is
refused with RESOURCE_EXHAUSTED naming the limit, and the node keeps
serving. `cachectl` picks CACHECTL_ADMIN_TOKEN for its admin commands and
says which scope a refusal lacks.
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
from cacheclient.wire import LIMIT_METADATA, bearer_metadata, cache_pb2
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire import meta_pb2_grpc as pb_grpc
from cacheclient.wire.scopes import METHOD_SCOPES, Scope
from cachesvc.commands import cachectl, common
from cachesvc.config import ConfigError, load_config, load_meta_node_config
from cachesvc.devcluster.shard import LocalShard
from cachesvc.meta.raft.messages import MessageType

from conftest import CacheServer, wait_until

pytestmark = pytest.mark.timeout(60)

TOKEN = "client-token-for-tests"
ADMIN_TOKEN = "admin-token-for-tests"
PEER_TOKEN = "peer-secret-for-tests"
MAX_PROPOSAL = 1 << 20
MAX_RAFT_BATCH = 2 << 20
META_SERVICE = pb.DESCRIPTOR.services_by_name["MetaService"]
RAFT_SERVICE = pb.DESCRIPTOR.services_by_name["RaftTransport"]
CACHE_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalShard]:
    s = LocalShard(
        3,
        tmp_path_factory.mktemp("shard"),
        token=TOKEN,
        admin_token=ADMIN_TOKEN,
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


@pytest.fixture(scope="module")
def cache_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    """A cache server (no shard, no S3) with a data token and an admin token."""
    server = CacheServer(
        ["--l1-bytes", "4MiB"],
        tmp_path_factory.mktemp("cache-logs"),
        env={"CACHESVC_SECURITY_TOKEN": TOKEN, "CACHESVC_SECURITY_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    try:
        yield server.start()
    finally:
        if server.process is not None and server.process.alive():
            server.stop(grace=5.0)


def _call_status(
    channel: grpc.Channel, service: str, method: str, request: bytes, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, str]:
    """The status and details of one raw call, of the method's own kind (raw bytes: no request type assumed)."""
    full = f"/{service}/{method}"
    descriptor = next(
        s.methods_by_name[method] for s in (META_SERVICE, RAFT_SERVICE, CACHE_SERVICE) if s.full_name == service
    )
    try:
        if descriptor.client_streaming and descriptor.server_streaming:
            list(channel.stream_stream(full)(iter([request]), timeout=5.0, metadata=metadata))
        elif descriptor.client_streaming:
            channel.stream_unary(full)(iter([request]), timeout=5.0, metadata=metadata)
        elif descriptor.server_streaming:
            list(channel.unary_stream(full)(request, timeout=5.0, metadata=metadata))
        else:
            channel.unary_unary(full)(request, timeout=5.0, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _call(
    channel: grpc.Channel, service: str, method: str, request: bytes, metadata: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    return _call_status(channel, service, method, request, metadata)[0]


def _methods(service: object) -> list[str]:
    names = [m.name for m in service.methods]  # type: ignore[attr-defined]
    assert names, "a service without methods: the descriptor was not read"
    return names


NO_TOKEN: tuple[tuple[str, str], ...] = ()
WRONG = bearer_metadata("not-the-token")


REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_the_scope_table_names_every_rpc_of_every_service_and_nothing_else() -> None:
    described = {f"/{s.full_name}/{m.name}" for s in (CACHE_SERVICE, META_SERVICE, RAFT_SERVICE) for m in s.methods}
    assert set(METHOD_SCOPES) == described
    assert {METHOD_SCOPES[f"/{RAFT_SERVICE.full_name}/{m}"] for m in _methods(RAFT_SERVICE)} == {Scope.PEER}
    assert Scope.PEER not in {
        METHOD_SCOPES[f"/{s.full_name}/{m.name}"] for s in (CACHE_SERVICE, META_SERVICE) for m in s.methods
    }


def _check_scope(channel: grpc.Channel, service: Any, method: str, foreign: tuple[tuple[str, str], ...]) -> None:
    """Refused without a token, with a wrong or `foreign` one; then by the method's scope in the table."""
    name = service.full_name
    for metadata in (NO_TOKEN, WRONG, foreign):
        assert _call(channel, name, method, b"", metadata) is grpc.StatusCode.UNAUTHENTICATED, metadata
    # An empty request is valid for (or refused by the servicer of) every method; what matters is what auth did.
    assert _call(channel, name, method, b"", bearer_metadata(ADMIN_TOKEN)) not in REFUSED
    code, details = _call_status(channel, name, method, b"", bearer_metadata(TOKEN))
    if METHOD_SCOPES[f"/{name}/{method}"] is Scope.ADMIN:
        assert code is grpc.StatusCode.PERMISSION_DENIED
        assert "admin scope" in details
    else:
        assert code not in REFUSED, details


@pytest.mark.parametrize("method", _methods(META_SERVICE))
def test_every_meta_rpc_needs_a_token_of_its_scope(channel: grpc.Channel, method: str) -> None:
    _check_scope(channel, META_SERVICE, method, bearer_metadata(PEER_TOKEN))


@pytest.mark.parametrize("method", _methods(CACHE_SERVICE))
def test_every_cache_rpc_needs_a_token_of_its_scope(cache_node: CacheServer, method: str) -> None:
    with grpc.insecure_channel(cache_node.address) as ch:
        _check_scope(ch, CACHE_SERVICE, method, bearer_metadata(PEER_TOKEN))


def test_a_membership_change_needs_the_admin_token_and_a_manifest_does_not(shard: LocalShard) -> None:
    with shard.client(token=TOKEN, timeout=5.0) as data:
        data.put_manifest("scoped/data", s3_prefix="p")
        assert data.get_manifest("scoped/data") is not None
        assert data.placement(refresh=True) is not None
        for change in (
            lambda: data.register_node("127.0.0.1:1", 1 << 20),
            lambda: data.set_node_state("127.0.0.1:1", "draining"),
            lambda: data.remove_node("127.0.0.1:1"),
        ):
            with pytest.raises(AuthError, match="PERMISSION_DENIED.*needs the admin scope") as refused:
                change()
            assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        # A batch with one membership change among manifests is refused whole.
        batch = pb.ProposeRequest(
            commands=[
                pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest(name="scoped/mixed", s3_prefix="p"))),
                pb.Command(remove_node=pb.RemoveNode(address="127.0.0.1:1")),
            ]
        )
        leader_id, _ = shard.leader()
        with grpc.insecure_channel(shard.address[leader_id]) as ch, pytest.raises(grpc.RpcError) as mixed:
            pb_grpc.MetaServiceStub(ch).Propose(batch, timeout=5.0, metadata=bearer_metadata(TOKEN))
        assert mixed.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "remove_node needs the admin scope" in (mixed.value.details() or "")
        assert data.get_manifest("scoped/mixed") is None
    with shard.client(token=ADMIN_TOKEN, timeout=5.0) as admin:
        admin.register_node("127.0.0.1:1", 1 << 20)
        admin.remove_node("127.0.0.1:1")
        admin.put_manifest("scoped/admin", s3_prefix="p")


def test_cachectl_uses_the_admin_token_for_admin_commands_and_names_the_missing_scope(
    shard: LocalShard, cache_node: CacheServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("CACHECTL_CACHE", "CACHECTL_META", "CACHECTL_TLS_CA", "CACHECTL_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CACHECTL_TOKEN", TOKEN)
    meta = ("--meta", ",".join(shard.addresses))
    cache = ("--cache", cache_node.address, "--timeout", "5")
    assert cachectl.main([*cache, "put", "scoped", "--value", "v"]) == 0
    capsys.readouterr()
    for argv in ([*meta, "drain", "127.0.0.1:1"], [*cache, "evict", "scoped"], [*cache, "stats"]):
        assert cachectl.main(argv) == cachectl.EXIT_AUTH, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs the admin scope" in err and "CACHECTL_ADMIN_TOKEN" in err, err
    monkeypatch.setenv("CACHECTL_ADMIN_TOKEN", ADMIN_TOKEN)
    assert cachectl.main([*meta, "drain", "127.0.0.1:1"]) == cachectl.EXIT_MISSING  # past auth: no such node
    assert cachectl.main([*cache, "evict", "scoped"]) == 0
    assert cachectl.main([*cache, "stats", "--json"]) == 0
    # Data commands keep the data token.
    assert common.token(cachectl.build_parser().parse_args([*cache, "get", "scoped"])) == TOKEN


def test_the_admin_token_needs_a_data_token_and_differs_from_it() -> None:
    with pytest.raises(ConfigError, match="admin_token: requires security.token"):
        load_config(env={"CACHESVC_SECURITY_ADMIN_TOKEN": "a"})
    with pytest.raises(ConfigError, match="admin_token: must differ"):
        load_config(env={"CACHESVC_SECURITY_TOKEN": "a", "CACHESVC_SECURITY_ADMIN_TOKEN": "a"})
    cfg = load_config(env={"CACHESVC_SECURITY_TOKEN": "t", "CACHESVC_SECURITY_ADMIN_TOKEN": "a"})
    assert cfg.redacted()["security"]["admin_token"] == "***"


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
    assert cfg.redacted()["security"] == {
        "token": "***",
        "admin_token": "",
        "tls_cert": "",
        "tls_key": "",
        "peer_token": "***",
        "tls_ca": "",
    }
    with pytest.raises(ConfigError, match="peer_token: must differ"):
        load_meta_node_config(
            env={
                **base,
                "CACHESVC_META_NODE_SECURITY_TOKEN": "t",
                "CACHESVC_META_NODE_SECURITY_ADMIN_TOKEN": "a",
                "CACHESVC_META_NODE_SECURITY_PEER_TOKEN": "a",
            }
        )
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
    # Registering and heartbeating are admin calls: the server presents its admin token to the shard.
    server = cache_server(
        "--meta",
        ",".join(shard.addresses),
        "--l1-bytes",
        "1MiB",
        env={"CACHESVC_SECURITY_TOKEN": TOKEN, "CACHESVC_SECURITY_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    with shard.client() as client:
        wait_until(lambda: server.address in client.placement(refresh=True).nodes, 15.0, "the cache server to register")
    with CacheClient(meta=shard.addresses, token=TOKEN, timeout=10.0) as routed:
        routed.put("auth/key", b"value")
        assert routed.get("auth/key") == b"value"
