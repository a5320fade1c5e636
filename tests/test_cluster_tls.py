"""TLS between cache nodes: peer fill verifies the previous owner's certificate against `security.tls_ca`.

Each cache server has a certificate of its own, signed by one CA (`trustme`).
After a third node joins, its peer fills reach the previous owners over TLS:
every moved key comes from them, none fails. A joiner given another CA
cannot verify its peers: every peer fill fails (counted in `peer_errors`),
the keys are read from S3, and the reader still gets the right bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trustme

from cacheclient import CacheClient
from cacheclient.meta import MetaClient
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, S3Server, s3_args, server_version, wait_until

pytestmark = pytest.mark.timeout(150)


def _certs(base: Path, nodes: int) -> tuple[Path, Path, list[tuple[Path, Path]]]:
    """The CA, an unrelated CA, and a (certificate, key) for 127.0.0.1 per node, signed by the CA."""
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(base / "ca.pem"))
    other.cert_pem.write_to_path(str(base / "other.pem"))
    pairs = []
    for i in range(nodes):
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        cert, key = base / f"node{i}.pem", base / f"node{i}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        pairs.append((cert, key))
    return base / "ca.pem", base / "other.pem", pairs


@pytest.mark.parametrize("joiner_trusts", ["the cluster's CA", "another CA"])
def test_peer_fill_runs_over_tls_and_verifies_the_peer(s3: S3Server, tmp_path: Path, joiner_trusts: str) -> None:
    ca, other, pairs = _certs(tmp_path, 4)
    # One CA for the cluster: the shard speaks TLS with a certificate of its own too.
    shard = LocalShard(
        1,
        tmp_path / "meta",
        args=["--lease-seconds", "10"],
        tls_cert=str(pairs[3][0]),
        tls_key=str(pairs[3][1]),
        tls_ca=str(ca),
    )
    shard.start()
    shard.leader(timeout=20.0)
    meta = ",".join(shard.addresses)
    prefix = f"tls/{random.randrange(1 << 32):08x}/"
    servers: list[CacheServer] = []

    def start(i: int, trust: Path) -> CacheServer:
        cert, key = pairs[i]
        args = [
            "--l1-bytes", "16MiB", "--meta", meta, "--meta-tls-ca", str(ca), *s3_args(s3, prefix),
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(trust),
        ]  # fmt: skip
        # No handover: the moved keys are read by the new owner, which is the TLS client this test checks.
        env = {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3", "CACHESVC_META_HANDOVER_BYTES": "0"}
        server = CacheServer(args, tmp_path / "logs", env).start()
        servers.append(server)
        return server

    def placed(addresses: list[str]) -> None:
        wait_until(
            lambda: sorted(shard_client.placement(refresh=True).nodes) == sorted(addresses),
            30.0,
            f"{len(addresses)} TLS cache servers in the placement",
            interval=0.1,
        )

    shard_client = MetaClient(shard.addresses, timeout=5.0, tls_ca=str(ca))
    rng = random.Random(11)
    values = {f"k/{i:04d}": rng.randbytes(rng.randrange(500, 8000)) for i in range(200)}
    try:
        first = [start(0, ca), start(1, ca)]
        placed([s.address for s in first])
        with CacheClient(meta=meta, tls_ca=str(ca), timeout=20.0) as client:
            client.put_many(values)  # written through to S3, cached on each key's owner
            before = shard_client.placement(refresh=True)
            joined = start(2, ca if joiner_trusts == "the cluster's CA" else other)
            placed([s.address for s in servers])
            after = shard_client.placement(refresh=True)
            # Every server routes by the new map before the reads: a node that does not know yet that it owns a
            # key serves it as a stand-in, which does not peer-fill from the key's owner by its older map.
            wait_until(
                lambda: all(server_version(s, tls_ca=str(ca)) >= after.version for s in servers),
                20.0,
                f"every server to route by placement version {after.version}",
                interval=0.1,
            )
            moved = [k for k in values if after.locate(k.encode()) != before.locate(k.encode())]
            assert len(moved) > 30, f"only {len(moved)} of {len(values)} keys moved to the new node"
        with CacheClient(meta=meta, tls_ca=str(ca), timeout=20.0) as reader:
            assert reader.get_many(list(values)) == list(values.values())
        with CacheClient(joined.address, tls_ca=str(ca), timeout=10.0) as one:
            counters = one.stats()["counters"]
        if joiner_trusts == "the cluster's CA":
            assert counters["peer_fills"] == len(moved) and counters.get("peer_errors", 0) == 0, counters
        else:
            # The previous owners' certificates do not verify: no byte comes from them, S3 serves every key.
            assert counters.get("peer_fills", 0) == 0 and counters["peer_errors"] >= 1, counters
    finally:
        for server in servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        shard_client.close()
        shard.stop()
