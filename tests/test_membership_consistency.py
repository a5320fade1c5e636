"""Issue 22's scenarios, one test each: what a membership change (a join, a kill, a drain, a shard rebuilt from
empty) or a client must not be able to do to the bytes a reader gets, S3, or a server's view of the placement.

Real processes throughout (a one-node metadata shard, cache servers, SeaweedFS),
except the forged-version test, which drives a server's `Ownership` directly.
A cache server's way to S3 runs through a `fault_proxy.FaultProxy` where a
test holds its uploads back (PUT and POST answered 503: write-back keeps
retrying, so a value stays dirty for as long as the test needs).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fault_proxy import Fault, FaultProxy

from cacheclient import CacheClientError
from cacheclient.meta import MetaClient, PlacementMap
from cacheclient.node import NodeClient
from cacheclient.wire import PLACEMENT_VERSION_METADATA, ROUTE_FALLBACK, ROUTE_METADATA
from cachesvc.devcluster.shard import LocalShard
from cachesvc.server.ownership import Ownership

from conftest import CacheServer, Cluster, S3Server, router_of, running_cluster, s3_args, wait_until

pytestmark = pytest.mark.timeout(180)

CONFIG = """
[[namespaces]]
prefix = "wb/"
write_mode = "write-back"

[[namespaces]]
prefix = "wbr/"
write_mode = "write-back"
replicas = 2

[[namespaces]]
prefix = "cor/"
write_mode = "cache-only"
replicas = 2

[[namespaces]]
prefix = "wtr/"
replicas = 2
"""
ONE = [("16MiB", "32MiB")]
TWO = ONE * 2
THREE = ONE * 3


def _values(prefix: str, n: int, tag: str = "v1") -> dict[bytes, bytes]:
    return {f"{prefix}{i:04d}".encode(): f"{prefix}{i:04d}={tag};".encode() * 20 for i in range(n)}


def server_args(cluster: Cluster, base: Path, name: str) -> list[str]:
    """A cache server's arguments like the others' (the cluster's config, its own L2 `name`, its shard and S3)."""
    return [
        "--config", str(base / "cachesvc.toml"), "--l1-bytes", "16MiB",
        "--l2-path", str(base / f"l2-{name}"), "--l2-bytes", "32MiB",
        "--meta", ",".join(cluster.shard.addresses), *s3_args(cluster.s3, cluster.prefix),
    ]  # fmt: skip


def join(cluster: Cluster, base: Path, name: str, s3_endpoint: str | None = None) -> CacheServer:
    """A cache server like the others (the cluster's config, its own L2), registered with the shard."""
    args = server_args(cluster, base, name)
    if s3_endpoint:
        args[args.index("--s3-endpoint") + 1] = s3_endpoint
    server = CacheServer(args, base / "logs", {"CACHESVC_META_HEARTBEAT_SECONDS": "0.3"}).start()
    cluster.servers.append(server)
    return server


def s3_object(cluster: Cluster, key: bytes) -> bytes | None:
    client = cluster.s3.client()
    try:
        return bytes(client.get_object(Bucket=cluster.s3.bucket, Key=cluster.prefix + key.decode())["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


def counters(server: CacheServer) -> dict[str, int]:
    with server.client(timeout=10.0) as plain:
        return dict(plain.stats()["counters"])


def held(server: CacheServer, keys: list[bytes]) -> list[bytes]:
    with server.client(timeout=10.0) as plain:
        return [k for k, found in zip(keys, plain.contains_many(keys, cached_only=True), strict=True) if found]


@pytest.fixture
def upload_gate(s3: S3Server) -> Iterator[FaultProxy]:
    """SeaweedFS behind a fault proxy; a test closes it to uploads with `.set(Fault.STATUS, methods=(PUT, POST))`."""
    proxy = FaultProxy(s3.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def hold_uploads(proxy: FaultProxy) -> None:
    proxy.set(Fault.STATUS, methods=("PUT", "POST"), status=503)


# ---------------------------------------------------------------------- a join moves keys


def test_a_key_deleted_after_a_join_moved_it_stays_deleted(s3: S3Server, tmp_path: Path) -> None:
    values = _values("k/del/", 200)
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1) as cluster, cluster.client() as client:
        client.put_many(values)
        assert client.get_many(list(values)) == list(values.values())  # cached on each key's owner
        before = cluster.placement()
        joined = join(cluster, tmp_path, "joined")
        after = cluster.wait_placement([s.address for s in cluster.servers], "the new server in the placement")
        moved = [k for k in values if after.locate(k) == joined.address != before.locate(k)]
        assert len(moved) > 20, f"only {len(moved)} keys moved to the new server"
        for key in moved:
            assert client.delete(key)
        came_back = [k for k, v in zip(moved, client.get_many(moved), strict=True) if v is not None]
        assert not came_back, (
            f"{len(came_back)} of {len(moved)} keys deleted after the join read again: {came_back[:5]}"
        )


def test_a_key_overwritten_in_s3_and_evicted_after_a_join_reads_new(s3: S3Server, tmp_path: Path) -> None:
    values = _values("k/evict/", 200)
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1) as cluster, cluster.client() as client:
        client.put_many(values)
        assert client.get_many(list(values)) == list(values.values())
        before = cluster.placement()
        joined = join(cluster, tmp_path, "joined")
        after = cluster.wait_placement([s.address for s in cluster.servers], "the new server in the placement")
        moved = [k for k in values if after.locate(k) == joined.address != before.locate(k)]
        assert len(moved) > 20, f"only {len(moved)} keys moved to the new server"
        # The documented workflow: replace the dataset in S3, then evict its prefix from the cache.
        s3_client = cluster.s3.client()
        new = {k: b"replaced in S3: " + k for k in moved}
        for key, value in new.items():
            s3_client.put_object(Bucket=cluster.s3.bucket, Key=cluster.prefix + key.decode(), Body=value)
        argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(cluster.shard.addresses)]
        evicted = subprocess.run([*argv, "evict", "--prefix", "k/evict/"], capture_output=True, text=True, timeout=60)
        assert evicted.returncode == 0, evicted.stderr
        got = client.get_many(moved)
        old = [k for k, v in zip(moved, got, strict=True) if v != new[k]]
        assert not old, f"{len(old)} of {len(moved)} replaced and evicted keys read old bytes: {old[:5]}"


@contextlib.contextmanager
def _two_nodes_behind_a_gate(
    s3: S3Server, tmp_path: Path, gate: FaultProxy, keys: dict[bytes, bytes]
) -> Iterator[tuple[Cluster, list[CacheServer], CacheServer, list[bytes]]]:
    """Servers A1, A2 (S3 through `gate`, uploads held back) take `keys` write-back; B (S3 direct) joins.

    Yields (cluster, [A1, A2], B, the keys that moved to B, still dirty on their A)."""
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1, s3_endpoint=gate.endpoint) as cluster:
        olds = list(cluster.servers)
        hold_uploads(gate)
        with cluster.client() as client:
            client.put_many(keys)
        wait_until(lambda: gate.injected["status"] > 0, 30.0, "the servers trying to upload")
        assert sum(counters(a)["dirty_keys"] for a in olds) == len(keys)
        b = join(cluster, tmp_path, "b")
        after = cluster.wait_placement([s.address for s in cluster.servers], "B in the placement")
        moved = [k for k in keys if after.locate(k) == b.address]
        assert len(moved) > 10, f"only {len(moved)} keys moved to B"
        yield cluster, olds, b, moved


