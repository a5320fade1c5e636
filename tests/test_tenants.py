"""Namespaces kept in the metadata shard, and tenants: their tokens, key isolation, quotas and priorities.

The state machine's table alone first (deterministic, snapshots), then real
processes: a shard of metadata nodes, cache servers, SeaweedFS, `cachectl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cacheclient import AuthError, CacheClient, CacheClientError, NodeClient
from cacheclient.colocated import Colocated, SharedL1
from cacheclient.meta import ManifestItem, MetaClient, NamespaceEntry
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.scopes import token_sha256
from cachesvc.devcluster.procs import free_port, free_port_run
from cachesvc.devcluster.shard import LocalShard
from cachesvc.meta.state import MetaState, encode_batch
from tests.conftest import CacheServer, Cluster, S3Server, running_cluster, wait_until

HEARTBEAT = 0.3


def _apply(state: MetaState, index: int, *commands: pb.Command) -> list[pb.CommandResult]:
    return state.apply(index, encode_batch(1000 * index, commands))


def _put_ns(prefix: str, replace: bool = False, **fields: Any) -> pb.Command:
    fields = {"write_mode": "write-through", "replicas": 1, **fields}
    ns = pb.Namespace(prefix=prefix, **fields)
    return pb.Command(put_namespace=pb.PutNamespace(namespace=ns, replace=replace))


def _put_tenant(name: str, *prefixes: str, replace: bool = False, token: str = "t") -> pb.Command:
    tenant = pb.Tenant(name=name, prefixes=prefixes, priority="normal", token_sha256=token_sha256(token))
    return pb.Command(put_tenant=pb.PutTenant(tenant=tenant, replace=replace))


# ---------------------------------------------------------------- the state machine


def test_the_table_is_versioned_by_its_last_change_and_survives_a_snapshot() -> None:
    state = MetaState()
    assert state.namespaces_version == 0
    (r,) = _apply(state, 1, _put_ns("ckpt/", write_mode="write-back", replicas=2))
    assert r.ok and state.namespaces_version == 1
    _apply(state, 2, pb.Command(register_node=pb.RegisterNode(address="a:1", capacity_bytes=1)))
    assert state.namespaces_version == 1, "a membership change is not a table change"
    (r,) = _apply(state, 3, _put_tenant("team-a", "a/"))
    assert r.ok and state.namespaces_version == 3
    assert set(state.namespaces) == {"ckpt/", "a/"}, "a tenant's prefixes are namespaces"
    again = MetaState()
    again.restore(state.snapshot())
    assert again.snapshot() == state.snapshot()
    assert again.namespaces_version == 3 and again.tenants["team-a"].prefixes == ["a/"]


def test_bad_or_conflicting_changes_are_refused_and_change_nothing() -> None:
    state = MetaState()
    _apply(state, 1, _put_ns("x/"), _put_tenant("a", "a/"))
    refused = _apply(
        state,
        2,
        _put_ns("x/"),  # taken
        _put_ns("y/", replace=True),  # no such namespace
        _put_ns("z/", write_mode="sometimes"),
        _put_tenant("b", "a/sub/"),  # overlaps a's prefix
        pb.Command(delete_namespace=pb.DeleteNamespace(prefix="a/")),  # a tenant owns it
        pb.Command(delete_tenant=pb.DeleteTenant(name="nobody")),
    )
    errors = [r.error for r in refused]
    assert not any(r.ok for r in refused), errors
    assert "exists" in errors[0] and "no namespace" in errors[1] and "write mode" in errors[2]
    assert "overlaps 'a/' of tenant 'a'" in errors[3]
    assert "belongs to tenant 'a'" in errors[4]
    assert state.namespaces_version == 1
    refused_tenant = pb.Command(put_tenant=pb.PutTenant(tenant=pb.Tenant(name="c", prefixes=["c/"], priority="normal")))
    (r,) = _apply(state, 3, refused_tenant)
    assert not r.ok and "token" in r.error


def test_setting_a_tenant_without_a_token_keeps_its_token() -> None:
    state = MetaState()
    _apply(state, 1, _put_tenant("a", "a/", token="secret"))
    keep = pb.Command(
        put_tenant=pb.PutTenant(tenant=pb.Tenant(name="a", prefixes=["a/"], priority="high"), replace=True)
    )
    (r,) = _apply(state, 2, keep)
    assert r.ok and state.tenants["a"].priority == "high"
    assert state.tenants["a"].token_sha256 == token_sha256("secret")


# ---------------------------------------------------------------- real processes


def _cachectl(shard: LocalShard, *args: str, admin: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CACHECTL_META": ",".join(shard.addresses)}
    env.pop("CACHECTL_TOKEN", None)
    env.pop("CACHECTL_ADMIN_TOKEN", None)
    if admin:
        env["CACHECTL_ADMIN_TOKEN"] = admin
    done = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", *args], capture_output=True, text=True, env=env, timeout=60
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _info_namespaces(server: CacheServer) -> dict[str, tuple[str, int]]:
    with NodeClient(server.address, timeout=5.0) as client:
        return {ns["prefix"].decode(): (ns["write_mode"], ns["replicas"]) for ns in client.info()["namespaces"]}


FILE_CONFIG = """
[[namespaces]]
prefix = "rep/"
replicas = 1
"""


@pytest.fixture(scope="module")
def cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("tenants")
    with running_cluster(s3, base, FILE_CONFIG, [("8MiB", "16MiB")] * 3, heartbeat_seconds=HEARTBEAT) as c:
        yield c


def test_a_namespace_added_with_cachectl_reaches_every_node_within_a_heartbeat(cluster: Cluster) -> None:
    shown = json.loads(_cachectl(cluster.shard, "namespace", "ls", "--json").stdout)
    assert shown["version"] == 0, "the shard starts with no table: nodes follow their files"
    assert all(_info_namespaces(s) == {"rep/": ("write-through", 1)} for s in cluster.servers)

    _cachectl(cluster.shard, "namespace", "add", "scratch/", "--write-mode", "cache-only")
    began = time.monotonic()
    wait_until(
        lambda: all(_info_namespaces(s).get("scratch/") == ("cache-only", 1) for s in cluster.servers),
        2 * HEARTBEAT + 2.0,  # one heartbeat, and slack for two busy cores
        "every node to follow the new namespace",
    )
    took = time.monotonic() - began
    # The shard's table replaced the file's: rep/ is no longer in it.
    assert all("rep/" not in _info_namespaces(s) for s in cluster.servers), took
    # A user sees it: a cache-only put never reaches object storage.
    with cluster.client() as client:
        key = f"scratch/{time.time_ns()}".encode()
        client.put(key, b"v" * 100)
        assert client.get(key) == b"v" * 100
    objects = cluster.s3.client().list_objects_v2(Bucket="cachesvc-test", Prefix=cluster.prefix + "scratch/")
    assert objects.get("KeyCount", 0) == 0, objects

    listed = json.loads(_cachectl(cluster.shard, "namespace", "ls", "--json").stdout)
    assert listed["version"] > 0
    assert [ns["prefix"] for ns in listed["namespaces"]] == ["scratch/"]
    refused = _cachectl(cluster.shard, "namespace", "add", "scratch/", check=False)
    assert refused.returncode == 2 and "exists" in refused.stderr


def test_a_node_restarted_with_a_stale_file_says_so_and_follows_the_shard(cluster: Cluster) -> None:
    _cachectl(cluster.shard, "namespace", "add", "rep/", "--replicas", "2")
    wait_until(
        lambda: all(_info_namespaces(s).get("rep/") == ("write-through", 2) for s in cluster.servers),
        2 * HEARTBEAT + 2.0,
        "every node to hold rep/ with 2 replicas",
    )
    server = cluster.servers[0]
    assert server.process is not None
    log_path = server.process.log_path
    server.stop(grace=10.0)
    before = log_path.stat().st_size
    server.start()  # its file still says replicas = 1

    def warned() -> bool:
        with log_path.open("rb") as log:
            log.seek(before)
            return b"differ from the metadata shard's table" in log.read()

    wait_until(warned, 20.0, "the restarted node to say its file differs from the shard's table")
    assert _info_namespaces(server)["rep/"] == ("write-through", 2)
    cluster.wait_placement([s.address for s in cluster.servers], "the restarted node back in the placement")
    # A routing client that was told nothing learns the replicas from the shard's table.
    with CacheClient(meta=",".join(cluster.shard.addresses), timeout=20.0) as client:
        key = b"rep/" + str(time.time_ns()).encode()
        client.put(key, b"twice")
        holders = [s for s in cluster.servers if _cached(s, key)]
        assert len(holders) == 2, [s.address for s in holders]


def _cached(server: CacheServer, key: bytes) -> bool:
    with NodeClient(server.address, timeout=5.0) as client:
        return bool(client.contains(key, cached_only=True))


def test_tenant_add_on_a_shard_without_an_admin_token_names_the_setting(cluster: Cluster) -> None:
    refused = _cachectl(cluster.shard, "tenant", "add", "team-a", "--prefix", "a/", check=False)
    assert refused.returncode != 0
    assert "CACHESVC_SECURITY_ADMIN_TOKEN" in refused.stderr, refused.stderr
    table = MetaClient(cluster.shard.addresses, timeout=5.0).namespaces()
    assert table.tenants == ()


def test_the_meta_client_reads_and_writes_the_table(cluster: Cluster) -> None:
    meta = MetaClient(cluster.shard.addresses, timeout=5.0)
    version = meta.put_namespace(NamespaceEntry("kv/", "cache-only", 0.0, 30.0, 1))
    table = meta.namespaces()
    assert table.version == version
    assert NamespaceEntry("kv/", "cache-only", 0.0, 30.0, 1) in table.namespaces
    assert meta.delete_namespace("kv/") > version
    assert all(ns.prefix != "kv/" for ns in meta.namespaces().namespaces)


# ---------------------------------------------------------------- tenants and their tokens

DATA_TOKEN, ADMIN_TOKEN = "data-token-for-tests", "admin-token-for-tests"


@pytest.fixture(scope="module")
def secured(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("tenants-secured")
    with running_cluster(
        s3, base, "", [("8MiB", "16MiB")] * 3, heartbeat_seconds=HEARTBEAT, tokens=(DATA_TOKEN, ADMIN_TOKEN)
    ) as c:
        yield c


def _add_tenant(cluster: Cluster, name: str, *args: str) -> str:
    """Adds a tenant with cachectl; returns its token (the last line of stdout)."""
    out = _cachectl(cluster.shard, "tenant", "add", name, *args, admin=ADMIN_TOKEN).stdout
    return out.strip().splitlines()[-1]


def _tenant_client(cluster: Cluster, token: str, **kwargs: Any) -> CacheClient:
    return CacheClient(meta=",".join(cluster.shard.addresses), token=token, timeout=10.0, **kwargs)


def _accepted_everywhere(cluster: Cluster, token: str) -> bool:
    """Whether every node knows `token` (a key of another tenant's is then PERMISSION_DENIED, not UNAUTHENTICATED)."""
    for server in cluster.servers:
        with NodeClient(server.address, timeout=5.0, token=token) as node:
            try:
                node.contains(b"nobody/probe")
            except AuthError as exc:
                if exc.code is grpc.StatusCode.UNAUTHENTICATED:
                    return False
    return True


@pytest.fixture(scope="module")
def two_tenants(secured: Cluster) -> dict[str, str]:
    tokens = {
        "team-a": _add_tenant(secured, "team-a", "--prefix", "a/", "--priority", "high"),
        "team-b": _add_tenant(secured, "team-b", "--prefix", "b/", "--prefix", "shared-b/"),
    }
    for token in tokens.values():
        wait_until(
            lambda token=token: _accepted_everywhere(secured, token),
            2 * HEARTBEAT + 3.0,
            "every node to know the token",
        )
    return tokens


def test_tenant_add_prints_the_token_last_and_the_shard_keeps_only_its_hash(
    secured: Cluster, two_tenants: dict[str, str]
) -> None:
    listed = json.loads(_cachectl(secured.shard, "tenant", "ls", "--json", admin=ADMIN_TOKEN).stdout)
    assert [t["name"] for t in listed["tenants"]] == ["team-a", "team-b"]
    table = secured.meta.namespaces()
    hashes = {t.name: t.token_sha256 for t in table.tenants}
    assert hashes["team-a"] == token_sha256(two_tenants["team-a"])
    assert two_tenants["team-a"].encode() not in b"".join(hashes.values())
    # With the data token, the table shows no hashes.
    assert all(not t.token_sha256 for t in MetaClient(secured.shard.addresses, token=DATA_TOKEN).namespaces().tenants)


def test_a_tenant_token_reaches_its_own_keys_only(secured: Cluster, two_tenants: dict[str, str]) -> None:
    with (
        _tenant_client(secured, two_tenants["team-a"]) as a,
        _tenant_client(secured, two_tenants["team-b"]) as b,
        secured.client() as admin,
    ):
        a.put(b"a/one", b"A1")
        b.put(b"b/one", b"B1")
        b.put(b"shared-b/two", b"B2")
        assert a.get(b"a/one") == b"A1"
        for attempt in (
            lambda: a.get(b"b/one"),
            lambda: a.put(b"b/one", b"overwritten"),
            lambda: a.delete(b"b/one"),
            lambda: a.get_many([b"a/one", b"b/one"]),
            lambda: a.contains_many([b"a/one", b"b/one"]),
            lambda: a.evict(b"a/one"),  # admin scope: not even its own
        ):
            with pytest.raises(AuthError) as refused:
                attempt()
            assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED, refused.value
            assert "team-a" in str(refused.value)
        # A prefetch plan naming another tenant's key is refused by that key's owner, naming A.
        with pytest.raises(AuthError, match="team-a"):
            a.prefetch([b"a/one", b"b/one"], window_bytes=1 << 20).close()
        # A cluster's stats are an admin's: each node refuses a tenant, naming it.
        errors = [node["error"] for node in a.stats()["nodes"].values()]
        assert len(errors) == 3 and all("PERMISSION_DENIED" in e and "team-a" in e for e in errors), errors
        # Listings show a tenant its own keys, none of another's; the admin sees everything.
        assert [k for k, _ in a.list(cached=True)] == [b"a/one"]
        assert sorted(k for k, _ in b.list(cached=True)) == [b"b/one", b"shared-b/two"]
        assert [k for k, _ in a.list(b"b/", cached=True)] == []
        assert {b"a/one", b"b/one", b"shared-b/two"} <= {k for k, _ in admin.list(cached=True)}
        assert admin.get(b"b/one") == b"B1", "B's value was not touched by A's refused writes"
        # The shard shows a tenant its own part of the table only.
        assert [
            ns.prefix for ns in MetaClient(secured.shard.addresses, token=two_tenants["team-a"]).namespaces().namespaces
        ] == ["a/"]


def test_a_co_located_tenant_client_cannot_read_another_tenants_values(
    secured: Cluster, two_tenants: dict[str, str]
) -> None:
    with _tenant_client(secured, two_tenants["team-b"]) as b, secured.client() as admin:
        b.put(b"b/local", b"secret of b" * 100)
        assert admin.get(b"b/local") == b"secret of b" * 100  # in an arena and an L2 file on this machine
    with _tenant_client(secured, two_tenants["team-a"], colocated=True) as a:
        with pytest.raises(AuthError, match="team-a"):
            a.get(b"b/local")
        info = a.info()
        assert not info["l2_path"], "the L2 file holds every tenant's values: never named to a tenant"


def _keys_on(placement: Any, address: str, prefix: str, count: int = 1) -> list[bytes]:
    """`count` keys under `prefix` that `address` owns by `placement`."""
    keys = (f"{prefix}{i}".encode() for i in range(10_000))
    return [key for key in keys if placement.locate(key) == address][:count]


def _counters(server: CacheServer) -> dict[str, int]:
    with server.client(timeout=10.0, token=ADMIN_TOKEN) as plain:
        return dict(plain.stats()["counters"])


def _mapped(client: CacheClient) -> tuple[Colocated, SharedL1]:
    transport = client.transport
    assert isinstance(transport, Colocated), transport
    l1 = transport.shared_l1(wait=True)
    assert l1 is not None, "the arena was not mapped"
    return transport, l1


def test_a_co_located_tenant_client_reads_its_own_arena_and_maps_no_other_values(
    secured: Cluster, two_tenants: dict[str, str]
) -> None:
    owner = secured.servers[0]
    placement = secured.placement()
    (a_key,) = _keys_on(placement, owner.address, "a/near-")
    (b_key,) = _keys_on(placement, owner.address, "b/near-")
    (plain_key,) = _keys_on(placement, owner.address, "plain/near-")
    values = {a_key: b"own value of A." * 273, b_key: b"secret of B!!!." * 273, plain_key: b"untenanted v..." * 273}
    with (
        _tenant_client(secured, two_tenants["team-a"]) as a,
        _tenant_client(secured, two_tenants["team-b"]) as b,
        secured.client() as admin,
    ):
        a.put(a_key, values[a_key])
        b.put(b_key, values[b_key])
        admin.put(plain_key, values[plain_key])
        for key, value in values.items():
            assert admin.get(key) == value  # served: published in the arena that holds it
    with CacheClient(owner.address, token=two_tenants["team-a"], colocated=True, timeout=10.0) as near:
        transport, l1 = _mapped(near)
        assert near.get(a_key) == values[a_key]
        time.sleep(0.6)  # the co-located reads above (the admin's too) swept: what rises next is A's
        before = _counters(owner)
        for _ in range(20):
            assert near.get(a_key) == values[a_key]
        assert transport.counts["arena"] >= 20, transport.counts
        wait_until(
            lambda: _counters(owner).get("direct_hit_keys", 0) > before.get("direct_hit_keys", 0),
            5.0,
            "the server to sweep the co-located hits",
        )
        assert _counters(owner).get("gets", 0) == before.get("gets", 0), "A's reads went over gRPC"
        # What A's process maps holds A's value and neither B's nor the untenanted one.
        mapped = b"".join(bytes(m) for m in l1._maps)
        assert len(l1._maps) == 2, "one segment (arena and hit counters), no other tenant's"
        assert values[a_key] in mapped
        assert values[b_key][:64] not in mapped and values[plain_key][:64] not in mapped
        with pytest.raises(AuthError, match="team-a"):
            near.get(b_key)  # over gRPC: refused
        assert not l1.writes
        near.put(a_key, values[a_key][::-1])  # a tenant writes over gRPC, not through staging
        assert transport.counts["staged"] == 0
        assert near.get(a_key) == values[a_key][::-1]
    # The data token maps every segment, and reads each tenant's keys from it.
    with CacheClient(owner.address, token=DATA_TOKEN, colocated=True, timeout=10.0) as data:
        transport, l1 = _mapped(data)
        assert len(l1._maps) == 2 * 3, "the main segment and both tenants'"
        for key in (b_key, plain_key):
            assert data.get(key) == values[key]
        data.get(a_key)  # its new value, served and published
        got = transport.counts["arena"]
        assert [data.get(key) for key in (a_key, b_key, plain_key)] == [
            values[a_key][::-1],
            values[b_key],
            values[plain_key],
        ]
        assert transport.counts["arena"] == got + 3, transport.counts
    # A wrong token gets no segment at all.
    socket_path = NodeClient(owner.address, token=DATA_TOKEN, timeout=5.0).info()["arena_socket"]
    with pytest.raises(CacheClientError, match="refused"):
        SharedL1(socket_path, "not-a-token")


def test_a_data_token_client_maps_a_new_tenants_arena_at_once(secured: Cluster, two_tenants: dict[str, str]) -> None:
    owner = secured.servers[0]
    (key,) = _keys_on(secured.placement(), owner.address, "c/near-")
    value = b"value of tenant C." * 200
    with CacheClient(owner.address, token=DATA_TOKEN, colocated=True, timeout=10.0) as data:
        transport, l1 = _mapped(data)
        segments = len(l1._maps) // 2
        token = _add_tenant(secured, "team-c", "--prefix", "c/")
        try:
            wait_until(lambda: _accepted_everywhere(secured, token), 2 * HEARTBEAT + 3.0, "every node to know C")
            with _tenant_client(secured, token) as c:
                c.put(key, value)
                assert c.get(key) == value  # served: published in C's arena

            def from_the_arena() -> bool:
                before = transport.counts["arena"]
                return data.get(key) == value and transport.counts["arena"] == before + 1

            # Sooner than RETRY_SECONDS: the client maps again as soon as it sees the segments changed.
            wait_until(from_the_arena, 3.0, "the data token's client to read C's key from C's arena")
            mapped = transport.shared_l1()
            assert mapped is not None and len(mapped._maps) // 2 == segments + 1
        finally:
            _cachectl(secured.shard, "tenant", "rm", "team-c", admin=ADMIN_TOKEN)
    # Removed: its token gets no arena on any node (its keys went back to the main one).
    sockets = [NodeClient(s.address, token=DATA_TOKEN, timeout=5.0).info()["arena_socket"] for s in secured.servers]

    def refused_everywhere() -> bool:
        for path in sockets:
            try:
                SharedL1(path, token).close()
            except CacheClientError:
                continue
            return False
        return True

    wait_until(refused_everywhere, 2 * HEARTBEAT + 3.0, "C's arenas to go")
    with secured.client() as admin:
        assert admin.get(key) == value


def test_the_l1_budget_holds_across_the_tenants_arenas(secured: Cluster, two_tenants: dict[str, str]) -> None:
    value = os.urandom(256 << 10)
    with (
        _tenant_client(secured, two_tenants["team-a"]) as a,
        _tenant_client(secured, two_tenants["team-b"]) as b,
        secured.client() as admin,
    ):
        for i in range(40):  # 30 MiB over 3 nodes of 8 MiB of L1 each
            a.put(f"a/fill-{i}".encode(), value)
            b.put(f"b/fill-{i}".encode(), value)
            admin.put(f"plain/fill-{i}".encode(), value)
        for i in range(40):
            for client, key in ((a, f"a/fill-{i}"), (b, f"b/fill-{i}"), (admin, f"plain/fill-{i}")):
                assert client.get(key.encode()) == value
    for server in secured.servers:
        with server.client(timeout=10.0, token=ADMIN_TOKEN) as plain:
            l1 = next(t for t in plain.stats()["tiers"] if t["name"] == "l1")
        assert 0 < l1["used_bytes"] <= l1["capacity_bytes"] == 8 << 20, l1


def test_cachectl_ls_with_a_tenant_token_shows_its_keys_only(secured: Cluster, two_tenants: dict[str, str]) -> None:
    with _tenant_client(secured, two_tenants["team-b"]) as b:
        b.put(b"b/listed", b"x")
    env = {**os.environ, "CACHECTL_META": ",".join(secured.shard.addresses), "CACHECTL_TOKEN": two_tenants["team-a"]}
    done = subprocess.run(
        [sys.executable, "-m", "cachesvc.commands.cachectl", "ls", "--cached", "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "b/" not in done.stdout and "a/" in done.stdout, done.stdout


# ---------------------------------------------------------------- manifests in the shard


def _denied(attempt: Any, tenant: str) -> str:
    """The message of the PERMISSION_DENIED `attempt()` gets, which names `tenant`."""
    with pytest.raises(AuthError) as refused:
        attempt()
    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED, refused.value
    assert f"tenant {tenant!r}" in str(refused.value), refused.value
    return str(refused.value)


def test_a_tenant_reads_writes_and_lists_its_own_manifests_only(secured: Cluster, two_tenants: dict[str, str]) -> None:
    addresses = secured.shard.addresses
    with (
        MetaClient(addresses, token=two_tenants["team-a"], timeout=10.0) as a,
        MetaClient(addresses, token=two_tenants["team-b"], timeout=10.0) as b,
        MetaClient(addresses, token=ADMIN_TOKEN, timeout=10.0) as admin,
    ):
        admin.put_manifest("ops/catalog", s3_prefix="ops/")
        b.put_manifest("shared-b/ds", s3_prefix="shared-b/raw/", items=[ManifestItem("b/x", 1, 2)])
        revision = a.put_manifest("a/ds", s3_prefix="a/raw/", items=[ManifestItem("a/x", 3, 4)])
        found = a.get_manifest("a/ds")
        assert found is not None and found.revision == revision
        assert found.s3_prefix == "a/raw/" and [(i.key, i.size, i.checksum) for i in found.items] == [("a/x", 3, 4)]
        assert a.list_manifests() == ["a/ds"], "another tenant's and the admin's names are not shown"
        assert b.list_manifests() == ["shared-b/ds"]
        assert {"a/ds", "shared-b/ds", "ops/catalog"} <= set(admin.list_manifests())

        # Another tenant's manifest, or one of no tenant's, is refused whole: not read, replaced or deleted.
        _denied(lambda: a.get_manifest("shared-b/ds"), "team-a")
        _denied(lambda: a.get_manifest("ops/catalog"), "team-a")
        _denied(lambda: a.put_manifest("shared-b/ds", s3_prefix="a/raw/"), "team-a")
        _denied(lambda: a.delete_manifest("shared-b/ds"), "team-a")
        # A name of its own naming keys or an S3 prefix outside its prefixes.
        assert "'b/x'" in _denied(
            lambda: a.put_manifest("a/bad", items=[ManifestItem("a/y"), ManifestItem("b/x")]), "team-a"
        )
        assert "'b/raw/'" in _denied(lambda: a.put_manifest("a/bad", s3_prefix="b/raw/"), "team-a")
        # One Propose is one log entry: a batch with one command not its own changes nothing.
        mixed = [
            pb.Command(put_manifest=pb.PutManifest(manifest=pb.Manifest(name="a/batch"))),
            pb.Command(delete_manifest=pb.DeleteManifest(name="shared-b/ds")),
        ]
        _denied(lambda: a.propose(mixed), "team-a")
        assert admin.get_manifest("a/bad") is None and admin.get_manifest("a/batch") is None
        kept = admin.get_manifest("shared-b/ds")
        assert kept is not None and kept.s3_prefix == "shared-b/raw/", "B's manifest was not touched by A"

        # Any other command stays an admin's, whatever it names.
        for command in (
            pb.Command(register_node=pb.RegisterNode(address="127.0.0.1:1", capacity_bytes=1)),
            pb.Command(set_node_state=pb.SetNodeState(address=secured.servers[0].address, state=pb.NODE_STATE_DOWN)),
            pb.Command(put_namespace=pb.PutNamespace(namespace=pb.Namespace(prefix="a/sub/", write_mode="write-back"))),
            pb.Command(put_tenant=pb.PutTenant(tenant=pb.Tenant(name="team-a", prefixes=["a/", "b/"]), replace=True)),
            pb.Command(delete_tenant=pb.DeleteTenant(name="team-b")),
        ):
            op = command.WhichOneof("op")
            assert op in _denied(lambda command=command: a.propose([command]), "team-a")
        assert [t.name for t in admin.namespaces().tenants] == ["team-a", "team-b"]
        assert "127.0.0.1:1" not in {n.address for n in admin.nodes()}
        assert {n.state for n in admin.nodes()} == {"up"}

        assert a.delete_manifest("a/ds") is True
        assert a.get_manifest("a/ds") is None and a.list_manifests() == []
        assert admin.get_manifest("a/ds") is None


def test_a_tenant_saves_and_loads_models_and_checkpoints_through_the_shard(
    secured: Cluster, two_tenants: dict[str, str]
) -> None:
    torch = pytest.importorskip("torch")
    from cacheclient.checkpoint import load as load_checkpoint
    from cacheclient.checkpoint import save as save_checkpoint
    from cacheclient.models import load_model, model_record, save_model

    model = torch.nn.Linear(4, 3)
    with _tenant_client(secured, two_tenants["team-a"]) as a, _tenant_client(secured, two_tenants["team-b"]) as b:
        save_model(model, a, "a/models/tiny")
        assert model_record("a/models/tiny").startswith("a/"), "a model's record lies under its name"
        loaded = load_model(torch.nn.Linear(4, 3), a, "a/models/tiny")
        assert torch.equal(loaded.weight, model.weight)
        _denied(lambda: load_model(torch.nn.Linear(4, 3), b, "a/models/tiny"), "team-b")
        # A name outside its prefixes: the values are refused before the manifest is.
        _denied(lambda: save_model(model, a, "b/models/tiny"), "team-a")

        state = {"w": torch.arange(8, dtype=torch.float32)}
        save_checkpoint(state, a, "run/1", prefix="a/ckpt/")
        save_checkpoint({"w": torch.zeros(2)}, b, "run/1", prefix="b/ckpt/")
        back = load_checkpoint(a, "run/1", prefix="a/ckpt/")
        assert torch.equal(back["w"], state["w"])
        with MetaClient(secured.shard.addresses, token=two_tenants["team-a"], timeout=10.0) as meta:
            names = meta.list_manifests()
        assert any(n.startswith("a/ckpt/manifests/run/") for n in names), names
        assert "a/models/tiny/manifest" in names and all(n.startswith("a/") for n in names), names
    # cachectl lists them with the tenant's token (records read through the shard), and refuses B's.
    env = {**os.environ, "CACHECTL_META": ",".join(secured.shard.addresses), "CACHECTL_TOKEN": two_tenants["team-a"]}
    ls = [sys.executable, "-m", "cachesvc.commands.cachectl", "checkpoints", "ls", "--json", "--prefix"]
    done = subprocess.run([*ls, "a/ckpt/"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [row["name"] for row in json.loads(done.stdout)] == ["run/1"]
    theirs = subprocess.run([*ls, "b/ckpt/"], capture_output=True, text=True, env=env, timeout=60)
    assert theirs.returncode == 0 and json.loads(theirs.stdout) == [], "B's checkpoint is not listed to A"
    env["CACHECTL_TOKEN"] = two_tenants["team-b"]
    own = subprocess.run([*ls, "b/ckpt/"], capture_output=True, text=True, env=env, timeout=60)
    assert own.returncode == 0 and [row["name"] for row in json.loads(own.stdout)] == ["run/1"], own.stderr


def test_a_model_committed_under_the_older_record_is_still_found(secured: Cluster, two_tenants: dict[str, str]) -> None:
    from cacheclient.manifests import ShardManifests, ShardRecords
    from cacheclient.models import ModelManifest, ParameterValueError, read_manifest

    manifest = ModelManifest(name="legacy", save_id="s1", modules=())
    with secured.client() as admin:
        assert admin.cluster.shard is not None
        older = ShardManifests(
            admin,
            ShardRecords(admin.cluster.shard),
            record=lambda name: f"models/{name}",
            value_key=lambda name, sum64: f"{name}/manifest~{sum64:016x}".encode(),
        )
        older.save("legacy", manifest.to_json())
        assert read_manifest(admin, "legacy").save_id == "s1"
    # A tenant looking for a model it never saved is told so, not refused over the older record's name.
    with (
        _tenant_client(secured, two_tenants["team-a"]) as a,
        pytest.raises(ParameterValueError, match="no saved model"),
    ):
        read_manifest(a, "a/never-saved")


def test_a_rotated_token_is_refused_on_every_node_within_a_heartbeat(
    secured: Cluster, two_tenants: dict[str, str]
) -> None:
    old = two_tenants["team-b"]
    # B's co-located client maps its arena on every node with the old token, one of its values in it.
    owner = secured.servers[0]
    (key,) = _keys_on(secured.placement(), owner.address, "b/rotated-")
    with _tenant_client(secured, old) as b:
        b.put(key, b"B before the rotation." * 200)
        assert b.get(key) == b"B before the rotation." * 200
    sockets = [NodeClient(s.address, token=DATA_TOKEN, timeout=5.0).info()["arena_socket"] for s in secured.servers]
    kept = [SharedL1(path, old) for path in sockets]
    assert b"B before the rotation." * 200 in bytes(kept[0]._maps[0])
    out = _cachectl(secured.shard, "tenant", "token", "team-b", "--rotate", admin=ADMIN_TOKEN).stdout
    new = out.strip().splitlines()[-1]
    assert new != old
    wait_until(
        lambda: all(_refuses(s, old) for s in secured.servers),
        2 * HEARTBEAT + 2.0,
        "every node to refuse the old token",
    )
    wait_until(lambda: _accepted_everywhere(secured, new), 2 * HEARTBEAT + 2.0, "the new token")
    two_tenants["team-b"] = new
    # The old arena is closed and wiped under the mapping kept; the old token gets none, the new one its own.
    wait_until(lambda: not any(l1.open for l1 in kept), 2 * HEARTBEAT + 2.0, "B's old arenas to close")
    assert b"B before the rotation." not in bytes(kept[0]._maps[0])
    for path in sockets:
        with pytest.raises(CacheClientError, match="refused"):
            SharedL1(path, old)
        SharedL1(path, new).close()
    for l1 in kept:
        l1.close()


def _refuses(server: CacheServer, token: str) -> bool:
    with NodeClient(server.address, timeout=5.0, token=token) as node:
        try:
            node.contains(b"b/one")
        except AuthError as exc:
            return exc.code is grpc.StatusCode.UNAUTHENTICATED
        except CacheClientError:
            return False
    return False


def test_isolation_holds_while_the_shard_elects_a_new_leader(secured: Cluster, two_tenants: dict[str, str]) -> None:
    shard = secured.shard
    with secured.client(colocated=False) as admin:
        admin.put(b"a/during-election", b"a's value")
        admin.put(b"b/during-election", b"b's value")
    leader, term = shard.leader(timeout=10.0)
    shard.kill(leader)
    rounds = 0
    new_leader: tuple[int, int] | None = None
    try:
        while new_leader is None:
            # Every node, each round, while the shard has no leader and then a new one: a's token reads its own
            # key, is refused b's naming team-a, and a token no tenant holds is unauthenticated.
            for server in secured.servers:
                with NodeClient(server.address, timeout=5.0, token=two_tenants["team-a"]) as a:
                    assert a.get(b"a/during-election") == b"a's value", server.address
                    with pytest.raises(AuthError, match="team-a") as refused:
                        a.get(b"b/during-election")
                    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
                assert _refuses(server, "no-tenant-holds-this-token"), server.address
            rounds += 1
            assert rounds < 500, "no new leader"
            statuses = {i: shard.status(i, timeout=0.3) for i in shard.ids if i != leader}
            elected = [(i, s["term"]) for i, s in statuses.items() if s and s["role"] == "leader" and s["term"] > term]
            new_leader = elected[0] if elected else None
        # The new leader takes table changes, and every node follows them: a rotation reaches every node.
        old = two_tenants["team-a"]
        out = _cachectl(shard, "tenant", "token", "team-a", "--rotate", admin=ADMIN_TOKEN).stdout
        new = out.strip().splitlines()[-1]
        wait_until(lambda: all(_refuses(s, old) for s in secured.servers), 2 * HEARTBEAT + 3.0, "the old token refused")
        wait_until(lambda: _accepted_everywhere(secured, new), 2 * HEARTBEAT + 3.0, "the new token")
        two_tenants["team-a"] = new
    finally:
        shard.start(leader)
    print(json.dumps({"killed": leader, "term": term, "new_leader": new_leader, "rounds": rounds}))
    assert rounds >= 1


def test_isolation_holds_with_the_whole_shard_down(secured: Cluster, two_tenants: dict[str, str]) -> None:
    secured.shard.stop()  # the last test of the module: nodes keep the last table they applied
    for server in secured.servers:
        with (
            NodeClient(server.address, timeout=5.0, token=two_tenants["team-a"]) as a,
            pytest.raises(AuthError, match="team-a"),
        ):
            a.get(b"b/one")


# ---------------------------------------------------------------- cachesvc up --tokens


def test_cachesvc_up_with_tokens_lets_cachectl_make_a_tenant_from_its_state_dir(s3: S3Server, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cache_port, meta_port, metrics_port = free_port(), free_port_run(1), free_port_run(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "CACHESVC_SECURITY_"))}
    up = subprocess.Popen(
        [
            sys.executable, "-m", "cachesvc", "up", "--tokens", "--state-dir", str(state), "--meta-nodes", "1",
            "--cache-port", str(cache_port), "--meta-port", str(meta_port), "--metrics-port", str(metrics_port),
            "--s3-endpoint", s3.endpoint, "--bucket", s3.bucket, "--l1-bytes", "32MiB", "--l2-bytes", "64MiB",
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: (state / "cluster.json").exists() or up.poll() is not None, 120.0, "cachesvc up to start")
        assert up.poll() is None, up.stdout.read() if up.stdout else ""
        info = json.loads((state / "cluster.json").read_text())
        assert (state / "cluster.json").stat().st_mode & 0o777 == 0o600
        assert info["token"] and info["admin_token"] and info["token"] != info["admin_token"]

        def cachectl(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "--state-dir", str(state), *args]
            return subprocess.run(argv, capture_output=True, text=True, env={**env, **extra}, timeout=60)

        added = cachectl("tenant", "add", "team-a", "--prefix", "team-a/", "--l1", "8MiB", "--priority", "high")
        assert added.returncode == 0, added.stderr
        token = added.stdout.strip().splitlines()[-1]
        wait_until(
            lambda: cachectl("put", "team-a/x", "--value", "hello", CACHECTL_TOKEN=token).returncode == 0,
            10.0,
            "the tenant's token to be accepted by the cache server",
        )
        got = cachectl("get", "team-a/x", CACHECTL_TOKEN=token)
        assert got.returncode == 0 and got.stdout == "hello", got.stderr
        other = cachectl("put", "team-b/x", "--value", "no", CACHECTL_TOKEN=token)
        assert other.returncode == 5 and "tenant 'team-a'" in other.stderr, other.stderr
        without = cachectl("get", "team-a/x", CACHECTL_TOKEN="not-a-token")
        assert without.returncode != 0 and "UNAUTHENTICATED" in without.stderr, without.stderr
    finally:
        up.terminate()
        up.wait(timeout=120)
