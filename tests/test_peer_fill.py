"""Peer fill, as real processes: after a join or a drain moves keys, their new owners read them from the
previous owners, not from object storage (S3 requests counted by a proxy in front of SeaweedFS)."""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheclient.meta import PlacementMap

from conftest import CacheServer, Cluster, S3Server, running_cluster, s3_args, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from latency_proxy import LatencyProxy

pytestmark = pytest.mark.timeout(180)

SIZES = [("16MiB", "16MiB"), ("16MiB", "16MiB")]
NO_HANDOVER = "[meta]\nhandover_bytes = 0\n"
HANDOVER = '[meta]\nhandover_bytes = "256MiB"\n\n[[namespaces]]\nprefix = "back/"\nwrite_mode = "write-back"\n'
MOVE_REQUESTS = 12
"""S3 requests a move of 60-150 of these keys may cost: a few listings per node, where a HEAD each cost 60-150."""


@pytest.fixture
def counted_s3(s3: S3Server) -> Iterator[tuple[S3Server, LatencyProxy]]:
    """The shared SeaweedFS behind a proxy that counts the HTTP requests sent to it (no delay)."""
    proxy = LatencyProxy(s3.endpoint.removeprefix("http://"), delay=0.0).start()
    try:
        yield S3Server(proxy.endpoint, s3.bucket, s3.weed), proxy
    finally:
        proxy.stop()