def test_a_former_owners_delayed_upload_does_not_overwrite_newer_data(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy
) -> None:
    keys = _values("wb/late/", 120)
    with _two_nodes_behind_a_gate(s3, tmp_path, upload_gate, keys) as (cluster, olds, b, moved):
        rewritten, deleted = moved[: len(moved) // 2], moved[len(moved) // 2 :]
        with cluster.client() as client:
            newer = {k: b"v2 through the new owner: " + k for k in rewritten}
            client.put_many(newer)
            for key in deleted:
                client.delete(key)
        wait_until(lambda: counters(b)["dirty_keys"] == 0, 30.0, "B's uploads")
        upload_gate.clear()  # the former owners' retries get through now
        wait_until(lambda: sum(counters(a)["dirty_keys"] for a in olds) == 0, 60.0, "the former owners' retries")
        time.sleep(0.5)
        stale = [k for k in rewritten if s3_object(cluster, k) != newer[k]]
        back = [k for k in deleted if s3_object(cluster, k) is not None]
        assert not stale and not back, (
            f"S3 after the late uploads: {len(stale)} of {len(rewritten)} rewritten keys hold the older value "
            f"({stale[:3]}); {len(back)} of {len(deleted)} deleted keys are back ({back[:3]})"
        )
        with cluster.client() as client:
            assert client.get_many(rewritten) == [newer[k] for k in rewritten]
            assert client.get_many(deleted) == [None] * len(deleted)
        # B took its values after the join, as their sole writer: uploaded without asking S3 first. The former
        # owners took theirs before it: every one of their uploads asked S3 for the object's version first.
        assert counters(b)["writeback_unchecked"] >= len(rewritten)
        assert sum(counters(a).get("writeback_unchecked", 0) for a in olds) == 0


def test_uploaded_is_false_for_a_peer_filled_copy_of_a_value_not_in_s3(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy
) -> None:
    keys = _values("wb/filled/", 120)
    with _two_nodes_behind_a_gate(s3, tmp_path, upload_gate, keys) as (cluster, _olds, _b, moved):
        with cluster.client() as client:
            assert client.get_many(moved) == [keys[k] for k in moved]  # B fills them from their former owners
            located = client.locate_many(moved)
        assert all(where is not None for where in located)
        false = [
            k for k, where in zip(moved, located, strict=True) if where and where.uploaded and not s3_object(cluster, k)
        ]
        assert not false, f"{len(false)} of {len(moved)} keys say uploaded while S3 lacks them: {false[:5]}"


# ---------------------------------------------------------------------- a node killed and restarted


def test_a_restarted_node_does_not_serve_its_write_back_value_over_a_newer_one_its_stand_in_holds(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy
) -> None:
    # A holds v2 of its keys not yet uploaded (S3 has v1) and is killed; B, standing in, takes v3 of them,
    # also not uploaded; A comes back on its L2. Its v2 is newer than S3's v1, so a check against S3 alone
    # keeps it: A must ask the node that stood in for it.
    v1 = _values("wb/restart/", 120)
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1, s3_endpoint=upload_gate.endpoint) as cluster:
        a, b = cluster.servers
        with cluster.client() as client:
            client.put_many(v1)
        wait_until(lambda: counters(a)["dirty_keys"] + counters(b)["dirty_keys"] == 0, 30.0, "v1's uploads")
        ours = [k for k in v1 if cluster.placement().locate(k) == a.address]
        assert len(ours) > 20, f"only {len(ours)} of {len(v1)} keys are A's"
        hold_uploads(upload_gate)
        v2 = {k: b"v2 through A: " + k for k in ours}
        with cluster.client() as client:
            client.put_many(v2)
        assert counters(a)["dirty_keys"] == len(ours)
        a.kill()
        # (Not wait_placement: B owns every key then, so no probe of its map version is refused.)
        wait_until(lambda: cluster.up() == [b.address], 30.0, "A out of the placement", interval=0.1)
        v3 = {k: b"v3 through B, standing in: " + k for k in ours}
        with cluster.client() as client:
            client.put_many(v3)
        assert counters(b)["dirty_keys"] == len(ours)
        a.start()
        cluster.wait_placement([a.address, b.address], "A back in the placement")
        with cluster.client() as client:
            got = client.get_many(ours)
        older = [k for k, v in zip(ours, got, strict=True) if v != v3[k]]
        assert not older, (
            f"{len(older)} of {len(ours)} keys read an older value after A came back: "
            f"{[(k, g[:24]) for k, g in zip(ours, got, strict=True) if k in older][:3]}"
        )
        assert counters(a)["vouch_newer_at_peer"] == len(ours)
        upload_gate.clear()
        wait_until(lambda: counters(a)["dirty_keys"] + counters(b)["dirty_keys"] == 0, 60.0, "the uploads")
        stale = [k for k in ours if s3_object(cluster, k) != v3[k]]
        assert not stale, f"S3 holds an older value of {len(stale)} of {len(ours)} keys: {stale[:3]}"


