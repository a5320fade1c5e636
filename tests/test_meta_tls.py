"""The metadata shard over TLS: clients, peers and cache servers, with certificates from `trustme`.

A three-node shard whose nodes serve TLS (one CA; each node verifies its
peers against it on the Raft transport) elects a leader and commits; a
`MetaClient` given the CA reaches it, one without it fails with one error
that says TLS is the likely cause; a cache server given the CA
(`meta.tls_ca`) registers, and a routing client given the CA reaches the
shard and the cache servers with it; `cachectl --tls-ca` reaches the
shard too. TLS on a metadata node with tokens and scopes is the same
interceptor as without (tests/test_meta_auth.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from cacheclient import CacheClient
from cacheclient.errors import UnavailableError
from cacheclient.meta import MetaClient
from cachesvc.config import ConfigError, load_meta_node_config
from cachesvc.devcluster.shard import LocalShard

from conftest import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a certificate for 127.0.0.1 and localhost signed by it, and a second, unrelated CA."""
    base = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": base / "ca.pem", "cert": base / "cert.pem", "key": base / "key.pem", "other": base / "other.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    trustme.CA().cert_pem.write_to_path(str(paths["other"]))
    return paths


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory, certs: dict[str, Path]) -> Iterator[LocalShard]:
    s = LocalShard(
        3,
        tmp_path_factory.mktemp("tls-shard"),
        tls_cert=str(certs["cert"]),
        tls_key=str(certs["key"]),
        tls_ca=str(certs["ca"]),
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def test_a_tls_shard_elects_a_leader_and_commits(shard: LocalShard) -> None:
    # Only a transport that verifies its peers' certificates and completes the handshake gets a leader elected.
    shard.leader(timeout=20.0)
    with shard.client(timeout=10.0) as client:
        client.put_manifest("tls/one", s3_prefix="p")
        assert client.get_manifest("tls/one") is not None

    # Every node applied it: commits went over the TLS Raft transport to both followers.
    def digests() -> set[object]:
        return {(shard.status(i, state_digest=True) or {}).get("state_digest") for i in shard.ids}

    wait_until(
        lambda: len(digests()) == 1 and None not in digests(),
        10.0,
        "every node to apply the same state",
    )


def test_a_client_without_the_ca_fails_with_one_clear_error(shard: LocalShard, certs: dict[str, Path]) -> None:
    shard.leader(timeout=20.0)
    with MetaClient(shard.addresses, timeout=2.0) as plain, pytest.raises(UnavailableError) as refused:
        plain.list_manifests()
    assert "TLS" in str(refused.value) and "tls_ca=" in str(refused.value)
    assert "\n" not in str(refused.value)
    with (
        MetaClient(shard.addresses, timeout=2.0, tls_ca=str(certs["other"])) as wrong,
        pytest.raises(UnavailableError, match="did this tls_ca sign"),
    ):
        wrong.list_manifests()
    with MetaClient(shard.addresses, timeout=5.0, tls_ca=certs["ca"].read_bytes()) as trusted:
        trusted.put_manifest("tls/trusted", s3_prefix="p")
        assert "tls/trusted" in trusted.list_manifests()


def test_a_cache_server_joins_a_tls_shard_and_a_routing_client_reaches_both(
    shard: LocalShard, certs: dict[str, Path], cache_server: Any
) -> None:
    shard.leader(timeout=20.0)
    server = cache_server(
        "--meta",
        ",".join(shard.addresses),
        "--meta-tls-ca",
        str(certs["ca"]),
        "--l1-bytes",
        "1MiB",
        "--tls-cert",
        str(certs["cert"]),
        "--tls-key",
        str(certs["key"]),
    )
    with shard.client() as client:
        wait_until(lambda: server.address in client.placement(refresh=True).nodes, 20.0, "the cache server to register")
    with CacheClient(meta=shard.addresses, tls_ca=str(certs["ca"]), timeout=10.0) as routed:
        routed.put("tls/key", b"value")
        assert routed.get("tls/key") == b"value"


def test_cachectl_tls_ca_reaches_a_tls_shard(shard: LocalShard, certs: dict[str, Path]) -> None:
    shard.leader(timeout=20.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    cachectl = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(shard.addresses)]
    ok = subprocess.run([*cachectl, "--tls-ca", str(certs["ca"]), "leader"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[1] in shard.addresses
    plain = subprocess.run([*cachectl, "nodes", "--wait", "2"], capture_output=True, text=True, env=env)
    assert plain.returncode == 3, plain.stderr
    assert plain.stderr.count("\n") == 1 and "tls" in plain.stderr.lower(), plain.stderr


def test_tls_settings_of_a_meta_node_are_checked(tmp_path: Path, certs: dict[str, Path]) -> None:
    base = {
        "CACHESVC_META_NODE_ID": "1",
        "CACHESVC_META_NODE_PEERS": "1=127.0.0.1:1",
        "CACHESVC_META_NODE_DATA_DIR": str(tmp_path),
    }
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        load_meta_node_config(env={**base, "CACHESVC_META_NODE_SECURITY_TLS_CERT": str(certs["cert"])})
    with pytest.raises(ConfigError, match="tls_ca: requires security.tls_cert"):
        load_meta_node_config(env={**base, "CACHESVC_META_NODE_SECURITY_TLS_CA": str(certs["ca"])})
    tls = {"CACHESVC_META_NODE_SECURITY_TLS_CERT": str(certs["cert"]), "CACHESVC_META_NODE_SECURITY_TLS_KEY": "k"}
    # Without a CA, peers are verified against the node's own certificate (one for every node).
    assert load_meta_node_config(env={**base, **tls}).node_config().tls_ca == str(certs["cert"])
    with_ca = {**base, **tls, "CACHESVC_META_NODE_SECURITY_TLS_CA": str(certs["ca"])}
    assert load_meta_node_config(env=with_ca).node_config().tls_ca == str(certs["ca"])
