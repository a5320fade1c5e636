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

import pytest

from cacheclient import CacheClient, NodeClient
from cacheclient.meta import MetaClient, NamespaceEntry
from cacheclient.wire import meta_pb2 as pb
from cacheclient.wire.scopes import token_sha256
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
    keep = pb.Command(put_tenant=pb.PutTenant(tenant=pb.Tenant(name="a", prefixes=["a/"], priority="high"), replace=True))
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