def test_a_killed_holders_write_back_keys_are_withheld_until_it_returns_or_is_forgotten(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    # A holds v2 of its write-back keys, acknowledged and not uploaded (S3 has v1), and is killed. Its stand-in B
    # has nothing newer than S3's v1: before, B served v1 to every reader (the Jepsen run's stale reads); now it
    # refuses them until A is back (then v2), or an operator forgets A (then v1, the loss accepted).
    from cachesvc.commands.cachectl import main as cachectl_main

    v1 = _values("wb/lost/", 120)
    through = _values("k/lost/", 120)
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1, s3_endpoint=upload_gate.endpoint) as cluster:
        a, b = cluster.servers
        with cluster.client() as client:
            client.put_many({**v1, **through})
        wait_until(lambda: counters(a)["dirty_keys"] + counters(b)["dirty_keys"] == 0, 30.0, "v1's uploads")
        placement = cluster.placement()
        ours = [k for k in v1 if placement.locate(k) == a.address]
        ours_through = [k for k in through if placement.locate(k) == a.address]
        assert len(ours) > 20 and len(ours_through) > 20
        hold_uploads(upload_gate)
        v2 = {k: b"v2 through A: " + k for k in ours}
        with cluster.client() as client:
            client.put_many(v2)
        assert counters(a)["dirty_keys"] == len(ours)
        assert {n.address: n.holding for n in cluster.meta.nodes()}[a.address], "A did not say it holds values"

        def withheld_while_a_is_down() -> None:
            wait_until(lambda: cluster.up() == [b.address], 30.0, "A out of the placement", interval=0.1)
            wait_until(lambda: a.address in cluster.placement().holders, 10.0, "A named a holder in the map")
            with cluster.client(timeout=10.0) as client:
                served: list[bytes] = []
                for key in ours:
                    with contextlib.suppress(CacheClientError):
                        served.append(client.get(key) or b"")
                assert not served, f"B served {len(served)} of {len(ours)} of A's write-back keys: {served[:2]}"
                with pytest.raises(CacheClientError, match="withheld") as refused:
                    client.get(ours[0])
                assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
                # A caller that checks values against their names (content-addressed keys) takes what S3 has.
                assert client.verified_reads().get_many(ours[:5]) == [v1[k] for k in ours[:5]]
                # Write-through keys of A's slots are served by B as before.
                assert client.get_many(ours_through) == [through[k] for k in ours_through]

        a.kill()
        withheld_while_a_is_down()
        a.start()
        cluster.wait_placement([a.address, b.address], "A back in the placement")
        with cluster.client() as client:
            assert client.get_many(ours) == [v2[k] for k in ours]

        # Again, and this time the operator gives A up.
        a.kill()
        withheld_while_a_is_down()
        capsys.readouterr()
        assert cachectl_main(["--meta", ",".join(cluster.shard.addresses), "forget", b.address]) == 2  # up: refused
        assert cachectl_main(["--meta", ",".join(cluster.shard.addresses), "forget", a.address]) == 0
        assert "lost" in capsys.readouterr().out
        wait_until(lambda: not cluster.placement().holders, 10.0, "no holder left in the map")
        with cluster.client() as client:
            assert client.get_many(ours) == [v1[k] for k in ours]  # S3's value: A's v2 is given up
        cluster.servers.remove(a)