def _join(cluster: Cluster, base: Path) -> CacheServer:
    """A third cache server like the others (same config, its own L2), registered with the shard."""
    args = [
        "--config", str(base / "cachesvc.toml"),
        "--l1-bytes", "16MiB",
        "--l2-path", str(base / "l2-joined"),
        "--l2-bytes", "16MiB",
        "--meta", ",".join(cluster.shard.addresses),
        *s3_args(cluster.s3, cluster.prefix),
    ]  # fmt: skip
    server = CacheServer(args, base / "logs", {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3"}).start()
    cluster.servers.append(server)
    return server


def _assert_minimal_movement(before: PlacementMap, after: PlacementMap, changed: str) -> None:
    """The shard's maps move about capacity/total of the keys when `changed` joins or leaves (within 1.2x)."""
    grown = after if changed in after.nodes else before
    capacity = dict(zip(grown.nodes, grown.capacities, strict=True))
    ideal = capacity[changed] / sum(capacity.values())
    keys = [f"sample/{i}".encode() for i in range(20_000)]
    moved = sum(before.locate(k) != after.locate(k) for k in keys) / len(keys)
    assert moved <= 1.2 * ideal, f"{moved:.3f} of the keys moved; the ideal is {ideal:.3f}"
    # Only keys of the node that joined or left move.
    assert all(changed in (before.locate(k), after.locate(k)) for k in keys if before.locate(k) != after.locate(k))


def test_a_join_and_a_drain_move_keys_without_reading_them_from_s3_again(
    counted_s3: tuple[S3Server, LatencyProxy], tmp_path: Path
) -> None:
    s3, proxy = counted_s3
    rng = random.Random(7)
    values = {f"peer/{i:04d}".encode(): rng.randbytes(rng.randrange(1000, 20_000)) for i in range(300)}
    # No handover: every moved key is read from its previous owner at its first read.
    with running_cluster(s3, tmp_path, NO_HANDOVER, SIZES, meta_nodes=1) as cluster:
        client = cluster.client()
        try:
            client.put_many(values)  # written through to S3, cached on each key's owner
            assert client.get_many(list(values)) == list(values.values())
            before = cluster.placement()

            joined = _join(cluster, tmp_path)
            after = cluster.wait_placement([s.address for s in cluster.servers], "the new server in the placement")
            moved = [k for k in values if after.locate(k) != before.locate(k)]
            assert all(after.locate(k) == joined.address for k in moved)
            _assert_minimal_movement(before, after, joined.address)
            assert len(moved) > 60, f"only {len(moved)} of 300 keys moved to the new node"
            requests = proxy.requests
            reader = cluster.client()
            try:
                assert reader.get_many(list(values)) == list(values.values())
            finally:
                reader.close()
            # Every moved key came from its previous owner, and its copy was checked against its object by a
            # listing page (up to 1,000 names a request, issue 49), not a HEAD each (issue 22), never a GET.
            # The other requests: each node's own walk over its copies of the keys that moved (a listing).
            assert proxy.requests - requests <= MOVE_REQUESTS, (
                f"{proxy.requests - requests} S3 requests for {len(moved)} moved keys"
            )
            counters = joined.counters()
            assert counters["peer_fills"] == len(moved) and counters.get("peer_errors", 0) == 0
            assert counters["peer_fills_listed"] == len(moved) and "peer_fills_checked" not in counters
            assert counters["peer_fill_bytes"] == sum(len(values[k]) for k in moved)

            # A drain moves the drained node's keys to the others, which read them from it.
            drained = cluster.servers[0]
            cluster.meta.set_node_state(drained.address, "draining")
            rest = [s.address for s in cluster.servers if s is not drained]
            final = cluster.wait_placement(rest, "the drained node to leave the placement")
            moved = [k for k in values if after.locate(k) == drained.address]
            assert moved and all(final.locate(k) != drained.address for k in moved)
            _assert_minimal_movement(after, final, drained.address)
            requests = proxy.requests
            reader = cluster.client()
            try:
                assert reader.get_many(list(values)) == list(values.values())
            finally:
                reader.close()
            assert proxy.requests - requests <= MOVE_REQUESTS, (  # listings, no HEAD per key, no GET
                f"{proxy.requests - requests} S3 requests for {len(moved)} moved keys"
            )
        finally:
            client.close()
    shutil.rmtree(tmp_path / "l2-joined", ignore_errors=True)


def test_a_join_hands_the_moved_keys_over_before_a_client_asks(
    counted_s3: tuple[S3Server, LatencyProxy], tmp_path: Path
) -> None:
    """After a join, the nodes that gave up keys hand the new node the moved keys they cache (batches of
    copies, each filled into its cache as a read would fill it, checked against S3 a listing page at a time),
    so no client read waits on a peer fill. With no read at all, the new node holds every moved key; the
    epoch that follows is served from its cache: no fill, no peer read, no S3 request. Write-back keys are
    not handed over (another node may hold a newer value S3 lacks): their first reads ask the previous owner."""
    s3, proxy = counted_s3
    rng = random.Random(49)
    values = {f"hand/{i:04d}".encode(): rng.randbytes(rng.randrange(1000, 20_000)) for i in range(300)}
    back = {f"back/{i:04d}".encode(): rng.randbytes(2000) for i in range(60)}
    with running_cluster(s3, tmp_path, HANDOVER, SIZES, meta_nodes=1) as cluster:
        client = cluster.client()
        try:
            client.put_many(values)
            client.put_many(back)
            for server in cluster.servers:
                wait_until(lambda s=server: s.counters().get("dirty_keys", 0) == 0, 30, "write-back uploads")
            before = cluster.placement()
            joined = _join(cluster, tmp_path)
            after = cluster.wait_placement([s.address for s in cluster.servers], "the new server in the placement")
            moved = [k for k in values if after.locate(k) != before.locate(k)]
            moved_back = [k for k in back if after.locate(k) != before.locate(k)]
            assert len(moved) > 60 and moved_back

            wait_until(lambda: joined.counters().get("fills", 0) == len(moved), 30, "the moved keys handed over")
            handed = joined.counters()
            assert handed.get("peer_fills_listed") == len(moved) and "peer_fills_checked" not in handed
            assert handed.get("peer_fills", 0) == 0, "read from a previous owner, not handed over"
            requests = proxy.requests
            reader = cluster.client()
            try:
                assert reader.get_many(list(values)) == list(values.values())
            finally:
                reader.close()
            read = joined.counters()
            assert read["fills"] == len(moved) and read.get("peer_fills", 0) == 0, "a client read waited on a fill"
            assert proxy.requests == requests
            assert sum(server.counters().get("handover_keys", 0) for server in cluster.servers[:2]) == len(moved)
            assert client.get_many(moved_back) == [back[k] for k in moved_back]
            assert joined.counters().get("peer_fills", 0) == len(moved_back)  # asked their previous owners
        finally:
            client.close()
    shutil.rmtree(tmp_path / "l2-joined", ignore_errors=True)