def test_a_fallback_read_after_a_quiet_owner_took_a_write_back_value_is_not_served_s3s_older_one(
    s3: S3Server, tmp_path: Path
) -> None:
    # A restarted with nothing dirty and told the shard it holds no write-back values; B's map says so. A takes
    # v2 of one of its keys (telling the shard first) and answers. A client that has just passed A over reads
    # the key from B as a fallback before B's next heartbeat: B's map names no holder, and before, B served
    # S3's v1 after v2 was acknowledged (a CI Jepsen run read one so). Now B asks the shard, and withholds it.
    v1 = _values("wb/quiet/", 60)
    # Heartbeats far apart: B's map stays as it is unless a call makes it catch up.
    with running_cluster(
        s3, tmp_path, CONFIG, TWO, meta_nodes=1, lease_seconds=120.0, heartbeat_seconds=30.0
    ) as cluster:
        a, b = cluster.servers
        placement = cluster.placement()
        ours = [k for k in v1 if placement.locate(k) == a.address]  # B takes none: it never holds any
        theirs = [k for k in _values("k/quiet/", 60) if placement.locate(k) == b.address]
        assert ours and theirs
        with cluster.client() as client:
            client.put_many({k: v1[k] for k in ours})
            client.put_many({k: k for k in theirs})
        wait_until(lambda: counters(a)["dirty_keys"] == 0, 30.0, "v1's uploads")
        a.kill()
        a.start()

        def holding() -> bool:
            return {n.address: n.holding for n in cluster.meta.nodes()}[a.address]

        wait_until(lambda: not holding(), 20.0, "A telling the shard it holds nothing")
        quiet = cluster.placement()
        assert not quiet.holders
        with NodeClient(b.address, timeout=10.0).with_metadata(((PLACEMENT_VERSION_METADATA, quiet.stamp),)) as routed:
            assert routed.get(theirs[0]) == theirs[0]  # routed by a newer map: B catches up with it
        assert counters(b)["placement_version"] == quiet.version
        with cluster.client() as client:
            client.put(ours[0], b"v2 through A")
        assert holding(), "A took a write-back value without telling the shard first"
        assert counters(b)["placement_version"] == quiet.version, "B's heartbeat came: the test proves nothing"
        fallback = ((PLACEMENT_VERSION_METADATA, quiet.stamp), (ROUTE_METADATA, ROUTE_FALLBACK))
        with NodeClient(b.address, timeout=10.0).with_metadata(fallback) as passed_over:
            with pytest.raises(CacheClientError, match="withheld") as refused:
                passed_over.get(ours[0])
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert passed_over.get(theirs[1]) == theirs[1]  # its own keys: served as ever
        with cluster.client() as client:
            assert client.get(ours[0]) == b"v2 through A"


def test_the_new_owners_first_read_after_a_drain_waits_for_the_old_owners_write_under_way(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy
) -> None:
    # A owns K (write-through). A put of v2 routed by the map before A's drain is under way at A (its S3 PUT
    # held back 1.5 s) when the drain gives K to B and a reader with the new map reads K from B. Before, B
    # vouched for v1 (what S3 and A held then), the put returned, and B served v1 on: stale for as long as it
    # stayed cached (a Jepsen run read one for seconds). Now B's first read fences A, which answers once the
    # write it took by the older map is done.
    values = _values("k/drain/", 40)
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1, s3_endpoint=upload_gate.endpoint) as cluster:
        a, b = cluster.servers
        with cluster.client() as client:
            client.put_many(values)
        key = next(k for k in values if cluster.placement().locate(k) == a.address)
        old = cluster.client()
        try:
            assert old.get(key) == values[key]  # A caches v1; this client routes by the map before the drain
            upload_gate.set(Fault.LATENCY, methods=("PUT",), times=1, delay=1.5)
            put_error: list[BaseException] = []
            returned_at: list[float] = []

            def put() -> None:
                try:
                    old.put(key, b"v2 through A")
                    returned_at.append(time.monotonic())
                except BaseException as exc:  # reported below
                    put_error.append(exc)

            writer = threading.Thread(target=put)
            writer.start()
            wait_until(lambda: upload_gate.injected["latency"] == 1, 10.0, "A's S3 PUT of v2 held back")
            cluster.meta.set_node_state(a.address, "draining")
            wait_until(lambda: cluster.up() == [b.address], 10.0, "A drained", interval=0.05)
            after = cluster.placement()
            assert after.locate(key) == b.address
            with cluster.client() as reader:
                first = reader.get(key)
                writer.join(timeout=30.0)
                assert not put_error and returned_at, f"the put failed: {put_error}"
                assert first in (values[key], b"v2 through A")
                assert reader.get(key) == b"v2 through A", "the new owner served v1 after the put of v2 returned"
        finally:
            old.close()
        assert counters(b)["fences_sent"] >= 1


def test_a_second_replica_drained_and_put_back_rereads_keys_rewritten_meanwhile(s3: S3Server, tmp_path: Path) -> None:
    # Keys of a two-replica namespace whose second replica (not owner) is B: B is drained, the keys are
    # rewritten (to their owner and the node that stands in as second replica), B is put back. B is one of
    # their replicas again and must not serve what it cached before.
    v1 = _values("wtr/second/", 300)
    with running_cluster(s3, tmp_path, CONFIG, THREE, meta_nodes=1, replicas={"wtr/": 2}) as cluster:
        b = cluster.servers[1]
        before = cluster.placement()
        seconds = [k for k in v1 if before.candidates(k)[1] == b.address]
        assert len(seconds) > 30, f"only {len(seconds)} keys have B as their second replica"
        with cluster.client() as client:
            client.put_many(v1)
        assert held(b, seconds) == seconds
        argv = [sys.executable, "-m", "cachesvc.commands.cachectl", "--meta", ",".join(cluster.shard.addresses)]
        drained = subprocess.run([*argv, "drain", b.address], capture_output=True, text=True, timeout=60)
        assert drained.returncode == 0, drained.stderr
        others = [s.address for s in cluster.servers if s is not b]
        cluster.wait_placement(others, "B drained")
        v2 = {k: b"v2 while B was drained: " + k for k in seconds}
        with cluster.client() as client:
            client.put_many(v2)
        back = subprocess.run([*argv, "drain", b.address, "--cancel"], capture_output=True, text=True, timeout=60)
        assert back.returncode == 0, back.stderr
        after = cluster.wait_placement([s.address for s in cluster.servers], "B back")
        assert all(b.address in after.candidates(k)[:2] for k in seconds)
        with b.client(timeout=10.0) as plain:  # B itself, as a client routed to it as a replica would read
            got = plain.get_many(seconds)
        older = [k for k, v in zip(seconds, got, strict=True) if v != v2[k]]
        assert not older, f"B served {len(older)} of {len(seconds)} keys as they were before the drain: {older[:3]}"


# ---------------------------------------------------------------------- a drained node put back


def _teach(server: CacheServer, placement: PlacementMap) -> None:
    """Makes `server` fetch the shard's map now: a call routed by `placement`, which it has not caught up with."""
    client = NodeClient(server.address, timeout=10.0).with_metadata(((PLACEMENT_VERSION_METADATA, placement.stamp),))
    try:
        client.contains(b"probe/teach")
    except CacheClientError:
        pass  # refused: not its key; the map was fetched all the same
    finally:
        client.close()


@pytest.mark.parametrize("meta", ["up", "down"])
def test_a_put_through_a_put_back_node_is_not_followed_by_the_old_owners_copy(
    s3: S3Server, tmp_path: Path, meta: str
) -> None:
    # The Jepsen slow run's last stale reads: A is drained (B owns its keys and caches them), then put back.
    # A writer whose client has the new map puts K through A; a reader whose client still has the map of the
    # drain reads K from B, which has not learned the new map yet (servers fetch it after each heartbeat,
    # here every half hour). Before fences B served its older copy after the put had returned.
    # "down": the shard stops answering once the writer has the new map, so A cannot fetch it either (as when a
    # fetch outlasts its deadline on a loaded machine). A took the put by the drain's map then, which gave it no
    # keys and so named no earlier owner to fence, and B served its older copy to every reader (a fresh-clone
    # CI run failed so: 25 of 25 keys). Now A refuses a write routed by a map it cannot catch up with.
    # Two fresh-clone CI runs' "down" put returned. The second said why: A held no map at all (version 0; its
    # first fetch found none, its next heartbeat half an hour away), and a server with no map took every
    # routed write unchecked, so it fenced nobody. Now it fetches one first, and refuses the write without
    # one (tests/test_ownership.py). The servers beat at start and then every half hour, in a lease of an
    # hour, so that A cannot learn the put-back map by a heartbeat either. On a loaded machine the writer's last
    # try can be the one its deadline cuts short: its error then names A's refusal before it (routing's `_reason`).
    stop_shard = meta == "down"
    shard = LocalShard(1, tmp_path / "meta", args=["--lease-seconds", "3600"])
    servers: list[CacheServer] = []
    try:
        shard.start()
        shard.leader(timeout=20.0)
        (tmp_path / "cachesvc.toml").write_text(CONFIG)
        cluster = Cluster(shard, servers, s3, "fence/")
        for name in ("a", "b"):
            args = server_args(cluster, tmp_path, name)
            servers.append(CacheServer(args, tmp_path / "logs", {"CACHESVC_META_HEARTBEAT_SECONDS": "1800"}).start())
        a, b = servers
        wait_until(lambda: cluster.up() == sorted([a.address, b.address]), 30.0, "both servers up", interval=0.1)
        cluster.meta.set_node_state(a.address, "draining")
        wait_until(lambda: cluster.up() == [b.address], 30.0, "A drained", interval=0.1)
        drained = cluster.placement()
        for server in servers:
            _teach(server, drained)
        values = _values("k/fence/", 60)
        with cluster.client() as writer, cluster.client() as reader:
            writer.put_many(values)  # all through B
            assert reader.get_many(list(values)) == list(values.values())  # the reader has the drain's map
            router_of(reader).placement_ttl = 3600.0  # and keeps it
            cluster.meta.set_node_state(a.address, "up")
            wait_until(lambda: cluster.up() == sorted([a.address, b.address]), 30.0, "A back", interval=0.1)
            back = writer.cluster.placement(refresh=True)
            mine = [k for k in values if back.locate(k) == a.address]
            assert len(mine) > 10, f"only {len(mine)} keys went back to A"
            newer = {k: b"v2 through A, put back: " + k for k in mine}
            held = counters(a)["placement_version"]
            assert held < back.version, f"A fetched the put-back map (version {back.version}) by itself: {held}"
            if stop_shard:
                shard.stop()
                try:
                    writer.put_many(newer, timeout=10.0)
                except CacheClientError as exc:
                    refused = exc
                else:
                    pytest.fail(
                        f"the put through A returned with the shard down; the writer's map: version "
                        f"{router_of(writer).placement().version}; A's counters: {counters(a)}"
                    )
                got = reader.get_many(mine)
                assert "placement" in str(refused), f"the error does not say why: {refused}"
                assert got == [values[k] for k in mine], "a refused put changed what the reader gets"
                assert counters(a)["refused_behind_map"] >= 1, f"A refused nothing as behind: {counters(a)}"
                return
            writer.put_many(newer)  # returns: every reader from now on must get v2
            got = reader.get_many(mine)
        older = [k for k, v in zip(mine, got, strict=True) if v != newer[k]]
        assert not older, f"{len(older)} of {len(mine)} keys read their value from before the put: {older[:3]}"
        assert counters(b)["fenced"] >= 1
        assert counters(a)["fences_sent"] >= 1
    finally:
        for server in servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        shard.stop()


def test_a_node_that_missed_the_maps_of_its_drain_fences_its_stand_in_and_rechecks_its_copies(
    s3: S3Server, tmp_path: Path
) -> None:
    # A Jepsen short run's stale reads (seed 514): X, cut off, lost its lease; the shard gave its keys to Y, which
    # took writes of them; then X came back, and the map X fetched placed every key where X's last one had.
    # X saw no move, so it fenced nobody: a put through X returned while Y, a heartbeat behind, still served
    # its older copy to readers routing by the map of the cut. Here A misses the maps of its drain the same way:
    # it is cut off from B (B's fence of it fails) and, beating every half hour, learns no map by itself.
    shard = LocalShard(1, tmp_path / "meta", args=["--lease-seconds", "3600"])
    servers: list[CacheServer] = []
    front: FaultProxy | None = None
    try:
        shard.start()
        shard.leader(timeout=20.0)
        (tmp_path / "cachesvc.toml").write_text(CONFIG)
        cluster = Cluster(shard, servers, s3, "missed/")
        env = {"CACHESVC_META_HEARTBEAT_SECONDS": "1800"}
        for name in ("a", "b"):
            server = CacheServer(server_args(cluster, tmp_path, name), tmp_path / "logs", env)
            if name == "a":  # peers and clients reach A through a proxy the test can cut
                front = FaultProxy(server.address).start()
                server.args += ["--advertise", front.endpoint.removeprefix("http://")]
            servers.append(server.start())
        assert front is not None
        a, b = servers
        a_address = front.endpoint.removeprefix("http://")
        wait_until(lambda: cluster.up() == sorted([a_address, b.address]), 30.0, "both servers up", interval=0.1)
        values = _values("k/missed/", 60)
        with cluster.client() as writer:
            writer.put_many(values)  # v1, each key through its owner
            mine = [k for k in values if writer.cluster.placement(refresh=True).locate(k) == a_address]
            assert len(mine) > 10, f"only {len(mine)} keys are A's"
            held, before = counters(a)["placement_version"], cluster.placement()
            front.set(Fault.DOWN)
            cluster.meta.set_node_state(a_address, "draining")
            wait_until(lambda: cluster.up() == [b.address], 30.0, "A drained", interval=0.1)
            drained = cluster.placement()
            _teach(b, drained)
            with cluster.client() as reader:
                v2 = {k: b"v2 through B, A drained: " + k for k in mine}
                writer.put_many(v2)  # through B, whose fence of A fails
                assert reader.get_many(mine) == [v2[k] for k in mine]  # the reader has the drain's map
                router_of(reader).placement_ttl = 3600.0  # and keeps it
                front.clear()
                cluster.meta.set_node_state(a_address, "up")
                wait_until(lambda: cluster.up() == sorted([a_address, b.address]), 30.0, "A back", interval=0.1)
                back = writer.cluster.placement(refresh=True)
                assert counters(a)["placement_version"] == held < drained.version < back.version
                # The map A will fetch places every key where A's last one did: by layout, nothing moved.
                assert (back.nodes, back.slots) == (before.nodes, before.slots)
                half = mine[: len(mine) // 2]
                v3 = {k: b"v3 through A, put back: " + k for k in half}
                writer.put_many(v3)  # returns: every reader from now on must get v3
                got = reader.get_many(half)
            older = [k for k, v in zip(half, got, strict=True) if v != v3[k]]
            assert not older, f"{len(older)} of {len(half)} keys read from B after the put through A: {older[:3]}"
            # A's own copies of the other keys are v1, from before the drain: B took v2 meanwhile.
            rest = mine[len(half) :]
            with cluster.client() as fresh:
                got = fresh.get_many(rest)
            older = [k for k, v in zip(rest, got, strict=True) if v != v2[k]]
            assert not older, f"A served {len(older)} of {len(rest)} copies from before its drain: {older[:3]}"
        assert counters(b)["fenced"] >= 1 and counters(a)["fences_sent"] >= 1
    finally:
        for server in servers:
            if server.process is not None and server.process.alive():
                server.stop(grace=10.0)
        if front is not None:
            front.stop()
        shard.stop()


# ---------------------------------------------------------------------- replicas


@pytest.mark.parametrize("prefix", ["wbr/", "cor/"])
def test_a_put_with_one_replica_down_fails_naming_it(s3: S3Server, tmp_path: Path, prefix: str) -> None:
    # A long lease: the shard keeps naming the killed server while the puts run.
    with running_cluster(
        s3, tmp_path, CONFIG, THREE, meta_nodes=1, lease_seconds=60.0, replicas={"wbr/": 2, "cor/": 2}
    ) as cluster:
        victim = cluster.servers[0]
        placement = cluster.placement()
        # Each put waits out its deadline for the replica that does not answer: three keys, 2 s each.
        keys = [k for k in _values(prefix, 200) if victim.address in placement.candidates(k)[:2]][:3]
        assert keys
        victim.kill()
        returned = []
        with cluster.client(timeout=2.0) as client:
            for key in keys:
                try:
                    client.put(key, b"two copies or an error")
                except CacheClientError as exc:
                    assert victim.address in str(exc), f"the error does not name the replica down: {exc}"
                    continue
                returned.append(key)
        assert not returned, f"{len(returned)} of {len(keys)} puts returned with replica {victim.address} down"


def test_a_release_unpins_every_replica(s3: S3Server, tmp_path: Path) -> None:
    with running_cluster(s3, tmp_path, CONFIG, TWO, meta_nodes=1, replicas={"wtr/": 2}) as cluster:
        values = _values("wtr/", 40)
        with cluster.client() as client:
            client.put_many(values, lease=300.0)
            pinned = [counters(s).get("pinned_keys", 0) for s in cluster.servers]
            assert pinned == [len(values)] * 2, f"pinned keys per replica after the leased puts: {pinned}"
            assert client.get_many(list(values), release=True) == list(values.values())
        pinned = [counters(s).get("pinned_keys", 0) for s in cluster.servers]
        assert pinned == [0, 0], f"pinned keys per replica after get(release=True): {pinned}"


# ---------------------------------------------------------------------- checkpoint retention


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_retention_deletes_nothing_while_the_newest_manifests_node_is_down(
    s3: S3Server, tmp_path: Path, upload_gate: FaultProxy
) -> None:
    torch = pytest.importorskip("torch")
    from cacheclient.checkpoint import apply_retention, checkpoint_status, load, save
    from cacheclient.checkpoint.catalog import CheckpointKeys

    keys = CheckpointKeys()
    config = CONFIG + '\n[[namespaces]]\nprefix = "ckpt/"\nwrite_mode = "write-back"\n'
    with running_cluster(s3, tmp_path, config, THREE, meta_nodes=1, s3_endpoint=upload_gate.endpoint) as cluster:
        # The checkpoints live in the cache alone (PUTs refused; a delete, a POST, goes through).
        upload_gate.set(Fault.STATUS, methods=("PUT",), status=503)
        run = f"run-{time.time_ns()}"
        names = [f"{run}/step-1", f"{run}/step-2"]
        torch.manual_seed(22)
        weights = {f"layer{i}": torch.randn(128, 128) for i in range(4)}
        saved = {}
        with cluster.client() as cache:
            for name in names:
                weights["layer0"] = torch.randn(128, 128)  # three of four tensors shared by both
                saved[name] = {k: v.clone() for k, v in weights.items()}
                save(saved[name], cache, name)
        record = cluster.meta.get_manifest(keys.commit_record(names[1]))
        assert record is not None
        manifest_key = record.items[0].key.encode()
        victim = cluster.server(cluster.placement().locate(manifest_key))
        victim.kill()  # the node holding the newest manifest, down for a moment
        rest = [s.address for s in cluster.servers if s is not victim]
        cluster.wait_placement(rest, "the shard to drop the manifest's node")
        with cluster.client(timeout=5.0) as cache:
            try:
                apply_retention(cache, run, keep_last=1)
            except Exception as exc:  # refusing (fail closed) is right; what it deleted is what counts
                print(f"retention raised: {exc!r}")
        victim.start()
        upload_gate.clear()
        cluster.wait_placement([s.address for s in cluster.servers], "the manifest's node back")
        with cluster.client() as cache:
            status = checkpoint_status(cache, names[1], keys=keys)
            assert status.state != "damaged", f"the kept checkpoint lost chunks: {status}"
            restored = load(cache, names[1])
        for k, v in saved[names[1]].items():
            assert torch.equal(restored[k], v), k


# ---------------------------------------------------------------------- placement versions


def test_clients_and_servers_follow_a_shard_rebuilt_from_empty(s3: S3Server, tmp_path: Path) -> None:
    with running_cluster(s3, tmp_path, CONFIG, THREE, meta_nodes=1) as cluster:
        client = cluster.client(timeout=5.0)
        try:
            client.put(b"k/warm", b"the client has the shard's map")
            for _ in range(3):  # versions climb: drain and put back a node
                cluster.meta.set_node_state(cluster.servers[0].address, "draining")
                cluster.wait_placement([s.address for s in cluster.servers[1:]], "the drain")
                cluster.meta.set_node_state(cluster.servers[0].address, "up")
                cluster.wait_placement([s.address for s in cluster.servers], "the node back")
            old_version = cluster.placement().version
            assert old_version > 4
            # The shard's only node loses its disk: a new one on the same port, empty.
            port = int(cluster.shard.addresses[0].rpartition(":")[2])
            cluster.shard.stop()
            rebuilt = LocalShard(1, tmp_path / "meta-rebuilt", ports=[port], args=["--lease-seconds", "2.0"])
            try:
                rebuilt.start()
                rebuilt.leader(timeout=20.0)
                third = join(cluster, tmp_path, "third")
                meta = MetaClient(rebuilt.addresses, timeout=5.0)
                try:
                    everyone = sorted(s.address for s in cluster.servers)
                    wait_until(
                        lambda: sorted(meta.placement(refresh=True).nodes) == everyone,
                        30.0,
                        "every server registered with the rebuilt shard",
                    )
                    placement = meta.placement(refresh=True)
                finally:
                    meta.close()
                assert placement.version < old_version
                values = _values("k/rebuilt/", 150)
                thirds = [k for k in values if placement.locate(k) == third.address]
                assert thirds

                def routed_by_the_new_map() -> bool:
                    try:
                        client.put_many({k: values[k] for k in thirds})
                    except CacheClientError:
                        return False
                    return len(held(third, thirds)) == len(thirds)

                wait_until(routed_by_the_new_map, 20.0, "the running client to route by the rebuilt shard's map")
            finally:
                rebuilt.stop()
        finally:
            client.close()


def _pmap(version: int) -> PlacementMap:
    static = PlacementMap.static(["a:1", "b:1", "c:1"], [100, 100, 100])
    return PlacementMap(version, static.nodes, static.slots, static.capacities)


def test_a_forged_client_placement_version_changes_nothing_a_server_believes() -> None:
    ownership = Ownership("a:1")
    placement = _pmap(5)
    ownership.update(placement)
    others = [k for k in (f"k/{i}".encode() for i in range(200)) if placement.locate(k) != "a:1"]
    before = {k: ownership.previous_owners(k) for k in others}
    # A bad or old client names a version the shard never made.
    ownership.check(others[:1], {PLACEMENT_VERSION_METADATA: str(10**9)})
    after = {k: ownership.previous_owners(k) for k in others}
    changed = [k for k in others if before[k] != after[k]]
    assert not changed, (
        f"after one forged version, fills of {len(changed)} keys ask their current owners first: "
        f"{changed[0]!r} {before[changed[0]]} -> {after[changed[0]]}"
    )
